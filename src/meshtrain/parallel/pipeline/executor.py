"""The pipeline runtime: executes any schedule's action list on this rank.

One generic loop dispatches each :class:`Action` of the rank's list; nothing here (or in the
trainer) looks at the schedule's name. Communication goes through the counted ``pp`` comm:
activations and gradients have shapes known in advance (``[micro-batch, seq, dim]``, with the
sequence divided by tp under sequence parallelism), so no shape handshake precedes a transfer.
Each run of consecutive send/recv actions is one exchange, posted together
(``batch_isend_irecv``) through :class:`~.p2p.Exchanger`; a received tensor's exchange is waited
for right before the compute that consumes it; before the next exchange is posted, the earlier
ones are waited for (CPU) or the completed ones dropped (CUDA), which frees the tensors they sent
(a backend's work handle keeps its tensor until then); the last one is waited for at the end of
the step. A stage's input and its gradient are dropped once the backward that produced the gradient
has handed it on, so a rank holds the activations of the micro-batches in flight, not of every
micro-batch of the step. The schedules put messages in
the same order on both sides of every pair and place exchanges so they complete even when sends
wait for their receives (:mod:`.message_order`), so this is correct under NCCL's untagged,
in-order matching; tags (:mod:`.p2p`'s default ``tagged`` semantics) are a second guard on gloo
only.

Zero-bubble split: ``I`` runs the stage's backward once, with the linear layers' weight gradients
deferred (:mod:`meshtrain.model.weight_grad`): input gradients flow, every matmul stashes its
``(input, grad_output)`` on this micro-batch's queue, and the graph is freed. ``W`` then computes
those weight gradients from the stash alone (no graph walk, no tp/ep collective). Norm weights,
the MoE router and embeddings get their (cheap) gradients during ``I``. See docs/pipeline.md.
Where a rank's list splits some backwards and runs others whole (1F1B's early gradient sends),
the forwards of the whole ones run their linear layers plain
(:func:`~meshtrain.model.weight_grad.plain_matmuls`), without the deferrable layers' Python
autograd step.

Auxiliary losses (the MoE balance loss): ``aux_loss_fn(chunk)``, when set, is called right after
each stage forward and returns that micro-batch's extra loss terms of the stage's own layers (or
None). On the last stage the term is added to the loss; on any other stage it is kept beside the
stage output and backpropagated *together* with it (``backward([out, aux], [grad, None])``), so a
non-last stage's MoE layers get their balance gradient without sending anything extra.
``aux_total`` is the detached sum of these terms over the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from meshtrain.model.weight_grad import WeightGradQueue, deferring, plain_matmuls
from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.pipeline.message_order import Message, exchanges, message_of
from meshtrain.parallel.pipeline.p2p import Exchanger
from meshtrain.parallel.pipeline.schedule import Action, ActionKind, Schedule
from meshtrain.parallel.pipeline.shared_memory_p2p import connect_transport
from meshtrain.parallel.pipeline.stage import StageChunk
from meshtrain.parallel.timing import stamp

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineExecutor:
    """Runs one training step's forward and backward for this pipeline rank."""

    def __init__(self, schedule: Schedule, chunks: dict[int, StageChunk], comm: CountedComm,
                 pp_rank: int, activation_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, exchanger: Exchanger | None = None):
        """``exchanger``: share another executor's (its per-pair message counts), for a second
        schedule over the same ranks such as the forward-only evaluation pass."""
        self.schedule, self.chunks, self.comm = schedule, chunks, comm
        self.exchanger = exchanger or Exchanger(comm)
        self.pp_rank = pp_rank
        self.activation_shape = activation_shape
        self.dtype, self.device = dtype, device
        self.record_events = False
        self.events: list[tuple[int, Action, float, float]] = []
        self.aux_loss_fn: Callable[[StageChunk], torch.Tensor | None] | None = None
        # tokens -> the micro-batch's SequenceLayout (document masking, cp), or None
        self.layout_fn: Callable[[torch.Tensor], object] | None = None
        self.aux_total = torch.zeros((), device=device)
        self.before_compute: Callable[[Action], None] | None = None
        """Called with each compute action before it runs (``train.energy_schedule`` sets the
        GPU clock there)."""
        self._aux: dict[tuple[int, int], torch.Tensor] = {}
        self._w_queues: dict[tuple[int, int], WeightGradQueue] = {}
        # (micro-batch, stage) pairs whose backward runs whole on a rank that also splits some:
        # their forwards need no deferrable matmuls
        self._whole: set[tuple[int, int]] = set()
        if schedule.defers_weight_grads:
            self._whole = {(a.microbatch, a.stage) for a in schedule.actions[pp_rank]
                           if a.kind is ActionKind.B}

    def _tag(self, kind: str, microbatch: int, stage: int) -> int:
        return (stage * self.schedule.microbatches + microbatch) * 2 + (kind == "grad")

    def run(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
            loss_fn: LossFn) -> torch.Tensor:
        """Execute the rank's actions for ``microbatches``; returns the summed loss of the
        micro-batches whose last stage is on this rank (0 elsewhere), already normalised by
        ``loss_fn``. Gradients are left accumulated in the parameters."""
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads_out: dict[tuple[int, int], torch.Tensor | None] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        received: dict[Message, tuple[torch.Tensor, list]] = {}
        in_flight: list[list] = []  # each exchange's work handles (and the tensors it sends)
        loss_total = torch.zeros((), device=self.device)
        self.aux_total = torch.zeros((), device=self.device)
        self._aux = {}
        self.events = []
        for _, item in exchanges(self.schedule.actions[self.pp_rank]):
            if isinstance(item, list):
                in_flight = self._finish_previous_exchanges(in_flight)
                in_flight.append(self._post(item, outputs, grads_in, received))
                continue
            action, mb, s, kind = item, item.microbatch, item.stage, item.kind
            if kind is ActionKind.F and ("act", mb, s - 1) in received:
                inputs[(mb, s)] = _arrived(received.pop(("act", mb, s - 1))).requires_grad_()
            elif kind in (ActionKind.B, ActionKind.I) and ("grad", mb, s + 1) in received:
                grads_out[(mb, s)] = _arrived(received.pop(("grad", mb, s + 1)))
            if self.before_compute is not None:
                self.before_compute(action)
            start = stamp(self.device)  # a CUDA event on CUDA: no host sync here
            if kind is ActionKind.F:
                loss_total += self._forward(mb, s, microbatches, loss_fn, inputs, outputs)
            elif kind in (ActionKind.B, ActionKind.I):
                self._backward_input(mb, s, kind is ActionKind.B, inputs, outputs, grads_out,
                                     grads_in)
            elif kind is ActionKind.W:
                self._backward_weight(mb, s, outputs, grads_out, inputs)
            if self.record_events:
                self.events.append((self.pp_rank, action, start, stamp(self.device)))
        for handles, _ in in_flight:
            _wait(handles)
        return loss_total

    def _finish_previous_exchanges(self, in_flight: list) -> list:
        """Before the next exchange is posted: drop the exchanges that have completed, so the
        tensors they sent (which the backend's work handles keep alive) can go; returns those
        still in flight.

        On the CPU (gloo) every earlier exchange is waited for: gloo's handles report no
        completion until waited, and waiting adds no dependency NCCL does not have (it runs a
        communicator's exchanges one after another, so the previous one has completed before the
        next starts). On CUDA a wait would make the compute stream wait for the sends, so the
        handles are only polled (``is_completed``), never waited for here."""
        if self.device.type == "cuda":
            return [entry for entry in in_flight if not all(h.completed() for h in entry[0])]
        for handles, _ in in_flight:
            _wait(handles)
        return []

    def _post(self, batch: list[Action], outputs, grads_in, received) -> tuple[list, list]:
        """Post one exchange; returns its work handles and the tensors it sends or fills (kept
        alive until the exchange has completed). Each receive is registered in
        ``received`` with the handles to wait for right before the compute that consumes it: its
        own handle where the backend gives one per operation (gloo), the batch's where it
        coalesces them (NCCL: one handle for the group, which completes as a whole)."""
        ops, keep = [], []
        for action in batch:
            kind, mb, s = message_of(action)
            tag = self._tag(kind, mb, s)
            if action.kind.is_recv:
                buf = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                ops.append(("recv", buf, action.peer, tag))
            elif action.kind is ActionKind.SEND_ACT:
                ops.append(("send", outputs[(mb, s)].detach().contiguous(), action.peer, tag))
            else:
                ops.append(("send", grads_in.pop((mb, s)).contiguous(), action.peer, tag))
            keep.append(ops[-1][1])
        handles = [_Once(work) for work in self.exchanger.post(ops)]
        per_op = [[h] for h in handles] if len(handles) == len(ops) else [handles] * len(ops)
        for action, (op, buf, _, _), waits in zip(batch, ops, per_op, strict=True):
            if op == "recv":
                received[message_of(action)] = (buf, waits)
        return handles, keep

    # ------------------------------------------------------------------ compute
    def _forward(self, mb, s, microbatches, loss_fn, inputs, outputs) -> torch.Tensor:
        chunk = self.chunks[s]
        tokens, targets = microbatches[mb]
        if chunk.is_first:
            x = tokens.to(self.device)
        elif (mb, s) in inputs:
            x = inputs[(mb, s)]
        else:  # the previous stage is on this rank: hand over in memory
            x = outputs[(mb, s - 1)].detach().requires_grad_()
            inputs[(mb, s)] = x
        layout = None if self.layout_fn is None else self.layout_fn(tokens.to(self.device))
        with self._matmuls(mb, s):
            out = chunk(x, layout)
        aux = self.aux_loss_fn(chunk) if self.aux_loss_fn is not None else None
        if aux is not None:
            self.aux_total += aux.detach()
        if chunk.is_last:
            loss = loss_fn(out, targets.to(self.device))
            outputs[(mb, s)] = loss if aux is None else loss + aux
            return loss.detach()
        if aux is not None:
            self._aux[(mb, s)] = aux
        outputs[(mb, s)] = out
        return torch.zeros((), device=self.device)

    def _matmuls(self, mb: int, s: int):
        """The context for micro-batch ``mb``'s forward (and a whole backward's recompute) at
        stage ``s``: plain linear layers where its backward runs whole on a rank that splits
        others (:attr:`_whole`), else the deferrable ones."""
        return plain_matmuls() if (mb, s) in self._whole else contextlib.nullcontext()

    def _grad_of_output(self, mb, s, grads_out, grads_in) -> torch.Tensor | None:
        if s == self.schedule.last_stage:
            return None  # the output is the loss itself
        if (mb, s) in grads_out:
            return grads_out[(mb, s)]
        return grads_in_memory(grads_in, mb, s + 1)

    def _roots(self, mb, s, outputs, grads_out, grads_in) -> tuple[list, list]:
        """The tensors to backpropagate from (stage output, plus its aux term) and their grads."""
        roots = [outputs[(mb, s)]]
        grads = [self._grad_of_output(mb, s, grads_out, grads_in)]
        if (mb, s) in self._aux:
            roots.append(self._aux[(mb, s)])
            grads.append(None)
        return roots, grads

    def _backward_input(self, mb, s, full, inputs, outputs, grads_out, grads_in) -> None:
        """``B`` (``full``): the whole backward. ``I``: the same backward with the linear
        layers' weight gradients deferred to this micro-batch's W queue; the graph is freed."""
        roots, grads = self._roots(mb, s, outputs, grads_out, grads_in)
        x = inputs.pop((mb, s), None)
        if full:
            with self._matmuls(mb, s):  # activation checkpointing recomputes the forward now
                torch.autograd.backward(roots, grads)
        else:
            with deferring(self._w_queues.setdefault((mb, s), WeightGradQueue())):
                torch.autograd.backward(roots, grads)
        self._release(mb, s, outputs, grads_out)
        if x is not None:
            grads_in[(mb, s)] = x.grad

    def _backward_weight(self, mb, s, outputs, grads_out, inputs) -> None:
        """``W``: the deferred weight gradients ``grad_output^T @ input`` of micro-batch ``mb``
        at stage ``s``, from the inputs and output grads stashed by ``I``; no graph walk, no
        collective."""
        self._w_queues.pop((mb, s)).run()

    def _release(self, mb, s, outputs, grads_out) -> None:
        outputs.pop((mb, s), None)
        grads_out.pop((mb, s), None)
        self._aux.pop((mb, s), None)


