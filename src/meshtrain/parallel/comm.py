"""Counted collectives: the one door every collective of every axis goes through.

Each call records, for its axis, the **bus bytes per rank** it moved (the nccl-tests convention, so
numbers compare across world sizes and with the cost model):

=================  ==========================
all-reduce          2 (n - 1) / n · S
all-gather          (n - 1) / n · S   (S = the gathered, full size)
reduce-scatter      (n - 1) / n · S   (S = the full input size)
all-to-all          (n - 1) / n · S
broadcast           S  (ring/tree lower bound per rank)
send / recv         S
=================  ==========================

and the number of calls. :class:`CommLog` also keeps each rank's last few collectives (axis, op,
shape, dtype, call site, training step, and a per-axis **sequence number**) so that a hang can be
explained by what each rank was last doing: every rank of a group issues the group's collectives
in the same order, so in a hang the ranks whose sequence number on an axis is behind the others'
are the ones that did not arrive (:mod:`meshtrain.run.diagnostics`). Point-to-point sends and
receives are numbered separately (the two ends of a pipeline issue different counts).

With ``CommLog.debug`` on (``train.debug_collectives``), every collective is preceded by a small
all-gather of (sequence number, op, shape, dtype, call site) over its group, and the first
difference between ranks raises :class:`~meshtrain.errors.CollectiveMismatchError` naming each
rank's call instead of hanging or silently mixing tensors. Groups of size one are no-ops and
record nothing.

A data-parallel group whose ranks share one host may carry a
:class:`~meshtrain.parallel.shared_memory.SharedMemoryReducer` (``shared_memory``): all-reduces
and reduce-scatters of the buffers it allocated then run through shared memory instead of gloo,
counted and logged the same way. Any other collective on that comm first waits for the
shared-memory reductions in flight, so every rank still issues the group's operations in one order.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshtrain import faults
from meshtrain.config.runtime_facts import bus_bytes
from meshtrain.errors import CollectiveMismatchError

# torch >= 2.10 renamed the flat-tensor collectives; use whichever this torch has.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _object_device(group) -> torch.device:
    """Where the byte tensors of an object collective over ``group`` live (the GPU under NCCL)."""
    from torch.distributed import distributed_c10d

    pick = getattr(distributed_c10d, "_get_object_coll_device", None)  # private, torch >= 2.2
    kind = pick(group) if pick is not None else (
        "cuda" if dist.get_backend(group) == "nccl" else "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def gather_json(value, group: dist.ProcessGroup | None, size: int) -> list:
    """Every rank's ``value`` over ``group`` (``size`` ranks; None = the default group), in
    group rank order, sent as UTF-8 JSON: never pickled, so a peer's bytes can only ever decode
    to data. ``value`` must be JSON-able: tuples come back as lists and dict keys as strings;
    anything else (bytes, sets, tensors, dataclasses) raises ``TypeError`` before sending.

    Two all-gathers of byte tensors: the lengths, then each rank's bytes padded to the
    longest. Not counted in a :class:`CommLog` (see :meth:`CountedComm.all_gather_json`)."""
    return _gather_payload(_encode(value), group, size)


def _encode(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _gather_payload(payload: bytes, group: dist.ProcessGroup | None, size: int) -> list:
    """Every rank's JSON ``payload``, decoded (see :func:`gather_json`)."""
    device = _object_device(group)
    lengths = torch.zeros(size, dtype=torch.int64, device=device)
    _all_gather_flat(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=device),
                     group=group)
    sizes = lengths.tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = torch.empty(size * longest, dtype=torch.uint8, device=device)
    _all_gather_flat(gathered, mine.to(device), group=group)
    data = gathered.cpu().numpy().tobytes()
    return [json.loads(data[k * longest:k * longest + n].decode()) for k, n in enumerate(sizes)]


