"""Shared-memory gradient reduction (:mod:`meshtrain.parallel.shared_memory`) on CPU processes.

The reducer's results are compared bit for bit: with gloo for two ranks (a two-operand sum does
not depend on the order), and with the rank-order sum the module promises for three and four.
Training through it is compared bit for bit with training through gloo (two ranks), and with one
process within meshtrain.commands.verify's fp32 tolerances (as every data-parallel layout is).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from meshtrain.parallel.comm import CommLog, CountedComm
from meshtrain.parallel.data.checks import reduces_in_shared_memory, reduction_summary
from meshtrain.parallel.shared_memory import PipeBarrier, SharedMemoryReducer
from tests.distributed import run_distributed
from tests.helpers import (
    assert_layouts_match_one_process,
    peer_memory_hidden_on_rank,
    tiny_config,
)


def _world_comm(log: CommLog | None = None) -> CountedComm:
    n = dist.get_world_size()
    return CountedComm("dp", dist.new_group(list(range(n))), n, log or CommLog())


def _local_values(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return torch.randn(numel, generator=gen) * (1 + dist.get_rank())


def _rank_order_sum(values: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    total = gathered[0] + gathered[1]
    for part in gathered[2:]:
        total += part
    return total


def reduce_buffers_like_gloo() -> dict:
    log = CommLog()
    comm = _world_comm(log)
    reducer = SharedMemoryReducer.connect(comm)
    assert reducer is not None and comm.shared_memory is reducer
    n, rank = comm.size, dist.get_rank()
    checks = {}
    # Odd lengths (uneven segments, one shorter than n) and several reductions in flight at once.
    sizes = [1, n - 1 or 1, 1001, 65_537]
    buffers = [reducer.new_buffer(comm, s, torch.float32) for s in sizes]
    assert all(comm.shares(b) for b in buffers) and not comm.shares(torch.zeros(3))
    assert all(b.abs().sum() == 0 for b in buffers)  # a new buffer is zeroed
    values = [_local_values(s, i) for i, s in enumerate(sizes)]
    for b, v in zip(buffers, values, strict=True):
        b.copy_(v)
    works = [comm.all_reduce(b, async_op=True) for b in buffers]
    for work in reversed(works):
        work.wait()
    for size, b, v in zip(sizes, buffers, values, strict=True):
        expected = _rank_order_sum(v)
        checks[f"all_reduce {size}"] = torch.equal(b, expected)
        if n == 2:
            via_gloo = v.clone()
            dist.all_reduce(via_gloo)
            checks[f"same bits as gloo {size}"] = torch.equal(b, via_gloo)
    # Reduce-scatter, in place and into a separate tensor; the counters see it as gloo's would.
    full = reducer.new_buffer(comm, 4 * n, torch.float32)
    v = _local_values(4 * n, 9)
    full.copy_(v)
    out = torch.empty(4)
    log.reset()
    comm.reduce_scatter_into(out, full)
    expected = _rank_order_sum(v)[4 * rank:4 * rank + 4]
    checks["reduce_scatter"] = torch.equal(out, expected) and torch.equal(
        full[4 * rank:4 * rank + 4], expected)
    checks["others keep local values"] = torch.equal(full[:4 * rank], v[:4 * rank])
    checks["counted"] = log.calls["dp"] == 1 and log.bytes["dp"] == (n - 1) * 16 * n // n
    full.copy_(v)
    comm.reduce_scatter_into(full[4 * rank:4 * rank + 4], full)
    checks["reduce_scatter in place"] = torch.equal(full[4 * rank:4 * rank + 4], expected)
    # A plain collective on the same comm after a pending reduction keeps the issue order.
    buffers[3].copy_(values[3])
    comm.all_reduce(buffers[3], async_op=True)
    other = torch.ones(2)
    comm.all_reduce(other)
    checks["order kept"] = torch.equal(buffers[3], _rank_order_sum(values[3])) and torch.equal(
        other, torch.full((2,), float(n)))
    return checks


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reducer_matches_gloo_and_rank_order_sum(world):
    for checks in run_distributed(world, reduce_buffers_like_gloo):
        assert checks and all(checks.values()), checks


def probe_fails_on_one_rank() -> tuple[bool, bool]:
    with peer_memory_hidden_on_rank(1):
        comm = _world_comm()
        reducer = SharedMemoryReducer.connect(comm)
    return reducer is None, comm.shared_memory is None


def test_group_falls_back_to_gloo_when_any_rank_cannot_share():
    assert run_distributed(2, probe_fails_on_one_rank) == [(True, True), (True, True)]


def absent_rank_fails_the_wait(exits: bool) -> str:
    comm = _world_comm()
    reducer = SharedMemoryReducer.connect(comm, timeout_s=3)
    buffer = reducer.new_buffer(comm, 8, torch.float32)
    if dist.get_rank() == 1:  # never joins the reduction; rank 0 must not hang
        if exits:
            reducer.barrier.close()  # what the kernel does to the pipes of a process that exits
        time.sleep(1 if exits else 5)
        return "absent"
    start = time.monotonic()
    work = comm.all_reduce(buffer, async_op=True)
    try:
        work.wait()
    except RuntimeError as error:
        return f"{time.monotonic() - start:.1f} s: {error}"
    return "no error"


@pytest.mark.parametrize("exits", [False, True])
def test_absent_rank_fails_the_wait_naming_it(exits):
    outcome = run_distributed(2, absent_rank_fails_the_wait, exits)[0]
    seconds, message = outcome.split(" s: ", 1)
    if exits:  # noticed at once, without waiting for the timeout
        assert "connection closed by rank(s) 1" in message and float(seconds) < 2, outcome
    else:
        assert message == ("shared-memory reduction on the dp group timed out after 3 s: "
                           "rank(s) 1 did not arrive (train.collective_timeout_s)")
        assert 2.5 < float(seconds) < 10


def train_with_and_without_shared_memory(zero: int) -> tuple[list, list, bool, bool]:
    from meshtrain.parallel import data_parallel_engine
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    runs = []
    for shared in (True, False):
        config = tiny_config(f"parallel.zero={zero}", "parallel.dp_bucket_mb=0.01",
                             f"parallel.dp_shared_memory={str(shared).lower()}", nproc=2)
        trainer = Trainer(config, build_mesh(config))
        records = [trainer.train_step() for _ in range(4)]
        engine = data_parallel_engine(trainer.model)
        runs.append(([(r["loss"], r["grad_norm"]) for r in records],
                     reduces_in_shared_memory(engine), reduction_summary(engine)))
    (with_shm, used, said), (without, unused, said_not) = runs
    what = ("ZeRO-3 gathers and gradients go" if zero == 3
            else "data-parallel gradients reduce")
    assert said == f"{what} through shared memory (2 ranks on one host)"
    assert said_not == ("data-parallel gradients reduce through gloo "
                        "(parallel.dp_shared_memory = false)")
    return with_shm, without, used, unused


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_training_through_shared_memory_is_bitwise_gloo(zero):
    with_shm, without, used, unused = run_distributed(2, train_with_and_without_shared_memory,
                                                      zero)[0]
    assert used and not unused
    assert with_shm == without  # bit for bit: same losses and gradient norms


def test_three_ranks_and_microbatches_match_one_process():
    cases = [tiny_config("parallel.zero=0", "parallel.dp_bucket_mb=0.01", "train.global_batch=6",
                         "parallel.microbatches=2", nproc=3),
             tiny_config("parallel.zero=1", "train.global_batch=6", nproc=3),
             # ZeRO-3: shards gathered from shared memory, gradients reduced through it
             tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.01", "train.global_batch=6",
                         "parallel.microbatches=2", nproc=3)]
    assert_layouts_match_one_process(3, cases, 4)


def test_barrier_waits_on_a_descriptor_numbered_above_1024():
    """A process with many open descriptors (gloo's sockets in a large job) gets pipe ends
    numbered past ``select``'s limit of 1024; the barrier must still wait on them."""
    read_fd, write_fd = os.pipe()
    high = os.dup2(read_fd, 1500)
    sink_read, sink_write = os.pipe()
    try:
        os.write(write_fd, (1).to_bytes(4, "little"))  # rank 1 has arrived
        barrier = PipeBarrier(high, {1: sink_write}, 0, [0, 1], "dp", timeout_s=5)
        barrier.wait()
        assert os.read(sink_read, 4) == (0).to_bytes(4, "little")  # told rank 1 it arrived
        barrier.close()
    finally:
        for fd in (read_fd, write_fd, sink_read):
            os.close(fd)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_dropping_a_read_peer_buffer_keeps_its_values_and_leaves_the_resident_set():
    """A ZeRO-3 gather reads the other ranks' shards; afterwards their pages leave the reader's
    resident set (and so its VmHWM stops growing with the whole model) but not the owner's."""
    from meshtrain.parallel.shared_memory import drop_resident_pages

    numel = 16 * 2**20 // 4  # 16 MiB
    fd = os.memfd_create("meshtrain-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, numel * 4)
        path = f"/proc/self/fd/{fd}"
        owner = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
        owner.copy_(torch.arange(numel, dtype=torch.float32))
        reader = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
        before = _rss_bytes()
        total = float(reader.sum(dtype=torch.float64))  # faults every page in: +16 MiB
        read = _rss_bytes()
        drop_resident_pages(reader)
        dropped = _rss_bytes()
        assert read - before > 15 * 2**20
        assert read - dropped > 15 * 2**20
        assert float(reader.sum(dtype=torch.float64)) == total  # the values are still there
        assert torch.equal(owner[:5], torch.arange(5, dtype=torch.float32))
    finally:
        os.close(fd)