class _Once:
    """A work handle waited for at most once: gloo counts completions, so a second ``wait`` on
    a finished receive would block for the next one."""

    __slots__ = ("work", "done")

    def __init__(self, work):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def completed(self) -> bool:
        """Whether the operation has finished, without waiting (NCCL polls its CUDA event)."""
        return self.done or self.work.is_completed()


def _wait(handles: list[_Once]) -> None:
    for handle in handles:
        handle.wait()


def _arrived(entry: tuple[torch.Tensor, list]) -> torch.Tensor:
    """The received tensor, once its receive has completed."""
    buf, handles = entry
    _wait(handles)
    return buf


def grads_in_memory(grads_in: dict, mb: int, next_stage: int) -> torch.Tensor:
    """Gradient w.r.t. the input of ``next_stage`` computed on this same rank (taken: the
    consumer is its only reader)."""
    grad = grads_in.pop((mb, next_stage), None)
    if grad is None:
        raise RuntimeError(f"gradient of micro-batch {mb} at stage {next_stage} is not ready; "
                           f"the schedule ran a backward before its successor's")
    return grad



def executor_for(model: torch.nn.Module, config, mesh, dtype: torch.dtype
                 ) -> PipelineExecutor | None:
    """This rank's executor for ``model`` as :func:`~meshtrain.parallel.parallelize` split it
    into pipeline stages (None when it did not): messages shaped ``[micro-batch, sequence
    (/ tp under sequence parallelism), dim]``, through shared memory between the ranks of one
    host on CPU (``parallel.pp_shared_memory``)."""
    from meshtrain.config.layout_rules import batch_readers
    from meshtrain.parallel.apply import pipeline_stages

    stages = pipeline_stages(model)
    if stages is None:
        return None
    schedule, chunks = stages
    train, par = config.train, config.parallel
    micro = train.global_batch // (batch_readers(mesh.dp, mesh.replicas) * par.microbatches)
    seq = train.seq_len // mesh.cp // (mesh.tp if par.sequence_parallel else 1)
    comm = mesh.comm("pp")
    connect_transport(comm, par.pp_shared_memory and mesh.device.type == "cpu", mesh.timeout_s)
    return PipelineExecutor(schedule, chunks, comm, mesh.pp_rank, (micro, seq, config.model.dim),
                            dtype, mesh.device)
