"""``run_distributed(world_size, fn, *args)``: run ``fn(*args)`` on N local CPU processes over gloo.

What ``meshtrain verify``, ``meshtrain bench`` and ``meshtrain calibrate`` start their workers
with. Each worker is a fresh ``spawn``-ed interpreter with ``threads`` intra-op threads, joined
into a gloo process group on a free loopback port. The function's return values come back as a
list indexed by rank. An exception on any rank, a worker that dies without reporting or a hang
past ``timeout`` raises :class:`WorkerError` (the CLI prints it and exits with status 1) after
every worker is stopped.

The pieces a caller needs to run workers of its own on the same terms (the test suite's worker
pool, ``tests/distributed.py``) are public: :func:`free_port`, :func:`join_local_group` and
:func:`collect_results`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from meshtrain.errors import RunFailure
from meshtrain.host.loopback import LOOPBACK, keep_collectives_on_loopback, loopback_store
from meshtrain.host.peak_watch import PeakWatcher

GROUP_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a worker's collectives wait for the other ranks before failing."""


class WorkerError(RunFailure):
    """A worker raised, died without reporting, or did not finish in time; the message says
    which rank and shows its traceback."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_local_group(rank: int, world_size: int, port: int, threads: int) -> None:
    """In a spawned worker: set the rank's environment and thread count, and join the gloo group
    of ``world_size`` ranks whose rendezvous is ``127.0.0.1:port``. Nothing listens beyond
    loopback: rank 0's store listens on ``127.0.0.1`` only and gloo uses the loopback interface
    (unless ``GLOO_SOCKET_IFNAME`` is set)."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads), MESHTRAIN_THREADS=str(threads))
    keep_collectives_on_loopback()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = (loopback_store(port, world_size, GROUP_TIMEOUT) if rank == 0
             else dist.TCPStore(LOOPBACK, port, world_size, False, GROUP_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=GROUP_TIMEOUT)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
            results: mp.Queue, threads: int) -> None:
    import torch.distributed as dist

    try:
        join_local_group(rank, world_size, port, threads)
        results.put((rank, "ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def collect_results(procs: list, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    """Wait for one ``(rank, "ok" | "error", value)`` per rank on ``results``; return the values
    by rank. Raises :class:`WorkerError` on a rank's error, a dead worker or the timeout."""
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(collected) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerError(f"timed out after {timeout:.0f}s; ranks done: {sorted(collected)}")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead and results.empty():
                time.sleep(0.5)
                if results.empty():
                    raise WorkerError("worker(s) died without reporting: exit codes "
                                      f"{[p.exitcode for p in procs]}") from None
            continue
        if status != "ok":  # other ranks may now hang in a collective: fail fast
            raise WorkerError(f"a rank failed:\n--- rank {rank} ---\n{value}")
        collected[rank] = value
    return [collected[rank] for rank in range(world_size)]


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0,
                    threads: int = 1, peaks: list[int] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh gloo ranks; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) because workers are spawned; so must its
    arguments and results be picklable. Raises :class:`WorkerError` if a rank fails.
    ``peaks``: a list this fills with each rank's peak resident memory in bytes, read from this
    process (:class:`~meshtrain.host.peak_watch.PeakWatcher`), not reported by the worker.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results,
                                               threads), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    watcher = PeakWatcher([p.pid for p in procs]) if peaks is not None else None
    failed = False
    try:
        values = collect_results(procs, results, world_size, timeout)
        if watcher is not None:  # the workers are done: their high-water marks are final
            peaks[:] = watcher.stop()
        return values
    except BaseException:
        failed = True
        raise
    finally:
        if watcher is not None:
            watcher.stop()
        for proc in procs:
            proc.join(timeout=0.5 if failed else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
