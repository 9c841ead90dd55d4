"""The multi-process test harness: ``run_distributed(world_size, fn, *args)`` on gloo ranks.

Every multi-process test runs its ranks through :func:`run_distributed` here. It runs them as
:func:`meshtrain.host.local_processes.run_distributed` does (spawned workers, gloo on a free
loopback port, one intra-op thread each, a timeout), but with ``MESHTRAIN_REUSE_WORKERS=1`` (which
``tests/conftest.py`` sets) it reuses a :class:`WorkerPool` across tests: spawning a worker costs
an interpreter start and a ``torch`` import, seconds each on a busy 2-core machine, and that
dominated the multi-process tests. One pool per world size stays up (:class:`PoolCache`), as the
suite switches between 2, 4 and 8 ranks many times. Any rank's failure is raised in the test as a
:class:`DistributedTestError` carrying that rank's traceback.

:func:`use_pool_for_meshtrain_commands` makes meshtrain's own commands, called in the test
process (``meshtrain bench``, ``verify``, ``calibrate`` through ``meshtrain.cli.main``), take
their workers from the same pool.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import meshtrain.host.local_processes as meshtrain_workers
from meshtrain.host.local_processes import WorkerError, collect_results, free_port, join_local_group
from meshtrain.host.peak_watch import read_vm_hwm

REUSE_ENV = "MESHTRAIN_REUSE_WORKERS"
"""``1``: pool the workers (the suite's default, set in ``tests/conftest.py``)."""


class DistributedTestError(WorkerError, AssertionError):
    """A rank raised, crashed or timed out (a test failure; the CLI treats it as a worker's
    failure, exit status 1)."""


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one (a pooled worker's task created them)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    for group in list(c10d._world.pg_map.keys()):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


RETIRE_AT_FDS = 512
"""A pool whose workers hold more open descriptors than this after a task is closed (and
replaced by the next task): each task's destroyed gloo sub-groups leave a few sockets and pipes
open, and a worker kept for the whole suite would otherwise collect hundreds."""


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # no /proc, or the process is gone: nothing to count
        return 0


def _pool_worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue,
                 threads: int) -> None:
    import torch.distributed as dist

    join_local_group(rank, world_size, port, threads)
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


class WorkerPool:
    """``world_size`` spawned workers joined once into a gloo group, reused for many tasks.

    A pool runs task after task in the same processes, destroying the sub-groups each task
    created. Any failure or timeout kills the pool (a rank may be stuck in a collective); the
    next task gets a fresh one.
    """

    def __init__(self, world_size: int, threads: int):
        ctx = mp.get_context("spawn")
        self.world_size, self.threads = world_size, threads
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
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
            results = collect_results(self.procs, self.results, self.world_size, timeout)
        except BaseException:
            self.close(kill=True)
            raise
        if max(_open_fds(p.pid) for p in self.procs) > RETIRE_AT_FDS:
            self.close()
        return results

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


MAX_POOLED_WORKERS = 16
"""Live pooled workers at most, over every pool (about 0.3 GB of memory each, idle)."""


class PoolCache:
    """One live pool per ``(world_size, threads)``, so that tests alternating between world
    sizes (2, 4, 8 ranks) do not respawn workers at each switch; at most ``max_workers``
    workers in all, the least recently used pool stopped first to make room."""

    def __init__(self, max_workers: int = MAX_POOLED_WORKERS):
        self.max_workers = max_workers
        self.pools: dict[tuple[int, int], WorkerPool] = {}  # least recently used first

    def get(self, world_size: int, threads: int) -> WorkerPool:
        """A live pool of ``world_size`` workers with ``threads`` threads each."""
        key = (world_size, threads)
        pool = self.pools.pop(key, None)
        if pool is not None and not pool.alive():
            pool.close(kill=True)
            pool = None
        if pool is None:
            self._make_room(world_size)
            pool = WorkerPool(world_size, threads)
        self.pools[key] = pool
        return pool

    def _make_room(self, workers: int) -> None:
        """Stop the least recently used pools until ``workers`` more fit."""
        while self.pools and sum(p.world_size for p in self.pools.values()) + workers > \
                self.max_workers:
            oldest = self.pools.pop(next(iter(self.pools)))
            oldest.close(kill=not oldest.alive())

    def close(self) -> None:
        """Stop every pool."""
        while self.pools:
            pool = self.pools.pop(next(iter(self.pools)))
            pool.close(kill=not pool.alive())


_pools = PoolCache()
atexit.register(_pools.close)
_fresh_workers = meshtrain_workers.run_distributed


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0,
                    threads: int = 1, peaks: list[int] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) because workers are spawned. Pooled
    workers with ``MESHTRAIN_REUSE_WORKERS=1``, fresh ones otherwise; a failing rank raises
    :class:`DistributedTestError`. ``peaks`` (as the package's): each worker's ``VmHWM`` read
    from this process afterwards (a pooled worker's is its peak over every task it ran).
    """
    try:
        if os.environ.get(REUSE_ENV) == "1":
            pool = _pools.get(world_size, threads)
            results = pool.run(fn, args, timeout)
            if peaks is not None:
                peaks[:] = [read_vm_hwm(p.pid) or 0 for p in pool.procs]
            return results
        return _fresh_workers(world_size, fn, *args, timeout=timeout, threads=threads,
                              peaks=peaks)
    except DistributedTestError:
        raise
    except WorkerError as error:
        raise DistributedTestError(str(error)) from None


def use_pool_for_meshtrain_commands() -> None:
    """Make :func:`meshtrain.host.local_processes.run_distributed` this module's
    :func:`run_distributed`, so commands run in the test process reuse the pool too (the
    package's callers import it when they run, so they all see the replacement)."""
    meshtrain_workers.run_distributed = run_distributed
