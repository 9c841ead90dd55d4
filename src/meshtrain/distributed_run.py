"""``run_distributed(world_size, fn, *args)``: run ``fn(*args)`` on N CPU processes over gloo.

Used by the test suite (every multi-process test), `meshtrain verify` and `meshtrain bench`.

Each worker is a fresh ``spawn``-ed interpreter with one intra-op thread (so 8 workers on 2 cores
do not thrash), joined into a gloo process group on a free loopback port. The function's return
values come back as a list indexed by rank. An exception on any rank is re-raised in the test
with that rank's traceback; a hang past ``timeout`` kills every worker and fails the test.
"""

from __future__ import annotations

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


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0,
                    threads: int = 1) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) because workers are spawned.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results,
                                               threads), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(collected) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"timed out after {timeout:.0f}s; ranks done: {sorted(collected)}")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise DistributedTestError(
                            "worker(s) died without reporting: exit codes "
                            f"{[p.exitcode for p in procs]}") from None
                continue
            if status == "ok":
                collected[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # other ranks may now hang in a collective; fail fast
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise DistributedTestError("a rank failed:\n" + "\n".join(errors))
    return [collected[rank] for rank in range(world_size)]
