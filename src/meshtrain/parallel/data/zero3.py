"""ZeRO-3 parameter gathering: each unit's parameters exist in full only while it computes.

A unit is a transformer block, or, when a block's parameters exceed ``parallel.dp_bucket_mb``,
one of its sub-modules (attention, MLP, down to single projections; the blocks' norm weights then
join the root unit), so that what is gathered, prefetched, staged and reduced at once stays
about a bucket (:func:`meshtrain.parallel.data._zero3_units`). Every unit is one bucket per
reduction axis: one, or under expert parallelism an MoE unit's dense parameters (router, shared
experts) sharded over ``dp`` beside its experts sharded over ``edp``. At rest
a rank holds only its shard of each bucket; the full flat buffer keeps its tensor but its memory
is released (storage resized to zero bytes; on the CPU an anonymous memory map whose pages are
handed back, :mod:`.mapped`), so the parameters (views into it) cost nothing.

- Forward: a unit's pre-forward hook all-gathers it (waiting for a prefetch if one is in flight)
  and starts prefetching the next unit; its post-forward hook frees it again, except the last
  unit's when a backward follows (that backward runs first, :meth:`ParameterGatherer.
  last_unit`).
- Backward: a hook on the unit's output fires when the gradient reaches it; it re-gathers the
  unit (prefetching the previous one) before the unit's backward runs. Once the unit's
  gradients are reduce-scattered (:class:`DataParallelEngine`), its storage is freed.
- The root unit (embedding, final norm, head) is gathered when the model's forward starts, freed
  when it ends, re-gathered when the gradient of the logits arrives, and freed once its gradients
  are reduced at the end of backward. So every parameter but the last unit's is gathered once
  for forward and once for backward: 1.5x the bytes of plain data parallelism, as in the ZeRO
  paper (7).
- On one host the gathers and reductions can go through shared memory instead of the backend
  (:mod:`.shared_shards`).
- Under pipeline parallelism (every schedule) the stage chunks run the units between
  :meth:`ParameterGatherer.begin_pipelined_step` and :meth:`~ParameterGatherer.
  end_pipelined_step`: each unit is gathered and freed around each micro-batch's forward and
  backward, and reduce-scattered once each of its parameters has a new gradient (so per
  micro-batch, not per step); the root buckets stay gathered through the step and are
  reduce-scattered once at its end. A zero-bubble ``W`` pass computes weight gradients
  without the weights, possibly after the unit's next forward freed it.
- A unit is never freed while a backward runs through it: from the gradient of its output to
  that of its input (a hook on each). A forward inside its own backward is an activation
  checkpoint's recomputation and keeps the parameters; a recomputation ahead of the unit's
  backward frees them again, and its original forward's hooks re-gather them.

Re-gathering writes into the *same* storage that autograd saved for backward, through an alias
tensor with its own version counter, so the saved views see the gathered values again without
autograd mistaking the refill for an in-place modification.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.data.buckets import FlatBucket
from meshtrain.parallel.data.engine import DataParallelEngine
from meshtrain.parallel.data.mapped import release_full_buffer, restore_full_buffer


class ParameterGatherer:
    """Gathers and frees ZeRO-3 buckets around each unit's forward and backward; ``units``
    (modules, in forward order) and ``unit_buckets`` (the buckets of each, one per reduction
    axis) correspond one to one; ``root_buckets``: those of the parameters outside every unit;
    ``prefetch``: units gathered ahead of the running one (the next ones in forward, the
    previous ones in backward; 0: none)."""

    def __init__(self, engine: DataParallelEngine, model: torch.nn.Module,
                 units: list[torch.nn.Module], unit_buckets: list[list[FlatBucket]],
                 root_buckets: list[FlatBucket], prefetch: int = 1):
        self.engine = engine
        self.prefetch = prefetch
        self.units = units
        self.unit_buckets = unit_buckets
        self.root_buckets = root_buckets
        self._handles: dict[int, object] = {}
        n = len(units)
        self._next = {i: i + 1 for i in range(n - 1)}  # prefetch order, forward and backward
        self._prev = {i + 1: i for i in range(n - 1)}
        self._seen: list[int] | None = []  # units in the first forward's call order
        self._gathered: set[int] = set()
        self._busy: dict[int, int] = {}  # unit -> backward passes running through it
        self._free_after_backward: dict[int, list[FlatBucket]] = {}
        self._unit_of = {b.index: i for i, buckets in enumerate(unit_buckets) for b in buckets}
        self._root = {b.index for b in root_buckets}
        self._pipelined = False  # a pipeline step: root kept gathered, see begin_pipelined_step
        engine.reduced_at_step_end = set(self._root)
        shared = engine.shared_shards
        self._peer_shards = {} if shared is None else {
            b.index: views for b in engine.buckets
            if (views := shared.peer_shards(b)) is not None}
        self._own_rank = {"dp": engine.dp_rank, "edp": engine.edp_rank}
        self.shards_may_have_changed = True
        """Shared shards (:mod:`.shared_shards`): set when the group met after its reductions
        (the shards may be written from then on); the next gather meets the group first."""
        for bucket in engine.buckets:
            self._free(bucket)
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for i, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i))
            unit.register_forward_hook(lambda m, args, out, i=i: self._post_forward(i, args, out))
        engine.on_bucket_reduced = self._on_reduced

    # ------------------------------------------------------------------ storage
    @staticmethod
    def _storage(bucket: FlatBucket) -> torch.UntypedStorage:
        return bucket.param_buffer.untyped_storage()

    def _free(self, bucket: FlatBucket) -> None:
        release_full_buffer(bucket)
        self._gathered.discard(bucket.index)

    def _gather_all(self, buckets: list[FlatBucket], wait: bool) -> None:
        for bucket in buckets:  # issue every gather before waiting for any
            self._gather(bucket, wait=False)
        if wait:
            for bucket in buckets:
                self._wait(bucket)

    def _gather(self, bucket: FlatBucket, wait: bool) -> None:
        if bucket.index not in self._gathered and bucket.index not in self._handles:
            comm = self.engine.comms[bucket.axis]
            restore_full_buffer(bucket)
            storage = self._storage(bucket)
            alias = torch.empty(0, dtype=bucket.dtype, device=bucket.device).set_(
                storage, 0, (bucket.padded_numel,))
            peers = self._peer_shards.get(bucket.index)
            if peers is not None:  # every rank's shard is mapped here: copy them in
                if self.shards_may_have_changed:  # the first read since they could change
                    self.engine.shared_shards.settle()
                    self.shards_may_have_changed = False
                comm.all_gather_shared(alias, peers)
                self.engine.shared_shards.drop_peer_pages(peers, self._own_rank[bucket.axis])
                self._gathered.add(bucket.index)
                return
            source = self.engine.gather_source(bucket)  # the shard, or its offloaded copy
            if self.engine.in_place:  # no scratch copy of the bucket (CountedComm)
                bucket.shard(alias).copy_(source)
                self._handles[bucket.index] = comm.all_gather_in_place(alias, async_op=True)
            else:
                self._handles[bucket.index] = comm.all_gather_into(alias, source, async_op=True)
            self.engine.gather_done(bucket)
        if wait:
            self._wait(bucket)

    def _wait(self, bucket: FlatBucket) -> None:
        handle = self._handles.pop(bucket.index, None)
        if handle is not None:
            handle.wait()
        self._gathered.add(bucket.index)

    # ------------------------------------------------------------------ hooks
    def _root_pre_forward(self, module, args) -> None:
        self._reset_backward_state()
        self._gather_all(self.root_buckets, wait=True)
        if self.unit_buckets and self.prefetch:
            for unit in [0] + self._ahead(0, self._next)[:self.prefetch - 1]:
                self._gather_all(self.unit_buckets[unit], wait=False)

    def _learn_order(self) -> None:
        """After the first forward: prefetch, and reduce in reverse, in the order the units
        really ran (registration order may differ: an MLP calls ``w3`` before ``w2``). Every
        rank runs the same forward, so all learn the same order."""
        seen, self._seen = self._seen, None
        if seen is None or sorted(seen) != list(range(len(self.units))):
            return
        self._next = dict(zip(seen, seen[1:], strict=False))
        self._prev = dict(zip(seen[1:], seen, strict=False))
        order = [b.index for i in reversed(seen) for b in self.unit_buckets[i]]
        rest = [i for i in range(len(self.engine.buckets)) if i not in set(order)]
        self.engine.launch_order = order + rest

    def _root_post_forward(self, module, args, output) -> None:
        self._learn_order()
        if not self.root_buckets:
            return
        for bucket in self.root_buckets:
            self._free(bucket)
        tensor = output[0] if isinstance(output, tuple) else output
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._gather_all(self.root_buckets, wait=True))

    def _pre_forward(self, i: int) -> None:
        if self._seen is not None and i not in self._seen:
            self._seen.append(i)
        self._gather_all(self.unit_buckets[i], wait=True)
        if not self._busy.get(i):
            for ahead in self._ahead(i, self._next):
                self._gather_all(self.unit_buckets[ahead], wait=False)

    def _ahead(self, i: int, order: dict[int, int]) -> list[int]:
        """The ``prefetch`` units after ``i`` in ``order`` (``_next``: forward, ``_prev``:
        backward), fewer at the end."""
        units = []
        while len(units) < self.prefetch and i in order:
            i = order[i]
            units.append(i)
        return units

    def _post_forward(self, i: int, args, output) -> None:
        if self._busy.get(i):  # re-run inside its own backward (checkpointing): keep it
            return
        if not self._keeps_for_backward(i, output):
            for bucket in self.unit_buckets[i]:
                self._free(bucket)
        if torch._C._current_graph_task_id() != -1:
            # Re-run by a checkpointed region's recomputation ahead of this unit's backward:
            # the hooks of its original forward (whose graph backward walks) gather it again.
            return
        tensor = output[0] if isinstance(output, tuple) else output
        if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return
        first = args[0] if args else None
        tracked = isinstance(first, torch.Tensor) and first.requires_grad
        tensor.register_hook(lambda grad, i=i, tracked=tracked: self._pre_backward(i, tracked))
        if tracked:  # the input's gradient is complete once this unit's backward is done
            first.register_hook(lambda grad, i=i: self._post_backward(i))

    def _keeps_for_backward(self, i: int, output) -> bool:
        """Whether unit ``i`` stays gathered after its forward: the last unit
        (:meth:`last_unit`), outside pipeline steps, when a backward will follow (its output
        needs a gradient). Its backward is the first to run, so freeing it would only gather
        the same bytes again at once; it is freed once its gradients are reduced, as every unit
        is.
        (torchtitan keeps FSDP2's last block unsharded after forward for the same reason.)"""
        if self._pipelined or i != self.last_unit():
            return False
        tensor = output[0] if isinstance(output, tuple) else output
        if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return False
        return torch._C._current_graph_task_id() == -1  # not a recomputation in a backward

    def last_unit(self) -> int:
        """The unit whose forward runs last (as learned from the first forward; during that
        one, the last registered), which stays gathered for its backward."""
        if self._seen is None:
            last = [i for i in range(len(self.units)) if i not in self._next]
            if len(last) == 1:
                return last[0]
        return len(self.units) - 1

    def _pre_backward(self, i: int, tracked: bool) -> None:
        if tracked:
            self._busy[i] = self._busy.get(i, 0) + 1
        for bucket in self.unit_buckets[i]:
            self.engine.stage_gradients(bucket)
        self._gather_all(self.unit_buckets[i], wait=True)
        for ahead in self._ahead(i, self._prev):
            self._gather_all(self.unit_buckets[ahead], wait=False)

    def _post_backward(self, i: int) -> None:
        left = self._busy.pop(i, 0) - 1
        if left > 0:
            self._busy[i] = left
            return
        for bucket in self._free_after_backward.pop(i, []):
            self._free(bucket)

    def _on_reduced(self, bucket: FlatBucket) -> None:
        self._wait(bucket)  # never free storage that a gather is still writing
        if self._pipelined and bucket.index in self._root:
            return  # the next micro-batch uses it again: freed at the step's end
        unit = self._unit_of.get(bucket.index)
        if unit is not None and self._busy.get(unit):
            # Reduced before its backward ended (a gradient that arrives mid-backward completed
            # the bucket under a zero-bubble schedule): its matmuls still read the parameters.
            self._free_after_backward.setdefault(unit, []).append(bucket)
            return
        self._free(bucket)

    def _reset_backward_state(self) -> None:
        """Forget the backward passes of an earlier step (none is running between steps)."""
        self._busy.clear()
        self._free_after_backward.clear()

    def release_all(self) -> None:
        """Free every bucket still gathered (after an update of the shards: a unit kept for a
        backward that never came must not serve the old values to the next forward)."""
        for bucket in self.engine.buckets:
            if bucket.index in self._gathered or bucket.index in self._handles:
                self._wait(bucket)
                self._free(bucket)

    def forward_order(self) -> list[int]:
        """Every bucket's index in the order the next forward gathers them: the root buckets,
        then each unit's in the order the units run (as learned from the first forward)."""
        order = [b.index for b in self.root_buckets]
        unit = next((i for i in range(len(self.units)) if i not in self._prev), None)
        seen = set()
        while unit is not None and unit not in seen:
            seen.add(unit)
            order += [b.index for b in self.unit_buckets[unit]]
            unit = self._next.get(unit)
        order += [b.index for b in self.engine.buckets if b.index not in set(order)]
        return order

    # ------------------------------------------------------------------ pipeline steps
    def begin_pipelined_step(self) -> None:
        """A pipeline schedule's step starts (:meth:`DataParallelEngine.begin_accumulation`):
        its stage chunks run the units, but never the model's own forward, so the root buckets
        are gathered now and kept until :meth:`end_pipelined_step`; their gradients accumulate
        over the micro-batches and are reduce-scattered once, at the step's end. Each unit is
        still gathered and freed around its every forward and backward, and reduce-scattered
        (then freed) once each of its parameters has a new gradient."""
        self._pipelined = True
        self._reset_backward_state()
        self._gather_all(self.root_buckets, wait=True)

    def end_pipelined_step(self) -> None:
        """Every gradient of the step is reduced: release the root buckets, and any unit a
        prefetch gathered that did not run after it (the optimizer step is about to change
        every shard, so nothing gathered may outlive the step). After the first step, prefetch
        in the order the units really ran."""
        self._pipelined = False
        self._reset_backward_state()
        self._learn_order()
        for bucket in self.engine.buckets:
            self._wait(bucket)
            self._free(bucket)
