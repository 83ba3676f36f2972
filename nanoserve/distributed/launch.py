"""Run a function on N ranks of a torch.distributed group, from a script, a test or a notebook, bounded.

    from nanoserve.distributed.launch import run_group
    sizes = run_group(my_module.fn, 2)          # fn(rank, world_size) on two processes; [rank 0's, rank 1's]

Each rank is a fresh interpreter started with multiprocessing's "spawn" method, never a fork: a
forked child inherits the parent's threads (OpenMP's, Jupyter's) in whatever state they were in, and
CUDA cannot be forked at all. Spawn is also the start method that works inside Jupyter, with one
condition: the child re-imports `fn` by its module and name, so `fn` must be importable (defined in
a module, e.g. in `nanoserve/`), not defined in a notebook cell or in a script run as `__main__`
(`accelerate.notebook_launcher` has the same rule for the same reason). Its arguments and return
values travel pickled. A script (not a notebook) is re-imported by every rank, so it must call
run_group under `if __name__ == "__main__":`, as with any spawn.

Nothing here waits forever: the group's collectives time out after `timeout_s`, the whole call has a
wall-clock deadline, and a rank that raises or dies makes `run_group` raise a `RuntimeError` naming
it, after terminating the other ranks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from nanoserve.ports import free_port


def _rank_main(fn, rank, world_size, args, port, backend, timeout_s, num_threads, results) -> None:
    """One rank: join the group, run fn, send back ("ok", pickled value) or ("error", traceback).

    The result goes out before the group is torn down: a failing rank's own error then reaches the parent
    ahead of the errors its leaving causes in the others' collectives.
    """
    import torch
    import torch.distributed as dist
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        message = (rank, "ok", pickle.dumps(value))   # pickled here, so a bad value is this rank's error
    except BaseException as e:   # noqa: BLE001 - every failure goes back to the parent, named
        message = (rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
    results.put(message)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # a group a peer left may not tear down cleanly; this process exits anyway
            pass
    # leave as soon as the result is in the pipe, without the interpreter's teardown (freeing every module
    # of torch: ~0.6 s that run_group would wait out)
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure_message(world_size: int, dead: dict, errors: dict) -> str:
    """Dead ranks first (a rank that dies makes the others' collectives fail), then errors as they came."""
    parts = []
    for r, code in dead.items():
        how = (f"killed by signal {-code}" if code < 0 else "exited without returning a result" if code == 0
               else "exited")
        parts.append(f"rank {r} of {world_size} died with exit code {code} ({how})")
        if code == 1:
            parts[-1] += ("; its traceback is on stderr. Spawn re-imports the main script in every rank: a "
                          "script that calls run_group must do it under `if __name__ == \"__main__\":`")
    for r, text in errors.items():
        parts.append(f"rank {r} of {world_size} failed: {text}")
    if len(parts) > 1:
        parts[1] = "then " + parts[1]
    return "\n".join(parts)


def _stop(procs) -> None:
    """Terminate every rank still running; kill any that ignores it. Leaves no process behind."""
    procs = [p for p in procs if p.pid is not None]   # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_group(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout_s: float = 60.0,
              deadline_s: float | None = None, num_threads: int | None = 1) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes joined in one group; their returns by rank.

    Each process calls `torch.distributed.init_process_group(backend, init_method="tcp://127.0.0.1:<free port>",
    rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))` before `fn` and destroys the group
    after it. `fn` must be importable by the child (a function in a module, not one defined in a notebook cell or
    in `__main__`): spawn re-imports it by name, which is also why spawn works inside Jupyter where fork does not.
    `num_threads` is each rank's `torch.set_num_threads` (1 by default: N ranks share a small machine's cores;
    None leaves torch's default).

    Bounded: if a rank raises, or its process dies, the others are terminated and a RuntimeError names the rank
    and its error (or exit code); ranks that died are named first, then errors in the order they came (a rank
    that leaves makes its peers' collectives fail too: the first named is the cause). The whole call has a deadline, `deadline_s` (default 3 x timeout_s), after which
    every rank is terminated and a RuntimeError says which ranks had not finished.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    deadline_s = 3 * timeout_s if deadline_s is None else deadline_s
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, name=f"nanoserve-rank{rank}", daemon=True,
                         args=(fn, rank, world_size, args, port, backend, timeout_s, num_threads, results))
             for rank in range(world_size)]
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}        # rank -> its error, in the order they came
    dead: dict[int, int] = {}          # rank -> exit code, for a process gone without a result
    exited_at: dict[int, float] = {}   # when a rank was first seen gone cleanly, its result not yet read
    give_up_at = None                  # after the first failure, a moment to hear the others' (the cause)
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.start()
        while len(values) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.1)
                if status == "error":
                    errors[rank] = payload
                else:
                    values[rank] = pickle.loads(payload)
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in values or r in errors or r in dead or p.exitcode is None:
                    continue
                if p.exitcode != 0:
                    dead[r] = p.exitcode
                elif now - exited_at.setdefault(r, now) > 5.0:   # its result may still be in the pipe
                    dead[r] = 0
            if (errors or dead) and give_up_at is None:
                give_up_at = now + 1.0
            if give_up_at is not None and (now > give_up_at or len(errors) + len(dead) + len(values) == world_size):
                raise RuntimeError(_failure_message(world_size, dead, errors))
            if now > deadline:
                missing = [r for r in range(world_size) if r not in values]
                raise RuntimeError(f"run_group deadline of {deadline_s:.0f} s passed; ranks {missing} of "
                                   f"{world_size} had not finished (terminated)")
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        _stop(procs)
        results.close()
        results.join_thread()


__all__ = ["free_port", "run_group"]