@dataclasses.dataclass
class CollectiveRecord:
    """One collective as it was issued on this rank."""

    axis: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bus_bytes: int
    site: str
    time_s: float
    seq: int = 0
    """1-based number of this collective on its axis on this rank (p2p ops count separately)."""
    step: int = 0
    """Training step (1-based) during which it was issued; 0 outside the training loop."""
    done: bool | None = False
    """True once a blocking call returned; None for an async call (completion not tracked)."""
    peer: int | None = None
    """Global rank at the other end of a send/recv; None for collectives."""

    def describe(self) -> str:
        """One line: ``dp #12 all_reduce (1,) float32 at trainer.py:97 (step 2)``."""
        where = f" {'to' if self.op == 'send' else 'from'} rank {self.peer}" \
            if self.peer is not None else ""
        return (f"{self.axis} #{self.seq} {self.op}{where} {self.shape} {self.dtype} at "
                f"{self.site} (step {self.step})")


def _call_site() -> str:
    """``file:line`` of the first caller outside this module (cheap: no traceback objects)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


class CommLog:
    """Per-axis byte and call counters, plus a short ring of this rank's recent collectives."""

    def __init__(self, history: int = 32):
        self.bytes: dict[str, int] = collections.defaultdict(int)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.recent: collections.deque[CollectiveRecord] = collections.deque(maxlen=history)
        self.seq: dict[str, int] = collections.defaultdict(int)
        """Collectives issued per axis since the process started (never reset)."""
        self.p2p_seq: dict[str, int] = collections.defaultdict(int)
        """Sends and receives issued per axis since the process started."""
        self.step = 0
        self.debug = False
        self.wait_s = 0.0
        """Seconds this rank spent inside blocking collectives and waiting on async ones since
        the last reset (host clock): its time waiting for the others, plus the transfers."""
        self.wait_by_axis: dict[str, float] = collections.defaultdict(float)
        """:attr:`wait_s` split by the axis whose collective it was spent in."""

    def record(self, axis: str, op: str, tensor_shape: Sequence[int], dtype: torch.dtype,
               full_bytes: int, group_size: int, peer: int | None = None) -> CollectiveRecord:
        """Count one collective (or, with ``peer``, one send/recv) and return its record."""
        moved = bus_bytes(op, full_bytes, group_size)
        self.bytes[axis] += moved
        self.calls[axis] += 1
        counter = self.seq if peer is None else self.p2p_seq
        counter[axis] += 1
        entry = CollectiveRecord(axis, op, tuple(tensor_shape), str(dtype), moved, _call_site(),
                                 time.time(), counter[axis], self.step, False, peer)
        self.recent.append(entry)
        return entry

    def begin_step(self, step: int) -> None:
        """Start counting step ``step`` (1-based): reset the byte counters, tag new records."""
        self.reset()
        self.step = step

    def reset(self) -> None:
        """Start a new counting window (the trainer calls this at the start of each step)."""
        self.bytes.clear()
        self.calls.clear()
        self.wait_s = 0.0
        self.wait_by_axis.clear()

    def add_wait(self, axis: str, seconds: float) -> None:
        """Count ``seconds`` spent in a collective of ``axis`` (blocking, or waiting on one)."""
        self.wait_s += seconds
        self.wait_by_axis[axis] += seconds

    def snapshot(self) -> dict[str, int]:
        """Bytes per axis since the last reset, as a plain dict (for metrics)."""
        return dict(self.bytes)

    def describe_recent(self) -> str:
        """Human-readable list of the last collectives, newest last."""
        return "\n".join(f"  {r.describe()}" for r in self.recent) or "  (none)"


