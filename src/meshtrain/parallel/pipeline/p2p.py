"""How the pipeline's point-to-point exchanges are posted, and NCCL's semantics on gloo.

The executor posts each exchange (consecutive send/recv actions of a schedule) through
:class:`Exchanger`. Three semantics, chosen by the environment variable
``MESHTRAIN_P2P_SEMANTICS`` (read when the executor is built, so spawned workers inherit it):

* ``tagged`` (default): every message carries a tag unique to (kind, micro-batch, stage); gloo
  matches by tag, NCCL ignores it.
* ``nccl``: no tags, so gloo matches messages per pair of ranks in the order they are issued,
  exactly as NCCL does. A schedule whose two sides disagree on the order swaps tensors here as it
  would on a GPU cluster.
* ``nccl-rendezvous``: as ``nccl``, and every send blocks until the peer has *posted* the
  matching receive, as NCCL's rendezvous protocol does for large messages (gloo buffers sends).
  Emulated through the job's key-value store: a rank marks each receive it posts, a sender waits
  for the mark. A schedule that needs buffered sends hangs here and fails with a message naming
  the send, instead of passing on CPU and hanging on a cluster.

The test suite runs in ``nccl-rendezvous`` (``tests/conftest.py``).
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.parallel.comm import CountedComm

P2P_SEMANTICS_ENV = "MESHTRAIN_P2P_SEMANTICS"
P2P_SEMANTICS = ("tagged", "nccl", "nccl-rendezvous")

# One op of an exchange: ("send" | "recv", tensor, peer's rank on the pp axis, tag).
P2POp = tuple[str, torch.Tensor, int, int]


def rendezvous_timeout_s() -> float:
    """How long an emulated rendezvous send waits for its receive
    (``MESHTRAIN_P2P_RENDEZVOUS_TIMEOUT_S``, default 300 s)."""
    return float(os.environ.get("MESHTRAIN_P2P_RENDEZVOUS_TIMEOUT_S", "300"))


def p2p_semantics() -> str:
    """The semantics named by ``MESHTRAIN_P2P_SEMANTICS`` (default ``tagged``)."""
    value = os.environ.get(P2P_SEMANTICS_ENV, "tagged") or "tagged"
    if value not in P2P_SEMANTICS:
        raise ValueError(f"{P2P_SEMANTICS_ENV}={value!r} is not a point-to-point semantics; "
                         f"valid: {', '.join(P2P_SEMANTICS)}")
    return value


class P2PRendezvousError(RuntimeError):
    """A send whose receive was never posted (the schedule needs buffered sends)."""


class Exchanger:
    """Posts the exchanges of one pipeline rank over the counted ``pp`` comm."""

    def __init__(self, comm: CountedComm, semantics: str | None = None):
        self.comm = comm
        self.semantics = semantics or p2p_semantics()
        self._sent: Counter = Counter()      # global peer -> sends issued to it
        self._received: Counter = Counter()  # global peer -> receives posted from it

    def post(self, ops: list[P2POp]) -> list:
        """Post ``ops`` as one batch; returns their work handles (wait on all of them).

        Under ``nccl-rendezvous`` this returns only once every send's receive is posted."""
        if self.semantics != "tagged":
            ops = [(op, tensor, peer, 0) for op, tensor, peer, _ in ops]
        works = self.comm.exchange(ops)
        if self.semantics == "nccl-rendezvous":
            self._rendezvous(ops)
        return works

    def _rendezvous(self, ops: list[P2POp]) -> None:
        store = dist.distributed_c10d._get_default_store()
        me, timeout = dist.get_rank(), rendezvous_timeout_s()
        peers = [(op, dist.get_global_rank(self.comm.group, peer)) for op, _, peer, _ in ops]
        for op, peer in peers:
            if op == "recv":
                store.set(f"meshtrain/p2p/{peer}->{me}/{self._received[peer]}", "posted")
                self._received[peer] += 1
        for op, peer in peers:
            if op != "send":
                continue
            key = f"meshtrain/p2p/{me}->{peer}/{self._sent[peer]}"
            try:
                store.wait([key], timedelta(seconds=timeout))
            except RuntimeError as err:  # the store's timeout
                raise P2PRendezvousError(
                    f"rank {me}: send #{self._sent[peer] + 1} to rank {peer} was not matched by "
                    f"a posted receive within {timeout:g} s: under NCCL's "
                    "rendezvous protocol the two ranks would wait for each other forever; "
                    "post both sides' sends and receives in one exchange") from err
            store.delete_key(key)
            self._sent[peer] += 1
