"""Chapter 08: what a rank runs. Rank 0 schedules and samples; every rank runs the same forward.

`TensorParallelRunner` is rank 0's ModelRunner: before each forward it sends the step to the other
ranks, then runs its own shard; the collectives inside the forward meet theirs. `Worker` is every other
rank: a shard, a KV pool of its own k/v heads, and a loop that runs what rank 0 sends.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from nanoserve.distributed.group import Group, Stop, backend_for, cpu_threads, rank_device, timeout_s
from nanoserve.distributed.loader import load_shard
from nanoserve.distributed.sharding import ShardPlan
from nanoserve.engine.model_runner import ModelRunner, StepPlan, profile_activation_peak
from nanoserve.models.config import ModelConfig


@dataclass
class Setup:
    """Rank 0 sized the KV pool: every rank allocates the same number of blocks for its heads."""
    num_kv_blocks: int
    block_size: int
    seed: int
    kernel_backend: str | None = None


@dataclass
class ProfilePeak:
    """Run the activation-peak forward with rank 0 (on a GPU, where the pool is sized from it)."""
    num_tokens: int
    num_sampled: int


class WorkerTask:
    """A message that runs itself on every worker: the seam through which tooling (chapter 08's per-rank
    profiler, `perf.ranks`) reaches the ranks without this module importing it. Unpickling the
    message loads its module in the worker. `run` returns what to send back to rank 0, or None."""

    def run(self, worker: "Worker") -> object | None:
        raise NotImplementedError


class TensorParallelRunner(ModelRunner):
    def __init__(self, model, num_kv_blocks: int, block_size: int, seed: int, group: Group,
                 kernel_backend: str | None = None):
        group.send(Setup(num_kv_blocks, block_size, seed, kernel_backend))
        super().__init__(model, num_kv_blocks, block_size, seed, kernel_backend)
        self.group = group

    def forward(self, plan: StepPlan):
        self.group.send(plan)
        try:
            return super().forward(plan)
        except RuntimeError as e:   # a collective failed: say which rank, if one is gone
            raise self.group.failure(e) from None


class Worker:
    """A rank other than 0."""

    def __init__(self, model, rank: int):
        self.model, self.rank, self.runner = model, rank, None

    @classmethod
    def build(cls, rank: int, world_size: int, device: torch.device, path: str, dtype: torch.dtype) -> "Worker":
        plan = ShardPlan(ModelConfig.from_path(path), rank, world_size)
        return cls(load_shard(path, plan, device, dtype), rank)

    def serve(self, receive, reply=None):
        """Run messages from `receive()` until a Stop; returns its payload. `reply(obj)` answers rank 0."""
        while True:
            msg = receive()
            if isinstance(msg, StepPlan):
                self.runner.forward(msg)
            elif isinstance(msg, Setup):
                self.runner = ModelRunner(self.model, msg.num_kv_blocks, msg.block_size, msg.seed, msg.kernel_backend)
            elif isinstance(msg, ProfilePeak):
                profile_activation_peak(self.model, msg.num_tokens, msg.num_sampled)
            elif isinstance(msg, WorkerTask):
                answer = msg.run(self)
                if answer is not None:
                    reply(answer)
            elif isinstance(msg, Stop):
                return msg.payload
            else:
                raise TypeError(f"tensor-parallel worker got an unknown message {type(msg).__name__}")


def receive_broadcast():
    """A launched rank's receive: rank 0's next message, by broadcast (bounded by the group's timeout)."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_main(conn: Connection) -> None:
    """A started rank: load the shard, join the group, then run what rank 0 sends until it says stop."""
    rank, world_size, port, device_type, build_args = pickle.loads(conn.recv_bytes())
    try:
        dev = rank_device(torch.device(device_type), rank)
        if dev.type == "cpu":
            torch.set_num_threads(cpu_threads(world_size))
        worker = Worker.build(rank, world_size, dev, *build_args)
        conn.send_bytes(pickle.dumps("ready"))
    except Exception:
        conn.send_bytes(pickle.dumps(traceback.format_exc(limit=4)))
        return
    dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s()))

    def receive():
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):   # rank 0 is gone: nothing left to serve
            return Stop()

    try:
        worker.serve(receive, lambda obj: conn.send_bytes(pickle.dumps(obj)))
    finally:
        conn.close()
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":   # a worker process, started by group.spawn_workers with its end of a socket pair
    # run the imported module's function, not this __main__ copy: the messages unpickle as its classes
    from nanoserve.distributed.worker import worker_main as main
    main(Connection(int(sys.argv[1])))
    # leave without the interpreter's teardown (freeing every module of torch: ~0.6 s that rank 0 waits
    # out at each shutdown); the group is destroyed and the socket closed, so nothing is left to finish
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