class _Works:
    """One handle over several async works: ``wait()`` waits for each, in order."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        """Wait for every work."""
        for work in self.works:
            work.wait()
        return True


class _TimedWork:
    """An async work handle whose ``wait()`` adds its time to the log's ``wait_s`` (and to its
    axis's share)."""

    __slots__ = ("work", "log", "axis")

    def __init__(self, work, log: CommLog, axis: str):
        self.work, self.log, self.axis = work, log, axis

    def wait(self, *args, **kwargs):
        """Wait for the work, timed."""
        start = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.log.add_wait(self.axis, time.perf_counter() - start)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class CountedComm:
    """Collectives over one axis's process group, counted into a :class:`CommLog`.

    ``group`` is ``None`` when the axis has a single rank: every method then returns at once.
    """

    def __init__(self, axis: str, group: dist.ProcessGroup | None, size: int, log: CommLog):
        self.axis = axis
        self.group = group
        self.size = size
        self.log = log
        self._started = 0.0
        self._delayed = 0.0
        self.shared_memory = None
        """A :class:`~meshtrain.parallel.shared_memory.SharedMemoryReducer` attached by
        :meth:`~meshtrain.parallel.shared_memory.SharedMemoryReducer.connect`, or None."""
        self.shared_p2p = None
        """A :class:`~meshtrain.parallel.pipeline.shared_memory_p2p.SharedMemoryP2P` attached by
        its ``connect``, or None: :meth:`exchange` then moves CPU tensors through it."""

    @property
    def active(self) -> bool:
        """True when the axis has more than one rank."""
        return self.size > 1

    def _nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def _enter(self, op: str, shape: Sequence[int], dtype: torch.dtype,
               full_bytes: int, shared: bool = False) -> CollectiveRecord | None:
        """Record a collective about to be issued (after the debug check, if on); None when a
        test-only injected fault says to skip it (:mod:`meshtrain.faults`). Unless it is itself
        a shared-memory reduction (``shared``), shared-memory reductions in flight finish first.
        A blocking call's time from here until :meth:`_issued` counts as waiting (``wait_s``)."""
        self._started = time.perf_counter()
        self._delayed = 0.0
        if self.shared_memory is not None and (not shared or self.log.debug):
            self.shared_memory.wait_all()
        if faults.active():
            if faults.skip_collective(self.log.step, self.axis):
                return None
            self._delayed = faults.delay_collective(self.log.step, self.axis)
        if self.log.debug:
            self._check_same_call(op, tuple(shape), str(dtype))
        return self.log.record(self.axis, op, shape, dtype, full_bytes, self.size)

    def _issued(self, entry: CollectiveRecord, work, async_op: bool):
        """Mark a blocking call done and count its time as waiting; an async call's ``work``
        comes back wrapped so that its ``wait()`` is counted (its completion is not tracked)."""
        if async_op:
            entry.done = None
            if self._delayed:  # an injected slow link held this rank before it issued the call
                self.log.add_wait(self.axis, self._delayed)
            return None if work is None else _TimedWork(work, self.log, self.axis)
        entry.done = True
        self.log.add_wait(self.axis, time.perf_counter() - self._started)
        return work

    def shares(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a shared-memory buffer of this group (reduced without gloo)."""
        return self.shared_memory is not None and self.shared_memory.owns(tensor)

    def _issued_shared(self, entry: CollectiveRecord, work, async_op: bool):
        """Like :meth:`_issued` for a shared-memory reduction: a blocking call waits here."""
        if async_op:
            return self._issued(entry, work, True)
        work.wait()
        return self._issued(entry, None, False)

    def _check_same_call(self, op: str, shape: tuple, dtype: str) -> None:
        """Debug mode: all-gather what each rank is about to call; raise on the first mismatch.

        An all-to-all's first dimension may differ between ranks (variable splits): only the
        other dimensions must agree there."""
        mine = (self.log.seq[self.axis] + 1, op, shape, dtype.removeprefix("torch."), _call_site(),
                dist.get_rank())
        calls = [(seq, name, tuple(dims), *rest)  # JSON gave the shape back as a list
                 for seq, name, dims, *rest in gather_json(mine, self.group, self.size)]

        def key(call):
            return call[:2] + (call[2][1:] if call[1] == "all_to_all" else call[2], call[3])

        if all(key(call) == key(calls[0]) for call in calls):
            return
        lines = "; ".join(f"rank {c[5]} calls #{c[0]} {c[1]} {c[2]} {c[3]} at {c[4]}"
                          for c in calls)
        raise CollectiveMismatchError(
            f"collective mismatch on the {self.axis} group (ranks "
            f"{', '.join(str(c[5]) for c in calls)}), found by train.debug_collectives: {lines}.")

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   async_op: bool = False):
        """In-place all-reduce over the axis."""
        if not self.active:
            return None
        if self.shares(tensor) and op == dist.ReduceOp.SUM:
            entry = self._enter("all_reduce", tensor.shape, tensor.dtype, self._nbytes(tensor),
                                shared=True)
            if entry is None:
                return None
            return self._issued_shared(entry, self.shared_memory.all_reduce(tensor), async_op)
        entry = self._enter("all_reduce", tensor.shape, tensor.dtype, self._nbytes(tensor))
        if entry is None:
            return None
        return self._issued(entry, dist.all_reduce(tensor, op=op, group=self.group,
                                                   async_op=async_op), async_op)

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Gather equal shards into ``output`` (concatenated along dim 0)."""
        if not self.active:
            output.copy_(shard.reshape(output.shape))
            return None
        entry = self._enter("all_gather", output.shape, output.dtype, self._nbytes(output))
        if entry is None:
            return None
        return self._issued(entry, _all_gather_flat(output, shard, group=self.group,
                                                    async_op=async_op), async_op)

    def reduce_scatter_into(self, shard: torch.Tensor, full: torch.Tensor,
                            op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
                            drop_read_pages: bool = False):
        """Reduce ``full`` over the axis and keep this rank's equal dim-0 shard in ``shard``
        (``drop_read_pages``: see :meth:`SharedMemoryReducer.reduce_scatter`)."""
        if not self.active:
            shard.copy_(full.reshape(shard.shape))
            return None
        if self.shares(full) and op == dist.ReduceOp.SUM and full.numel() % self.size == 0:
            entry = self._enter("reduce_scatter", full.shape, full.dtype, self._nbytes(full),
                                shared=True)
            if entry is None:
                return None
            work = self.shared_memory.reduce_scatter(shard, full, drop_read_pages)
            return self._issued_shared(entry, work, async_op)
        entry = self._enter("reduce_scatter", full.shape, full.dtype, self._nbytes(full))
        if entry is None:
            return None
        return self._issued(entry, _reduce_scatter_flat(shard, full, op=op, group=self.group,
                                                        async_op=async_op), async_op)

    def all_gather_in_place(self, full: torch.Tensor, async_op: bool = False):
        """All-gather with no temporary buffer: ``full`` is ``size`` equal dim-0 slices, this
        rank's already holding its shard; one broadcast per rank fills the others from their
        owners. Counted as one all-gather. gloo's ``all_gather_into_tensor`` passes the whole
        output through a scratch copy of its own, so on the CPU this form keeps a bucket-sized
        allocation off the heap (docs/parallelism.md, "Peak memory measured from outside")."""
        return self._sliced("all_gather", full, dist.broadcast, "src", async_op)

    def all_gather_shared(self, full: torch.Tensor, shards: Sequence[torch.Tensor]) -> None:
        """All-gather from shards every rank keeps in shared memory (``shards[k]``: rank
        ``k``'s, mapped here): copies each into its dim-0 slice of ``full``; no gloo, and no
        waiting for the other ranks, whose shards do not change while they can be read
        (:class:`~meshtrain.parallel.data.zero3.ParameterGatherer`). Counted as one
        all-gather."""
        if not self.active:
            return
        entry = self._enter("all_gather", full.shape, full.dtype, self._nbytes(full),
                            shared=True)
        if entry is None:
            return
        rows = full.shape[0] // self.size
        for k, shard in enumerate(shards):
            full[k * rows:(k + 1) * rows].copy_(shard.view(full[:rows].shape))
        self._issued(entry, None, False)

    def reduce_scatter_in_place(self, full: torch.Tensor, async_op: bool = False):
        """Reduce-scatter with no temporary buffer: afterwards this rank's dim-0 slice of
        ``full`` holds the sum of every rank's slice there; the other slices are scratch
        (overwritten). One reduce per rank, to the slice's owner. Counted as one
        reduce-scatter (see :meth:`all_gather_in_place` for why)."""
        return self._sliced("reduce_scatter", full, dist.reduce, "dst", async_op)

    def _sliced(self, op: str, full: torch.Tensor, call, peer_kw: str, async_op: bool):
        if not self.active:
            return None
        if full.shape[0] % self.size:
            raise ValueError(f"{op}: {full.shape[0]} rows do not split over {self.size} ranks")
        entry = self._enter(op, full.shape, full.dtype, self._nbytes(full))
        if entry is None:
            return None
        rows = full.shape[0] // self.size
        works = [call(full[j * rows:(j + 1) * rows], group=self.group, async_op=async_op,
                      **{peer_kw: dist.get_global_rank(self.group, j)})
                 for j in range(self.size)]
        return self._issued(entry, _Works(works) if async_op else None, async_op)

    def all_to_all_single(self, output: torch.Tensor, inputs: torch.Tensor,
                          output_splits: list[int] | None = None,
                          input_splits: list[int] | None = None, async_op: bool = False):
        """All-to-all with optional variable splits along dim 0."""
        if not self.active:
            output.copy_(inputs)
            return None
        entry = self._enter("all_to_all", inputs.shape, inputs.dtype, self._nbytes(inputs))
        if entry is None:
            return None
        return self._issued(entry, dist.all_to_all_single(output, inputs, output_splits,
                                                          input_splits, group=self.group,
                                                          async_op=async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False):
        """Broadcast from the axis rank ``src_group_rank``."""
        if not self.active:
            return None
        entry = self._enter("broadcast", tensor.shape, tensor.dtype, self._nbytes(tensor))
        if entry is None:
            return None
        src = dist.get_global_rank(self.group, src_group_rank)
        return self._issued(entry, dist.broadcast(tensor, src=src, group=self.group,
                                                  async_op=async_op), async_op)

    def all_gather_json(self, value) -> list:
        """Every rank's ``value`` (JSON-able: see :func:`gather_json`), in axis rank order
        (diagnostics and bookkeeping, not the hot path). Logged as an ``all_gather_object`` of
        no bus bytes; with one rank, ``[value]`` as given."""
        if not self.active:
            return [value]
        payload = _encode(value)  # a value JSON cannot carry raises here, before any record
        entry = self._enter("all_gather_object", (), torch.uint8, 0)
        if entry is None:
            return [None] * self.size
        out = _gather_payload(payload, self.group, self.size)
        entry.done = True
        return out

    def exchange(self, ops: Sequence[tuple[str, torch.Tensor, int, int]]) -> list:
        """Post point-to-point ``ops`` together as one batch (``batch_isend_irecv``: NCCL runs
        them as one group, so two neighbours' sends and receives complete together).

        Each op is ``("send" | "recv", tensor, axis rank of the peer, tag)``; returns one work
        handle per op, in order. Counted as sends and receives of the axis. With a
        :attr:`shared_p2p` transport attached, CPU tensors go through shared memory instead.
        """
        if not ops:
            return []
        peers = [dist.get_global_rank(self.group, peer) for _, _, peer, _ in ops]
        for (op, tensor, _, _), other in zip(ops, peers, strict=True):
            entry = self.log.record(self.axis, op, tensor.shape, tensor.dtype,
                                    self._nbytes(tensor), 2, peer=other)
            entry.done = None
        if self.shared_p2p is not None and all(t.device.type == "cpu" for _, t, _, _ in ops):
            works = self.shared_p2p.post(list(ops))
        else:
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, other,
                           group=self.group, tag=tag)
                for (op, tensor, _, tag), other in zip(ops, peers, strict=True)])
        return [_TimedWork(work, self.log, self.axis) for work in works]
