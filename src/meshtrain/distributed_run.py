"""``run_distributed(world_size, fn, *args)``: run ``fn(*args)`` on N CPU processes over gloo.

Used by the test suite (every multi-process test), `meshtrain verify` and `meshtrain bench`.

Each worker is a fresh ``spawn``-ed interpreter with one intra-op thread (so 8 workers on 2 cores
do not thrash), joined into a gloo process group on a free loopback port. The function's return
values come back as a list indexed by rank. An exception on any rank is re-raised in the test
with that rank's traceback; a hang past ``timeout`` kills every worker and fails the test.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


class DistributedTestError(AssertionError):
    """A rank raised, crashed or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
            results: mp.Queue, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads), MESHTRAIN_THREADS=str(threads))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        value = fn(*args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one (a pooled worker's task created them)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    for group in list(c10d._world.pg_map.keys()):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _pool_worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue,
                 threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads), MESHTRAIN_THREADS=str(threads))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, "ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - every failure must reach the test
            results.put((rank, "error", traceback.format_exc()))
        _destroy_subgroups()
        if not dist.is_initialized():
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _collect(procs, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    """Wait for one result per rank; raise on an error, a dead worker or the timeout."""
    import time

    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(collected) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTestError(
                f"timed out after {timeout:.0f}s; ranks done: {sorted(collected)}")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead and results.empty():
                time.sleep(0.5)
                if results.empty():
                    raise DistributedTestError(
                        "worker(s) died without reporting: exit codes "
                        f"{[p.exitcode for p in procs]}") from None
            continue
        if status != "ok":  # other ranks may now hang in a collective: fail fast
            raise DistributedTestError(f"a rank failed:\n--- rank {rank} ---\n{value}")
        collected[rank] = value
    return [collected[rank] for rank in range(world_size)]


class WorkerPool:
    """``world_size`` spawned workers joined once into a gloo group, reused for many tasks.

    Spawning a worker costs an interpreter start and a ``torch`` import (seconds each on a busy
    2-core machine), which dominated the multi-process tests. A pool runs task after task in the
    same processes, destroying the sub-groups each task created. Any failure or timeout kills the
    pool (a rank may be stuck in a collective); the next task gets a fresh one.
    """

    def __init__(self, world_size: int, threads: int):
        ctx = mp.get_context("spawn")
        self.world_size, self.threads = world_size, threads
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results,
                                        threads)) for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def alive(self) -> bool:
        """True while every worker is running."""
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        """Run ``fn(*args)`` on every rank; the pool is closed if anything goes wrong."""
        for task in self.tasks:
            task.put((fn, args))
        try:
            return _collect(self.procs, self.results, self.world_size, timeout)
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely, or at once with ``kill``)."""
        for proc, task in zip(self.procs, self.tasks, strict=True):
            if not kill and proc.is_alive():
                task.put(None)
        for proc in self.procs:
            proc.join(timeout=0.5 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()


class _PoolCache:
    """At most one live pool (bounded memory and sockets), replaced when the size changes."""

    def __init__(self):
        self.pool: WorkerPool | None = None

    def get(self, world_size: int, threads: int) -> WorkerPool:
        pool = self.pool
        if pool is None or not pool.alive() or (pool.world_size, pool.threads) != (
                world_size, threads):
            if pool is not None:
                pool.close(kill=not pool.alive())
            self.pool = WorkerPool(world_size, threads)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


_pools = _PoolCache()
atexit.register(_pools.close)


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0,
                    threads: int = 1) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) because workers are spawned. With
    ``MESHTRAIN_REUSE_WORKERS=1`` (the test suite sets it) the workers are pooled and reused.
    """
    if os.environ.get("MESHTRAIN_REUSE_WORKERS") == "1":
        return _pools.get(world_size, threads).run(fn, args, timeout)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results,
                                               threads), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    failed = False
    try:
        return _collect(procs, results, world_size, timeout)
    except BaseException:
        failed = True
        raise
    finally:
        for proc in procs:
            proc.join(timeout=0.5 if failed else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
