"""Data parallelism with ZeRO stages 0-3 over flat buckets.

=======  ====================  ======================  ==========================  =============
stage    parameters            gradients               optimizer (fp32 master+m+v)  communication
=======  ====================  ======================  ==========================  =============
0 (DP)   full                  full                    full                        all-reduce
1        full                  full                    1/N                         RS + AG
2        full                  1/N                     1/N                         RS + AG
3        1/N (gathered per     1/N                     1/N                         AG fwd + AG bwd
         block when used)                                                          + RS
=======  ====================  ======================  ==========================  =============

Gradients are reduced bucket by bucket from ``post_accumulate_grad`` hooks, as soon as the last
parameter of a bucket has its gradient, so communication overlaps the rest of backward. Buckets
are launched strictly in index order (every rank issues collectives in the same order even if
backward finishes buckets in another one).

Gradient precision (``grad_dtype``): gradients are accumulated over micro-batches, reduced and
read by clipping and the optimizer in fp32 by default, whatever the parameter dtype. With bf16
parameters that is a separate fp32 buffer (Megatron's ``main_grad``): autograd produces each
micro-batch's bf16 ``.grad``, the gradient hook adds it into the fp32 buffer and drops it, so a
bf16 gradient lives only between its production and its hook. ``grad_dtype = bf16``
(``parallel.grad_reduce_dtype``) keeps bf16 gradient buffers and bf16 reductions: half the bytes,
with bf16 rounding in accumulation and in the sum over ranks.

Stages 0 and 1 reduce only on the last micro-batch of a step (gradients accumulate locally in the
flat gradient buffer). Stages 2 and 3 hold no full gradient buffer, so they reduce-scatter every
micro-batch and accumulate into the gradient shard: with k micro-batches they move k times the
gradient bytes, the price of never holding full gradients (as in DeepSpeed's stage 2 and FSDP).

On one host, the gradient buffers of stages 0 and 1 (fp32, CPU) live in shared memory that every
rank of the group maps, and are reduced there instead of through gloo's loopback TCP
(:mod:`meshtrain.parallel.shared_memory`; ``parallel.dp_shared_memory``).

Expert parallelism: expert weights (recorded ``dp_axis = "edp"`` in the model's sharding table by
:mod:`meshtrain.parallel.expert`) are held only by
the ``dp × tp / ep`` ranks of their ``edp`` group, so they live in buckets of their own (see
:func:`~meshtrain.parallel.data.buckets.bucket_by_size_and_axis`) that are reduced, and under
ZeRO sharded, over ``edp``; every other parameter reduces over ``dp``. Under ZeRO-3 an MoE unit
is one bucket per axis (:func:`meshtrain.parallel.data.apply_data_parallel`), so the experts'
parameters are sharded over, and gathered from, only the ``edp`` ranks that hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from meshtrain.parallel.data.buckets import FlatBucket, bucket_by_size_and_axis
from meshtrain.parallel.data.grad_accounting import GradientAccounting
from meshtrain.parallel.data.grad_buffers import GradientBuffers
from meshtrain.parallel.data.mapped import (
    MappedBuffer,
    mapped_buffers_supported,
    release_full_buffer,
)
from meshtrain.parallel.data.shard_storage import ShardStorage
from meshtrain.parallel.data.shared_shards import SharedShards, shared_staging
from meshtrain.parallel.data.staging import StagingPool
from meshtrain.parallel.shared_memory import SharedMemoryReducer
from meshtrain.parallel.state import shardings_of


@dataclasses.dataclass
class OptimizerShard:
    """What the optimizer updates for one bucket on this rank: a 1-D fp32 master, its gradient,
    and the end of the weight-decayed region (elements ``[0, decay_end)`` decay)."""

    master: torch.Tensor
    grad: Callable[[], torch.Tensor]
    decay_end: int
    bucket: FlatBucket


class DataParallelEngine(GradientBuffers, GradientAccounting, ShardStorage):
    """Owns the flat buffers of every bucket, the gradient hooks and the ZeRO bookkeeping."""

    def __init__(self, model: torch.nn.Module, mesh, stage: int, bucket_bytes: int,
                 units: list[tuple[str, list[tuple[str, torch.nn.Parameter]]]] | None = None,
                 shared_memory: bool = True, grad_dtype: torch.dtype = torch.float32,
                 init_values: Callable[[str, torch.nn.Parameter], torch.Tensor] | None = None):
        """``units`` (ZeRO-3): ``(axis, named parameters)`` of each bucket, in backward order.
        ``shared_memory``: reduce fp32 CPU gradient buckets (stages 0-1) through shared memory
        when every rank of their group is on this host; ``grad_dtype``: the dtype gradients are
        accumulated and reduced in (see the module docstring); ``init_values``: ``(name, param,
        flat_range=None) -> initial value`` (or its flat ``[start, stop)`` elements; ZeRO-3
        asks only for its shard's) for parameters that hold no values yet (a model materialised from
        the meta device), written straight into the flat buffers; None = flatten the
        parameters' current values."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
        # Context-parallel ranks hold the same parameters and reduce with the data-parallel
        # ones: every "dp" here is the mesh's dp × cp group (equal to dp when cp = 1).
        comm, dp_rank = mesh.comm("dp_cp"), mesh.dp_cp_rank
        self.model, self.comm, self.stage = model, comm, stage
        self.shardings = shardings_of(model)  # every parameter's sharding record
        self.grad_dtype = grad_dtype
        self._init_values = init_values
        self._accumulated: dict[int, torch.Tensor] = {}  # see _on_grad_ready (pp, ZeRO >= 2)
        self.comms = {"dp": comm, "edp": mesh.comm("edp_cp")}
        self.dp_rank, self.edp_rank = dp_rank, mesh.edp_cp_rank
        axis_ranks = {"dp": (max(comm.size, 1), dp_rank),
                      "edp": (max(self.comms["edp"].size, 1), mesh.edp_cp_rank)}
        self.tp_comm = mesh.comm("tp")
        self.pp_comm = mesh.comm("pp")
        self.tied_comm = mesh.comm("tied")
        self.tp_rank = mesh.tp_rank
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if stage == 3:
            if units is None:
                raise ValueError("ZeRO-3 needs the model's units (one bucket per block and axis)")
            mixed = [g for axis, g in units if any(self.shardings[n].dp_axis != axis
                                                   for n, _ in g)]
            if mixed:
                raise ValueError(f"a ZeRO-3 bucket mixes reduction axes: {mixed[0][0][0]}, ...")
            groups = units
        else:
            # Gradients become ready roughly in reverse registration order.
            groups = bucket_by_size_and_axis(list(reversed(named)), bucket_bytes,
                                             lambda name: self.shardings[name].dp_axis,
                                             lambda name: self.shardings[name].tied)
        self.buckets = [FlatBucket(i, g, *axis_ranks[axis], axis=axis)
                        for i, (axis, g) in enumerate(groups)]
        self.has_expert_buckets = any(b.axis == "edp" for b in self.buckets)
        # CPU: in-place collectives (no gloo scratch copy, no shard staging; CountedComm).
        self.in_place = self.buckets[0].device.type == "cpu"
        self.staging = StagingPool(grad_dtype, max(b.padded_numel for b in self.buckets),
                                   0 if self.in_place else max(b.shard_numel
                                                               for b in self.buckets),
                                   self.buckets[0].device)
        covered = sum(len(b.slots) for b in self.buckets)
        if covered != len(named):
            raise ValueError(f"buckets cover {covered} parameters but the model has {len(named)}")
        self.shared_memory_requested = shared_memory
        self.shared_reducers = (self._connect_shared_memory(mesh.timeout_s) if shared_memory
                                else {})
        self.shared_shards = (SharedShards(self.shared_reducers)
                              if stage == 3 and self.shared_reducers else None)
        """ZeRO-3 on one host: shards and staging in shared memory (:mod:`.shared_shards`)."""
        for bucket in self.buckets:
            self._init_bucket(bucket)
        self.staging = shared_staging(self) or self.staging
        self.on_bucket_reduced: Callable[[FlatBucket], None] | None = None
        self.reduced_at_step_end: set[int] = set()
        """Buckets a pipelined step reduces once, in :meth:`sync_all`, not after every
        micro-batch (ZeRO-3's root buckets, gathered for the whole step anyway)."""
        self.gatherer = None
        """ZeRO-3: the :class:`~meshtrain.parallel.data.zero3.ParameterGatherer` that gathers
        and frees the buckets (told when a pipelined step starts and ends)."""
        self._bucket_of = {id(s.param): b for b in self.buckets for s in b.slots}
        self._slot_of = {id(s.param): s for b in self.buckets for s in b.slots}
        self._ready_count = [0] * len(self.buckets)
        self._next_launch = 0
        self.launch_order = list(range(len(self.buckets)))
        """Bucket indices in the order their reductions are issued (the same on every rank)."""
        self._pending: list[tuple[object, Callable[[], None]]] = []
        self._syncing = True
        self._streaming = False
        self._fresh: list[set[int]] = [set() for _ in self.buckets]
        self._grad_hooks: list | None = None
        self.register_grad_hooks()
        self._norm_runs = [self._runs(b, self._counts_in_norm) for b in self.buckets]
        self._partial_runs = [self._runs(b, self._has_partial_grad) for b in self.buckets]
        self._tied_buckets = [b.index for b in self.buckets
                              if any(self.shardings[s.name].tied for s in b.slots)]

    # ------------------------------------------------------------------ buffers
    def _connect_shared_memory(self, timeout_s: float | None) -> dict[str, SharedMemoryReducer]:
        """A shared-memory reducer for each axis whose gradient buffers can use one (collective
        on each such group; every rank of a group decides the same). ``timeout_s``: the mesh's
        collective timeout, which the reducer's barriers honour too."""
        if self.stage == 2 or (self.stage == 3 and self.offload is not None):
            return {}
        axes = sorted({b.axis for b in self.buckets if self.shareable(b)})
        reducers = {}
        for axis in axes:
            comm = self.comms[axis]
            reducer = comm.shared_memory or SharedMemoryReducer.connect(comm, timeout_s)
            if reducer is not None:
                reducers[axis] = reducer
        return reducers

    def shareable(self, b: FlatBucket) -> bool:
        """Whether ``b``'s gradient buffer can be reduced through shared memory."""
        return self.grad_dtype == torch.float32 and b.device.type == "cpu"

    def _new_grad_buffer(self, b: FlatBucket) -> torch.Tensor:
        reducer = self.shared_reducers.get(b.axis)
        if reducer is None or not self.shareable(b):
            return b.new_buffer(self.grad_dtype)
        return reducer.new_buffer(self.comms[b.axis], b.padded_numel, self.grad_dtype)

    def _new_shard(self, b: FlatBucket, dtype: torch.dtype, role: str) -> torch.Tensor:
        shared = (self.shared_shards.new_param_shard(b, self.comms[b.axis], dtype)
                  if self.shared_shards is not None and role == "param" else None)
        return super()._new_shard(b, dtype, role) if shared is None else shared

    def settle_shards(self) -> None:
        """ZeRO-3 with shards in shared memory: once gradients are reduced, the group meets
        here, and the next gather meets it again first (:mod:`.shared_shards`)."""
        if self.shared_shards is not None:
            self.shared_shards.settle()
            if self.gatherer is not None:
                self.gatherer.shards_may_have_changed = True

    @torch.no_grad()
    def _init_bucket(self, b: FlatBucket) -> None:
        b.mapped = None
        if self.stage == 3 and mapped_buffers_supported(b.device):
            b.mapped = MappedBuffer(b.padded_numel, b.dtype)  # see parallel.data.mapped
            full = b.mapped.tensor
        else:
            full = b.new_buffer()
        sharded_init = self.stage == 3 and self._init_values is not None
        if self._init_values is None:
            b.flatten_params_into(full)
        elif sharded_init:  # only the parameters this rank's shard holds, straight into it
            b.param_shard = self._new_shard(b, b.dtype, "param")
            for s, start, length in b.segments(sharded=True):
                first = b.shard_start + start - s.offset
                b.param_shard[start:start + length].copy_(
                    self._init_values(s.name, s.param, (first, first + length)))
                self._settle(b.param_shard[start:start + length])
        else:  # one parameter's value at a time, straight into the flat buffer
            for s in b.slots:
                full[s.offset:s.offset + s.numel].copy_(
                    self._init_values(s.name, s.param, (0, s.numel)))
        b.param_buffer = full
        b.bind_params(full)
        if self.stage == 3:
            if not sharded_init:
                b.param_shard = self._new_shard(b, b.dtype, "param")
                b.param_shard.copy_(b.shard(full))
                self._settle(b.param_shard)
            release_full_buffer(b)  # only the shard stays (ZeRO-3 gathers on use)
        if self.stage < 2:
            b.grad_buffer = self._new_grad_buffer(b)
            if not self._separate_grads(b):
                b.bind_grads(b.grad_buffer)
        else:
            b.grad_shard = self._new_shard(b, self.grad_dtype, "grad")

    def optimizer_shards(self) -> list[OptimizerShard]:
        """One :class:`OptimizerShard` per bucket; masters alias the parameters when fp32."""
        shards = []
        for b in self.buckets:
            if self.stage == 0:
                source, grad = b.param_buffer, (lambda b=b: b.grad_buffer)
                decay_end = b.decay_numel
            else:
                source = b.param_shard if self.stage == 3 else b.shard(b.param_buffer)
                grad = ((lambda b=b: b.shard(b.grad_buffer)) if self.stage == 1
                        else (lambda b=b: b.grad_shard))
                decay_end = b.decay_range_in_shard()[1]
            master = self._master_of(b, source)
            b.master_source = source
            shards.append(OptimizerShard(master, grad, decay_end, b))
        return shards

    # ------------------------------------------------------------------ gradient sync
    def start_microbatch(self, is_last: bool) -> None:
        """Call before each micro-batch's forward; ``is_last`` on the step's final one."""
        self.register_grad_hooks()
        self._syncing = is_last or self.stage >= 2
        self._ready_count = [0] * len(self.buckets)
        self._next_launch = 0

    def begin_accumulation(self) -> None:
        """Start a step whose micro-batches' backward passes interleave (pipeline schedules),
        finished by :meth:`sync_all`. Stages 0-1 accumulate in their gradient buffers. Stages
        2-3 hold no full gradients: a bucket is reduce-scattered into its shard as soon as each
        of its parameters has a new gradient (:meth:`_on_grad_ready`), at most two reductions
        in flight; every dp rank of a pipeline stage runs the same schedule, so they issue these
        collectives in the same order. Under ZeRO-3 the gatherer keeps the root parameters
        (embedding, head, split blocks' norms) gathered from here to the end of
        :meth:`sync_all`: every micro-batch uses them, outside any unit's hooks."""
        self._syncing = False
        self._streaming = self.stage >= 2
        self._fresh = [set() for _ in self.buckets]
        if self.gatherer is not None:
            self.gatherer.begin_pipelined_step()
        if self.bind_zeroed_grads():
            self.remove_grad_hooks()

    def sync_all(self) -> None:
        """Reduce every bucket now (in order) and wait; when streaming (stages 2-3 under a
        pipeline), only the buckets with gradients not yet reduced."""
        if self._streaming:
            self._streaming = False
            for b in self.buckets:
                if self._fresh[b.index]:
                    self._launch(b)
            self._drain()
            self.staging.clear()
            self.settle_shards()
            if self.gatherer is not None:
                self.gatherer.end_pipelined_step()
            return
        self._syncing = True
        self._next_launch = 0
        self.end_microbatch()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is None:
            # The zero-bubble ``I`` pass defers a matmul weight's gradient: autograd still
            # calls the hook, with nothing accumulated. The ``W`` pass calls it again with it.
            return
        bucket = self._bucket_of[id(param)]
        if self.stage < 2:
            self._keep_grad_in_buffer(bucket, self._slot_of[id(param)])
        elif not self._syncing and self._separate_grads(bucket):
            # ZeRO >= 2 accumulating across micro-batches (pipeline schedules): keep the sum
            # in fp32 until the bucket is reduced.
            total = self._accumulated.get(id(param))
            if total is None:
                self._accumulated[id(param)] = param.grad.float()
            else:
                total.add_(param.grad)
            param.grad = None
        if self._streaming:
            # Launched once every parameter has a gradient since the last launch (counted per
            # parameter: under a zero-bubble schedule the norms' gradients of the next
            # micro-batch can arrive before this one's deferred weight gradients).
            fresh = self._fresh[bucket.index]
            fresh.add(id(param))
            if len(fresh) == len(bucket.slots) and bucket.index not in self.reduced_at_step_end:
                fresh.clear()
                self._launch(bucket)
            return
        if not self._syncing:
            return
        self._ready_count[bucket.index] += 1
        order = self.launch_order
        while (self._next_launch < len(order) and self._ready_count[order[self._next_launch]]
               == len(self.buckets[order[self._next_launch]].slots)):
            self._launch(self.buckets[order[self._next_launch]])
            self._next_launch += 1

    def stage_gradients(self, b: FlatBucket) -> None:
        """Before bucket ``b``'s backward (ZeRO-3: when its block is re-gathered): bind its
        parameters' ``.grad`` to a zeroed staging buffer, so autograd accumulates in place there
        and the bucket is reduce-scattered from it, with no gradient tensor allocated. Only for
        gradients in the parameters' own dtype and outside pipeline streaming."""
        if (self.stage < 2 or self._streaming or self._separate_grads(b)
                or getattr(b, "staged", None) is not None
                or any(s.param.grad is not None for s in b.slots)):
            return
        slot, full, shard = self.staging.take(b, self._drain_oldest)
        full.zero_()
        b.bind_grads(full)
        b.staged = (slot, full, shard)

    def _gather_grads(self, b: FlatBucket, buf: torch.Tensor) -> torch.Tensor:
        """Fill ``buf`` with every parameter's gradient since the bucket's last reduction
        (zeros where none), leaving no ``.grad`` behind."""
        buf.zero_()
        for s in b.slots:
            view = buf[s.offset:s.offset + s.numel]
            total = self._accumulated.pop(id(s.param), None)
            if total is not None:
                view.copy_(total.reshape(-1))
            if s.param.grad is not None:
                view.add_(s.param.grad.reshape(-1))
                s.param.grad = None
        return buf

    def _launch(self, b: FlatBucket) -> None:
        comm = self.comms[b.axis]
        if self.stage < 2 and not self._separate_grads(b):
            self._zero_missing_grads(b)
        if self.stage == 0:
            handle = comm.all_reduce(b.grad_buffer, async_op=True)
            post = lambda: None  # noqa: E731
        elif self.stage == 1:
            buf = b.grad_buffer
            # Through shared memory the buffer is reduced in place: its own shard gets the sum.
            out = (b.shard(buf) if comm.shares(buf)
                   else torch.empty(b.shard_numel, dtype=buf.dtype, device=b.device))
            handle = comm.reduce_scatter_into(out, buf, async_op=True)
            in_place = out.data_ptr() == b.shard(b.grad_buffer).data_ptr()
            post = (lambda: None) if in_place else (lambda: b.shard(b.grad_buffer).copy_(out))
        else:
            staged, b.staged = getattr(b, "staged", None), None
            if staged is not None:  # autograd accumulated straight into the staging buffer
                slot, buf, out = staged
                for s in b.slots:
                    s.param.grad = None
            else:
                slot, buf, out = self.staging.take(b, self._drain_oldest)
                self._gather_grads(b, buf)
            if comm.shares(buf):  # through shared memory, in place: its shard gets the sum
                out = b.shard(buf)
                handle = comm.reduce_scatter_into(out, buf, async_op=True, drop_read_pages=True)
            elif self.in_place:  # the staging buffer is scratch: reduced where it is
                handle = comm.reduce_scatter_in_place(buf, async_op=True)
                out = b.shard(buf)
            else:
                handle = comm.reduce_scatter_into(out, buf, async_op=True)

            def post():
                self._add_to_grad_shard(b, out)
                self.staging.release(slot)
            if self.on_bucket_reduced is not None:
                self.on_bucket_reduced(b)
        self._pending.append((handle, post))

    def end_microbatch(self) -> None:
        """Call after each micro-batch's backward: launch what is left (parameters that got no
        gradient count as zero), wait for every reduction and finish it."""
        if self._syncing:
            while self._next_launch < len(self.launch_order):
                self._launch(self.buckets[self.launch_order[self._next_launch]])
                self._next_launch += 1
        self._drain()
        self.staging.clear()
        self.settle_shards()

    def _drain_oldest(self) -> bool:
        """Finish the oldest reduction in flight; False when none is."""
        if not self._pending:
            return False
        self._drain(keep=len(self._pending) - 1)
        return True

    def _drain(self, keep: int = 0) -> None:
        """Wait for (and finish) the oldest reductions until at most ``keep`` are in flight."""
        while len(self._pending) > keep:
            handle, post = self._pending.pop(0)
            if handle is not None:
                handle.wait()
            post()

    # ------------------------------------------------------------------ optimizer glue
    @torch.no_grad()
    def after_step(self, shards: list[OptimizerShard]) -> None:
        """Write updated masters back into the parameters and re-assemble them where sharded
        (ZeRO-3: nothing gathered before the update outlives it)."""
        if self.gatherer is not None:
            self.gatherer.release_all()
        for shard in shards:
            b = shard.bucket
            if shard.master is not b.master_source:
                self._write_master(b, shard.master)
            if self.stage in (1, 2):
                comm = self.comms[b.axis]
                if self.in_place:  # this rank's slice already holds its updated shard
                    comm.all_gather_in_place(b.param_buffer)
                else:
                    comm.all_gather_into(b.param_buffer, b.shard(b.param_buffer).clone())

    # ------------------------------------------------------------------ reporting
    def memory(self) -> dict[str, int]:
        """Bytes of parameters and gradients this rank holds at rest (model states)."""
        def nbytes(t):
            return t.numel() * t.element_size()

        params = sum(nbytes(b.param_shard if self.stage == 3 else b.param_buffer)
                     for b in self.buckets)
        grads = sum(nbytes(b.grad_buffer if self.stage < 2 else b.grad_shard)
                    for b in self.buckets)
        return {"param_bytes": params, "grad_bytes": grads}
