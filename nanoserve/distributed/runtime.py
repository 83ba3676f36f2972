"""Chapter 08: this process's part in a tensor-parallel LLM: its rank, its shard, and the group.

`start` is what `LLM(tensor_parallel_size=N)` calls: join the launched group, or spawn the workers;
then load this rank's shard. Rank 0 gets the `Group` that reaches the others; any other rank (only
under a launcher) gets a `Worker` that runs what rank 0 sends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.distributed.group import Group, Stop, cpu_threads, join_launched, launched_world, rank_device, spawn_workers
from nanoserve.distributed.loader import load_shard
from nanoserve.distributed.sharding import ShardPlan, check_tensor_parallel_size
from nanoserve.distributed.worker import ProfilePeak, TensorParallelRunner, Worker, receive_broadcast
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import resolve_dtype


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module            # this rank's shard
    group: Group | None = None        # rank 0
    worker: Worker | None = None      # ranks 1..N-1 under a launcher
    threads_before: int | None = None
    closed: bool = False

    @property
    def launched(self) -> bool:
        return self.group is None or not self.group.spawned

    def serve(self):
        """A launched rank other than 0: run rank 0's steps until it stops; its payload (an error is raised)."""
        payload = self.worker.serve(receive_broadcast)
        if isinstance(payload, BaseException):
            raise payload
        return payload

    def share_activation_peak(self, num_tokens: int, num_sampled: int) -> None:
        """Rank 0 is about to run the activation-peak forward that sizes a GPU's pool: the other ranks run it too
        (its collectives must meet theirs). A CPU's pool is not sized from it."""
        if self.device.type == "cuda":
            self.group.send(ProfilePeak(num_tokens, num_sampled))

    def runner(self, num_kv_blocks: int, block_size: int, seed: int) -> TensorParallelRunner:
        """Rank 0's ModelRunner, which sends every step to the other ranks; launched ranks return from their
        LLM(...) now."""
        runner = TensorParallelRunner(self.model, num_kv_blocks, block_size, seed, self.group)
        self.finish()
        return runner

    def finish(self, payload=None) -> None:
        """Rank 0 under a launcher: release the others (from __init__ or generate) with `payload`."""
        if self.launched and self.rank == 0:
            self.group.send(Stop(payload))

    def shutdown(self) -> None:
        if self.closed:   # once: a later call (a finalizer) must not tear down a newer LLM's group
            return
        self.closed = True
        if self.launched and dist.is_initialized():
            # every launched rank leaves together: a rank that tears its group down while another still
            # reads from it makes gloo abort that process
            try:
                dist.barrier()
            except Exception:
                pass
        if self.group is not None:
            self.group.shutdown()
        elif dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None


def start_ranks(path: str, world_size, device: torch.device, dtype) -> TensorParallel:
    """What `LLM(tensor_parallel_size=N)` calls: check N against the model and the machine before any process
    starts, then start the ranks (or join the launched group)."""
    cfg = ModelConfig.from_path(path)
    check_tensor_parallel_size(cfg, world_size, device)
    return start(path, cfg, world_size, device, resolve_dtype(dtype, device))


def start(path: str, cfg: ModelConfig, world_size: int, device: torch.device, dtype: torch.dtype) -> TensorParallel:
    if device.type == "cpu" and dtype != torch.float32:
        raise ValueError(f"tensor parallelism on a CPU runs float32: gloo, its collective backend, has no "
                         f"{dtype} all-reduce (pass dtype='float32' or 'auto')")
    threads = None
    if launched_world() is not None:
        rank = join_launched(device, world_size)
        device = rank_device(device, rank)
        model = load_shard(path, ShardPlan(cfg, rank, world_size), device, dtype)
        if rank == 0:
            return TensorParallel(0, world_size, device, model, group=Group(world_size))
        return TensorParallel(rank, world_size, device, model, worker=Worker(model, rank))
    device = rank_device(device, 0)
    if device.type == "cpu":   # the ranks share this machine's cores
        threads = torch.get_num_threads()
        torch.set_num_threads(cpu_threads(world_size))
    try:
        model = load_shard(path, ShardPlan(cfg, 0, world_size), device, dtype)
        group = spawn_workers(world_size, device, (str(path), dtype))
    except BaseException:
        if threads is not None:
            torch.set_num_threads(threads)
        raise
    return TensorParallel(0, world_size, device, model, group=group, threads_before=threads)
