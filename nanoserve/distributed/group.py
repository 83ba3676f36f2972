"""Chapter 08: the ranks of a tensor-parallel engine and how rank 0 tells them what to run.

Two ways to get N ranks, one engine:

- Started by the engine: `LLM(tensor_parallel_size=N)` in a plain process (a script, a notebook) is
  rank 0 and starts ranks 1..N-1 itself, as vLLM and nano-vllm do. Each is a fresh interpreter,
  `python -m nanoserve.distributed.worker`, never a fork: a forked child inherits the parent's threads
  (OpenMP's, Jupyter's) in whatever state they were, and CUDA cannot be forked at all.
  multiprocessing's "spawn" also starts fresh, but it re-imports the parent's main script, which then
  needs an `if __name__ == "__main__":` guard; starting the module directly needs none, and works the
  same from a notebook. Rank 0 sends each step down a socket pair to every worker: a worker waits for
  work without a timeout (a notebook may sit idle for an hour), and a socket that closes tells it
  rank 0 is gone.
- Launched: under `torchrun --nproc-per-node N` or `accelerate launch` every rank runs the user's
  script, and the engine joins the group they set up (RANK, WORLD_SIZE, MASTER_ADDR in the
  environment). Rank 0 broadcasts each step with `broadcast_object_list`.

Either way the scheduler runs on rank 0 only, and the other ranks run the forward it sends (a
`StepPlan`: token ids, positions, block tables). Only rank 0 has the requests (in a server, only it
hears them), and sampling happens once, with each request's own generator; identical schedulers on
every rank would need every add_request and abort delivered to every rank in the same order.

Every collective has a timeout (`NANOSERVE_TP_TIMEOUT_S`, default 120 s), and a rank that dies takes
the engine down with an error naming it.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

from nanoserve.ports import free_port

import torch
import torch.distributed as dist
# Imported before any group exists, on purpose. Its functions take `group=group.WORLD` as a default
# argument, evaluated when the module is first imported: imported after init_process_group (as
# torch._dynamo imports it, and building a model on the meta device imports torch._dynamo) the
# defaults keep the default group alive after destroy_process_group, with its gloo threads running
# into interpreter exit, where one of them can abort the process ("terminate called without an
# active exception", exit -6) after all the work is done. Imported now, the defaults are None.
import torch.distributed.nn.functional  # noqa: F401

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]   # where `import nanoserve` finds this copy
STARTUP_TIMEOUT_S = 300.0     # loading a shard can be slow on a loaded machine; bounded all the same


def timeout_s() -> float:
    return float(os.environ.get("NANOSERVE_TP_TIMEOUT_S", "120"))


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def launched_world() -> tuple[int, int] | None:
    """(rank, world_size) when torchrun or accelerate launched this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: its own GPU (the local rank under a launcher), or the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cpu_threads(world_size: int) -> int:
    """Cores per rank on a CPU, at least one: N ranks share the machine's cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


class Stop:
    """The end of a run: a spawned worker exits; a launched rank returns `payload` from generate."""

    def __init__(self, payload=None):
        self.payload = payload


class TensorParallelError(RuntimeError):
    """A rank of the group failed; the engine cannot go on."""


class Group:
    """Rank 0's side: the other ranks, how to reach them, and what to say when one is gone."""

    def __init__(self, world_size: int, procs=None, conns=None):
        self.world_size = world_size
        self.procs, self.conns = procs, conns     # set when this process started the workers
        self.broken: str | None = None
        self.closed = False

    @property
    def spawned(self) -> bool:
        return self.procs is not None

    def send(self, msg) -> None:
        """Everyone else receives `msg` (a StepPlan, a setup message or a Stop)."""
        self.check()
        try:
            if self.spawned:
                data = pickle.dumps(msg)
                for conn in self.conns:
                    conn.send_bytes(data)
            else:
                dist.broadcast_object_list([msg], src=0)
        except Exception as e:
            raise self.failure(e) from None

    def check(self) -> None:
        if self.broken:
            raise TensorParallelError(f"the tensor-parallel group is down: {self.broken}")

    def failure(self, error: Exception) -> TensorParallelError:
        """The error to raise after a send or a collective failed: which rank died, if one did."""
        time.sleep(0.2)   # a dying worker's exit code appears a moment after its sockets close
        dead = [(r, p.returncode) for r, p in enumerate(self.procs or [], start=1) if p.poll() is not None]
        if dead:
            self.broken = ", ".join(f"worker rank {r} exited with code {c}" for r, c in dead)
        else:
            self.broken = f"a collective failed ({type(error).__name__}: {error})"
        self.shutdown(graceful=False)
        return TensorParallelError(f"tensor-parallel engine stopped: {self.broken}")

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:   # once: a later call (a finalizer) must not tear down a newer LLM's group
            return
        self.closed = True
        if self.spawned:
            for conn in self.conns:
                try:
                    if graceful and not self.broken:
                        conn.send_bytes(pickle.dumps(Stop()))
                    conn.close()
                except OSError:
                    pass
            deadline = time.monotonic() + (10 if graceful else 0)
            for p in self.procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            self.procs, self.conns = [], []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:   # a broken group may not tear down cleanly; the processes are gone either way
                pass
        self.broken = self.broken or "shut down"


def join_launched(device: torch.device, world_size: int) -> int:
    """Join the group torchrun or accelerate launched (once per process); returns this rank."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method="env://", timeout=timedelta(seconds=timeout_s()))
    if dist.get_world_size() != world_size:
        raise ValueError(f"tensor_parallel_size = {world_size}, but the launcher started {dist.get_world_size()} "
                         f"processes (WORLD_SIZE): they must be equal")
    return dist.get_rank()


def spawn_workers(world_size: int, device: torch.device, build_args: tuple) -> Group:
    """Start ranks 1..N-1, wait (bounded) until each has loaded its shard, then form the group as rank 0."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                           "LLM that was not shut down?): call llm.shutdown() on it first")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    procs, conns = [], []
    group = Group(world_size, procs, conns)
    try:
        for rank in range(1, world_size):
            ours, theirs = socket.socketpair()
            procs.append(subprocess.Popen([sys.executable, "-m", "nanoserve.distributed.worker", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL))
            theirs.close()
            conns.append(Connection(ours.detach()))
            conns[-1].send_bytes(pickle.dumps((rank, world_size, port, device.type, build_args)))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (p, conn) in enumerate(zip(procs, conns), start=1):
            while not conn.poll(0.1):
                if p.poll() is not None:
                    raise TensorParallelError(f"worker rank {rank} exited with code {p.returncode} while starting")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"worker rank {rank} did not load its shard in {STARTUP_TIMEOUT_S:.0f} s")
            status = pickle.loads(conn.recv_bytes())
            if status != "ready":
                raise TensorParallelError(f"worker rank {rank} failed to start: {status}")
        dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s()))
    except BaseException:
        group.broken = "failed to start"
        group.shutdown(graceful=False)
        raise
    return group
