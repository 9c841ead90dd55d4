"""Pipeline messages through shared memory (:mod:`meshtrain.parallel.pipeline.shared_memory_p2p`).

Messages are compared bit for bit with what was sent (a copy, so nothing less is right); training
through the transport is compared bit for bit with training through gloo, and with one process
within meshtrain.commands.verify's fp32 tolerances (as every pipeline layout is).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from meshtrain.parallel.comm import CommLog, CountedComm
from meshtrain.parallel.pipeline.shared_memory_p2p import (
    P2PTransferError,
    SharedMemoryP2P,
    transport_summary,
)
from tests.distributed import run_distributed
from tests.helpers import (
    assert_layouts_match_one_process,
    peer_memory_hidden_on_rank,
    tiny_config,
)

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _pp_comm(log: CommLog | None = None) -> CountedComm:
    n = dist.get_world_size()
    return CountedComm("pp", dist.new_group(list(range(n))), n, log or CommLog())


def _message(sender: int, index: int) -> torch.Tensor:
    """The ``index``-th message of ``sender``: its shape, dtype and values vary with both."""
    gen = torch.Generator().manual_seed(100 * sender + index)
    shape = (1 + index % 3, 5 + 7 * (index % 4))
    values = torch.randn(shape, generator=gen) * 100
    return values.to(DTYPES[index % len(DTYPES)])


def ring_messages(rounds: int, in_flight: int) -> dict:
    """Each rank sends ``in_flight`` messages to the next rank before waiting for the ones from
    the previous rank, ``rounds`` times; every message must arrive as sent."""
    log = CommLog()
    comm = _pp_comm(log)
    transport = SharedMemoryP2P.connect(comm, timeout_s=60)
    assert transport is not None and comm.shared_p2p is transport
    log.reset()  # the probe's own all-gathers
    n, rank = comm.size, dist.get_rank()
    after, before = (rank + 1) % n, (rank - 1) % n
    received, expected = [], []
    for r in range(rounds):
        indices = range(r * in_flight, (r + 1) * in_flight)
        ops = [("send", _message(rank, i), after, i) for i in indices]
        bufs = [torch.empty_like(_message(before, i)) for i in indices]
        ops += [("recv", buf, before, i) for buf, i in zip(bufs, indices, strict=True)]
        works = comm.exchange(ops)
        for work in reversed(works):
            work.wait()
        received += bufs
        expected += [_message(before, i) for i in indices]
    calls = log.calls["pp"]
    # Slot reuse: same-sized messages, each round's releases read before the next round's sends
    # (the barrier): the sender holds one slot per message in flight, not one per message sent.
    slots_before = len(transport._link.slots)
    for r in range(rounds):
        dist.barrier()
        bufs = [torch.empty(4096) for _ in range(in_flight)]
        works = comm.exchange([("send", torch.full((4096,), float(r)), after, 0)
                               for _ in range(in_flight)]
                              + [("recv", buf, before, 0) for buf in bufs])
        for work in works:
            work.wait()
        received.append(torch.stack(bufs))
        expected.append(torch.full((in_flight, 4096), float(r)))
    link = transport._link
    dist.barrier()  # every message read before any rank closes its transport
    return {"all equal": all(torch.equal(a, b) for a, b in zip(received, expected, strict=True)),
            "dtypes kept": [t.dtype for t in received] == [t.dtype for t in expected],
            "counted": calls == 2 * rounds * in_flight,
            "slots reused": len(link.slots) - slots_before <= in_flight,
            "inbox empty": not link.inbox}


@pytest.mark.parametrize("world", [2, 3])
def test_messages_arrive_as_sent_and_slots_are_reused(world):
    for checks in run_distributed(world, ring_messages, 6, 3):
        assert all(checks.values()), checks


def mismatched_message(what: str) -> str:
    comm = _pp_comm()
    SharedMemoryP2P.connect(comm, timeout_s=30)
    if dist.get_rank() == 0:
        comm.exchange([("send", torch.ones(4), 1, 7)])
        dist.barrier()
        return "sent"
    buf = torch.empty(5 if what == "size" else 4)
    (work,) = comm.exchange([("recv", buf, 0, 8 if what == "tag" else 7)])
    try:
        work.wait()
    except P2PTransferError as error:
        return str(error)
    finally:
        dist.barrier()
    return "no error"


def test_a_message_that_does_not_match_its_receive_names_both():
    tag = run_distributed(2, mismatched_message, "tag")[1]
    assert tag == ("pipeline message #1 from rank 0 has tag 7, but this rank's receive #1 from "
                   "it has tag 8: the two ranks post their messages in different orders")
    size = run_distributed(2, mismatched_message, "size")[1]
    assert size == "pipeline message #1 from rank 0 is 16 bytes; this rank's receive expects 20"


def silent_sender(how: str) -> str:
    comm = _pp_comm()
    transport = SharedMemoryP2P.connect(comm, timeout_s=2)
    if dist.get_rank() == 1:  # never sends, or sends and exits at once; rank 0 must not hang
        if how == "sent then exited":
            comm.exchange([("send", torch.ones(3), 0, 0)])
        if how != "silent":
            transport.close()  # what the kernel does to the pipes and memory of an exited process
        time.sleep(3 if how == "silent" else 0.5)
        return "done"
    if how == "sent then exited":
        time.sleep(0.3)
    (work,) = comm.exchange([("recv", torch.empty(3), 1, 0)])
    start = time.monotonic()
    try:
        work.wait()
    except P2PTransferError as error:
        return f"{time.monotonic() - start:.1f} s: {error}"
    return "no error"


@pytest.mark.parametrize("how", ["silent", "exited", "sent then exited"])
def test_a_receive_from_a_silent_or_dead_rank_fails_naming_it(how):
    outcome = run_distributed(2, silent_sender, how)[0]
    seconds, message = outcome.split(" s: ", 1)
    if how == "exited":  # noticed at once, without waiting for the timeout
        assert message == ("pipeline message #1 from rank 1: connection closed (the process "
                           "exited)") and float(seconds) < 1.5, outcome
    elif how == "sent then exited":
        assert message.startswith("pipeline message #1 from rank 1: the sender's buffer is gone "
                                  "(the process exited)"), outcome
        assert float(seconds) < 1.5, outcome
    else:
        assert message == ("pipeline message #1 from rank 1 did not arrive within 2 s "
                           "(train.collective_timeout_s)")
        assert 1.5 < float(seconds) < 8


def probe_fails_on_one_rank() -> tuple[bool, bool, str | None]:
    with peer_memory_hidden_on_rank(1):
        comm = _pp_comm()
        transport = SharedMemoryP2P.connect(comm, timeout_s=30)
    return (transport is None, comm.shared_p2p is None,
            transport_summary(comm, True, torch.device("cpu")))


def test_group_keeps_gloo_when_any_rank_cannot_share():
    why = ("pipeline messages go through gloo (the ranks cannot map each other's memory: "
           "several hosts, or no /proc access)")
    assert run_distributed(2, probe_fails_on_one_rank) == [(True, True, why), (True, True, why)]


SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]


def train_with_and_without_shared_memory(schedule: str, virtual: int) -> tuple[list, list, list]:
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    runs, attached = [], []
    for shared in (True, False):
        config = tiny_config("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4",
                             f"parallel.pp_schedule={schedule}",
                             f"parallel.virtual_stages={virtual}",
                             f"parallel.pp_shared_memory={str(shared).lower()}", nproc=2)
        trainer = Trainer(config, build_mesh(config))
        runs.append([(r["loss"], r["grad_norm"]) for r in
                     (trainer.train_step() for _ in range(3))])
        attached.append(transport_summary(trainer.mesh.comm("pp"), shared, trainer.device))
    return runs[0], runs[1], attached


@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
def test_training_through_shared_memory_is_bitwise_gloo(schedule, virtual):
    for with_shm, without, attached in run_distributed(2, train_with_and_without_shared_memory,
                                                       schedule, virtual):
        assert attached == ["pipeline messages go through shared memory (2 ranks on one host)",
                            "pipeline messages go through gloo (parallel.pp_shared_memory = false)"]
        assert with_shm == without  # bit for bit: same losses and gradient norms


def test_pipeline_with_data_parallel_through_shared_memory_matches_one_process():
    # two pipeline groups of two, each moving its messages through its own transport
    cases = [tiny_config("parallel.pp=2", "parallel.microbatches=2", "model.n_layers=4",
                         "train.global_batch=8", "parallel.pp_schedule=1f1b", nproc=4)]
    assert_layouts_match_one_process(4, cases, 3)
