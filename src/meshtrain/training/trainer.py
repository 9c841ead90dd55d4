"""The training loop: build the parallel model, then step, log and save.

One :class:`Trainer` serves every layout. It never branches on a parallel axis's name or on a
pipeline schedule: what differs between layouts lives behind ``parallelize`` and the mesh's
counted collectives.

Loss normalisation: each micro-batch's summed token cross-entropy is divided by the number of
target tokens in the **global** batch (all data-parallel ranks, all micro-batches), counted before
any forward; tokens a loss mask leaves out (chat data, ``data.train_on``) are not targets.
Gradients summed over micro-batches and data-parallel ranks are therefore exactly the gradient of
the global mean loss, whatever the layout or micro-batching. With DiLoCo replica
groups (``parallel.replicas > 1``, :mod:`meshtrain.training.diloco.outer`) each group is such a job
on its own part of every global batch, and its outer step averages the groups every round.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from meshtrain import faults
from meshtrain.config import Config
from meshtrain.data.packing import IGNORE_INDEX
from meshtrain.data.prefetch import BatchPrefetcher
from meshtrain.data.tokenizer import load_tokenizer
from meshtrain.data.train_data import trainer_data
from meshtrain.errors import NonFiniteError
from meshtrain.model import flops_per_token, meta_model, moe_layers
from meshtrain.parallel import (
    ParallelPlan,
    data_parallel_engine,
    parallelize,
    timing,
)
from meshtrain.parallel.data.checks import check_replicas_in_sync, reduction_summary
from meshtrain.parallel.expert.placement import ExpertPlacer
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.pipeline.executor import executor_for
from meshtrain.parallel.pipeline.shared_memory_p2p import transport_summary
from meshtrain.parallel.tensor.loss import vocab_parallel_cross_entropy
from meshtrain.replan.layout_change import take_change
from meshtrain.replan.monitor import ReplanMonitor
from meshtrain.training import straggler
from meshtrain.training.cross_entropy import token_cross_entropy_sum
from meshtrain.training.diloco.outer import reduce_over_groups
from meshtrain.training.energy import EnergyMeter, summary_line
from meshtrain.training.evaluate import Evaluator
from meshtrain.training.harness.scorer import TaskScorer
from meshtrain.training.lr_schedule import continue_schedule, learning_rate
from meshtrain.training.metrics import (
    MetricsWriter,
    device_peak_flops,
    peak_memory_bytes,
)
from meshtrain.training.moe_balance import GlobalBatchLoads, scaled_aux_loss, stage_aux_loss
from meshtrain.training.moe_stats import MoEStepStats
from meshtrain.training.nonfinite import NonFiniteGuard, first_nonfinite_gradient
from meshtrain.training.optimizer import FlatAdamW
from meshtrain.training.preemption import save_on_signal
from meshtrain.training.sequence_layouts import layout_fn
from meshtrain.training.straggler import StragglerDetector
from meshtrain.training.trackers import open_trackers


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer:
    """Owns the model, optimizer, data position and metrics of one process."""

    def __init__(self, config: Config, mesh: ParallelMesh, with_data: bool = True):
        """``with_data = False`` builds the model state alone (model, engine, optimizer,
        pipeline executor), no training or held-out data: what a dry run needs
        (:mod:`meshtrain.commands.dry_run`)."""
        self.config = config
        self.mesh = mesh
        self.device = mesh.device
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        if config.model.vocab_size == 0:
            config.model.vocab_size = self.tokenizer.vocab_size
        train, par = config.train, config.parallel
        self.document_layout_fn = layout_fn(config, mesh, self.tokenizer)
        self.data = self.batches = None
        if with_data:
            self.data = trainer_data(config, mesh, self.tokenizer)
            self.batches = BatchPrefetcher(self.data, self.device, IGNORE_INDEX)
        self.dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32
        model = meta_model(config.model)  # no rank materialises more than its own piece
        self.plan = ParallelPlan.from_config(config)
        self.model = parallelize(model, mesh, self.plan)
        # First vocabulary id of this rank's logits slice (the head is split like the embedding).
        self.vocab_start = mesh.tp_rank * (config.model.vocab_size // mesh.tp)
        self.pipeline = executor_for(self.model, config, mesh, self.dtype)
        if self.pipeline is not None:
            self.pipeline.aux_loss_fn = self._stage_aux_loss
            self.pipeline.layout_fn = self.document_layout_fn
        self.engine = data_parallel_engine(self.model)
        self.optimizer = FlatAdamW(self.engine, train)
        self.outer = None  # DiLoCo's outer step between replica groups (replicas > 1)
        if mesh.replicas > 1:
            from meshtrain.training.diloco.outer import OuterOptimizer

            self.outer = OuterOptimizer(self.optimizer, mesh, par.sync_every, train.outer_lr,
                                        train.outer_momentum, par.outer_grad_dtype,
                                        par.sync_fragments, par.sync_overlap, train.outer_mix,
                                        par.outer_aggregate, par.outer_max_norm_ratio)
            if mesh.group_alone and with_data:  # groups as jobs of their own (torchft)
                from meshtrain.training.diloco.replica_ft import ReplicaQuorum

                self.outer.quorum = ReplicaQuorum(self)
        self.moe_stats = MoEStepStats(self.model, mesh, config.model)
        self.global_loads = GlobalBatchLoads.build(self)  # moe_balance_scope = "global-batch"
        self.expert_placer = self.evaluator = self.task_scorer = None
        self.ignore_index = IGNORE_INDEX
        if with_data:
            self.expert_placer = ExpertPlacer.build(self.model, self.engine, self.optimizer,
                                                    mesh, config)  # None unless ep > 1
            self.evaluator = Evaluator.build(self)  # None unless train.eval_every
            self.task_scorer = TaskScorer.build(self)  # None unless train.eval_tasks
        self.nonfinite = NonFiniteGuard(train.on_nonfinite, train.max_nonfinite_skips,
                                        verbose=mesh.is_logging_rank)
        self.restarts = faults.restart_attempt()  # torch elastic's restart count (0 = first run)
        self.step = 0
        self.flops_per_token = flops_per_token(config.model, train.seq_len)
        self.peak_flops = device_peak_flops(self.device, train.precision, train.peak_tflops)
        self.run_dir = Path(train.run_dir)
        self.energy = EnergyMeter(self.device, torch.get_num_threads())
        self.energy_total_j = 0.0
        self.stop_signals = None
        """A :class:`~meshtrain.training.preemption.StopSignals` whose first signal stops the run
        after the current step, with a checkpoint (the worker sets it); None = no signal
        handling."""
        self.stop_signal = 0
        """The signal some rank received, as all ranks agreed at the end of the last step."""
        self.preempted: dict | None = None
        """Set when :meth:`fit` stopped on a signal: ``{"step", "signal", "checkpoint"}``."""
        self.lr_anchor: tuple[int, float] | None = None
        """Where a resumed run's longer schedule continues from (training.lr_schedule)."""
        self.stragglers = StragglerDetector(train.straggler_factor, train.straggler_steps,
                                            verbose=mesh.is_logging_rank)
        self.replan = ReplanMonitor.build(config, mesh) if with_data else None
        self.replanned: dict | None = None
        """Set when :meth:`fit` stopped to relaunch at a re-planned layout (``replan_every``)."""

    def layout_of(self, tokens: torch.Tensor):
        """The sequence layout of a micro-batch's input ``tokens`` (None: plain causal)."""
        return None if self.document_layout_fn is None else self.document_layout_fn(tokens)

    def local_targets(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches with the targets of this rank's part of each sequence under context
        parallelism (the model takes whole sequences of tokens and outputs its part)."""
        if self.mesh.cp == 1:
            return microbatches
        from meshtrain.parallel.context import shard_sequence

        cp, rank = self.mesh.cp, self.mesh.cp_rank
        return [(inputs, shard_sequence(targets, cp, rank)) for inputs, targets in microbatches]

    # ------------------------------------------------------------------ one step
    def _global_token_count(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
                            local: int | None = None) -> float:
        if local is None:
            local = sum(int((targets != IGNORE_INDEX).sum()) for _, targets in microbatches)
        count = torch.tensor([float(local)], device=self.device)
        self.mesh.comm("dp").all_reduce(count)
        return float(count.item())

    def _stage_aux_loss(self, chunk) -> torch.Tensor | None:
        """The MoE aux loss of a pipeline stage's layers for the micro-batch it just ran, scaled
        like :meth:`_forward_backward`'s (None without aux-loss balancing)."""
        return stage_aux_loss(self.model, chunk, self.config.model.moe_balance,
                              self.plan.microbatches, self.mesh.dp)

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy: vocab-parallel (never gathering logits) under tp, else a
        chunk of rows at a time in fp32 (:mod:`meshtrain.training.cross_entropy`)."""
        tp = self.mesh.comm("tp")
        if tp.active:
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                self.vocab_start, tp, IGNORE_INDEX).sum()
        return token_cross_entropy_sum(logits.flatten(0, 1), targets.flatten(), IGNORE_INDEX)

    def _loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`token_loss_sum` of a training micro-batch (where tests inject faults)."""
        loss = self.token_loss_sum(logits, targets)
        return faults.corrupt_loss(loss, self.step + 1) if faults.active() else loss

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                          global_tokens: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward one micro-batch, backward its share of the global loss; return (lm, aux)."""
        inputs = inputs.to(self.device)
        logits = self.model(inputs, self.layout_of(inputs))
        # max(.., 1): a global batch with no target (all masked) gives loss and gradients 0
        lm_loss = self._loss_sum(logits, targets.to(self.device)) / max(global_tokens, 1.0)
        objective = lm_loss
        # Each micro-batch's aux loss is normalised like a mean over its own tokens; averaging
        # over every micro-batch of every data-parallel rank (training.moe_balance).
        aux = scaled_aux_loss(moe_layers(self.model), self.plan.microbatches, self.mesh.dp)
        if aux is not None:
            objective = objective + aux
        objective.backward()
        return lm_loss.detach(), None if aux is None else aux.detach()

    def compute_gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
                          local_tokens: int | None = None) -> dict:
        """Forward and backward every micro-batch and reduce the gradients over data-parallel
        ranks. Leaves the gradients of the global mean loss in the engine's gradient buffers
        (or shards); returns the local loss sums and token counts (not reduced over ranks)."""
        global_tokens = self._global_token_count(microbatches, local_tokens)
        microbatches = self.local_targets(microbatches)
        self.moe_stats.start_step()
        if self.global_loads is not None:  # the step's expert loads before any aux loss
            self.global_loads.begin_step(microbatches)
        if self.pipeline is not None:
            return self._compute_gradients_pipelined(microbatches, global_tokens)
        lm_total = torch.zeros((), device=self.device)
        aux_total = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(microbatches):
            self.engine.start_microbatch(is_last=index == len(microbatches) - 1)
            lm_loss, aux = self._forward_backward(inputs, targets, global_tokens)
            self.engine.end_microbatch()
            lm_total += lm_loss
            if aux is not None:
                aux_total += aux
        self.engine.reduce_partial_grads(self.optimizer.shards)
        return {"lm": lm_total, "aux": aux_total, "global_tokens": global_tokens}

    def _compute_gradients_pipelined(self, microbatches, global_tokens: float) -> dict:
        """Run the pipeline schedule; gradients are reduced over dp once it has finished."""
        self.engine.begin_accumulation()
        self.pipeline.record_events = self.config.train.timeline_step == self.step + 1
        lm_total = self.pipeline.run(
            microbatches,
            lambda logits, targets: self._loss_sum(logits, targets) / max(global_tokens, 1.0))
        self.engine.sync_all()
        self.engine.reduce_partial_grads(self.optimizer.shards)
        if self.pipeline.record_events:
            from meshtrain.training.timeline_report import write_measured_timeline

            write_measured_timeline(self.pipeline, self.mesh, self.run_dir)
        return {"lm": lm_total, "aux": self.pipeline.aux_total,
                "global_tokens": global_tokens}

    def train_step(self) -> dict:
        """Run one optimizer step; return its metrics record."""
        if faults.active():
            faults.at_step_start(self.step + 1)
        self.mesh.comm_log.begin_step(self.step + 1)
        start = timing.stamp(self.device)
        batches, local_tokens = self.batches.next_step()
        began, waited = time.perf_counter(), self.mesh.comm_log.wait_s
        result = self.compute_gradients(batches, local_tokens)
        if faults.active():  # an injected straggler: its compute, outside collectives, slowed
            faults.slow_down(self.step + 1, time.perf_counter() - began
                             - (self.mesh.comm_log.wait_s - waited))
        self.batches.prefetch()  # next step's batch: host work and copies overlap this step
        global_tokens = result["global_tokens"]
        grad_norm = self.optimizer.clip_grad_norm(self.config.train.grad_clip)
        memory = self._memory()
        lr = learning_rate(self.step, self.config.train, self.lr_anchor)
        # This rank's joules since the previous step's reduction travel with the loss: summed
        # over pp and dp × cp, times tp (its ranks do the same work): the job's energy.
        losses = torch.stack([result["lm"], result["aux"],
                              result["lm"].new_tensor(self.energy.read())])
        self.mesh.comm("pp").all_reduce(losses)  # the loss lives on the last stage
        self.mesh.comm("dp_cp").all_reduce(losses)  # cp ranks hold parts of every sequence
        if self.outer is not None:  # replica groups: each decides alike below
            losses, grad_norm, global_tokens, tokens_per_group = reduce_over_groups(
                self.mesh, losses, grad_norm, global_tokens)
        energy_j = float(losses[2]) * self.mesh.tp
        self.energy_total_j += energy_j
        # Loss and norm are global (equal on every rank), so every rank decides alike.
        try:
            apply_update = self.nonfinite.check(
                self.step + 1, float(losses[0]), float(losses[1]), float(grad_norm),
                lambda: first_nonfinite_gradient(self.engine, self.optimizer.shards, self.model))
        except NonFiniteError as error:
            # Stopping: the weights are still those of the last good step (the bad update was
            # never applied), so save them first when checkpointing is on. Every rank gets here
            # together (the loss and norm are global), so the collective save is safe.
            if self.config.checkpoint.every:
                self.optimizer.zero_grad()
                path = self.save_checkpoint_path()
                raise NonFiniteError(f"{error} Saved the last good state (step {self.step}) to "
                                     f"{path}.") from None
            raise
        if apply_update:
            self.optimizer.step(lr)
        moe_summary = self.moe_stats.finish_step() if self.moe_stats.active else None
        self.optimizer.zero_grad()
        if self.outer is not None:  # DiLoCo: the rounds that end after this step
            self.outer.end_step(self.step + 1, self.config.train.steps)
        if moe_summary is not None and self.expert_placer is not None:
            # ep-rank loads; every ep_rebalance_every steps re-place experts (gradients are zero)
            self.expert_placer.end_step(moe_summary, self.moe_stats.last_loads, self.step + 1)
        every = self.config.parallel.check_replicas_every
        if every and (self.step + 1) % every == 0:
            check_replicas_in_sync(self.engine)
        elapsed = timing.elapsed(start, timing.stamp(self.device))  # waits for the step's work
        self.step += 1
        # One small all-gather over the world: every rank's compute and wait seconds and the
        # stop signal it received, so that every rank stops after the same step.
        wait_s = min(self.mesh.comm_log.wait_s, elapsed)  # host waits, device step time on CUDA
        received = self.stop_signals.received if self.stop_signals is not None else 0
        table = straggler.exchange(self.mesh, elapsed - wait_s, wait_s, received)
        self.stop_signal = straggler.stop_signal_of(table)
        tokens = int(global_tokens)  # the loss's targets (fewer than processed under a mask)
        processed = self.processed_tokens
        record = {
            "step": self.step,
            "loss": float(losses[0]),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": tokens,
            "tokens_processed": processed,
            "step_time_s": elapsed,
            "tokens_per_s": processed / elapsed,
            "mfu": None,
            "comm_bytes": self.mesh.comm_log.snapshot(),
            "mem": memory,
            "nonfinite_skips": self.nonfinite.total_skipped,
            "restarts": self.restarts,
            "energy_j": energy_j,
            "energy_total_j": self.energy_total_j,
            "energy_source": self.energy.source,
            "compute_s": elapsed - wait_s,
            "wait_s": wait_s,
            "straggler": self.stragglers.observe(self.step, table[:, 0].tolist()),
        }
        if self.peak_flops:
            record["mfu"] = (processed * self.flops_per_token / elapsed
                             / (self.peak_flops * self.mesh.world_size))
        if moe_summary is not None:
            record["moe"] = {"aux_loss": float(losses[1]), **moe_summary}
        if self.outer is not None and self.outer.quorum is not None:  # one job per group
            record.update(replica_group=self.mesh.replica_rank,
                          groups_present=self.outer.quorum.present)
        elif self.outer is not None:
            record["tokens_per_group"] = tokens_per_group
        if self.outer is not None and self.outer.rejected is not None:  # a round ended here
            record["outer_rejected"] = self.outer.rejected
        per_source = self.data.tokens_per_source()
        if per_source is not None:
            record["tokens_per_source"] = per_source
        if self.evaluator is not None and self.evaluator.due(self.step):
            record.update(self.evaluator.evaluate())
        if self.task_scorer is not None and self.task_scorer.due(self.step):
            record.update(self.task_scorer.score())  # harness scores (logging rank)
        return record

    @property
    def processed_tokens(self) -> int:
        """Tokens this job runs through the model per step (its share of the global batch when
        each replica group is a job of its own): the throughput's and MFU's count."""
        train, par = self.config.train, self.config.parallel
        groups = par.replicas if par.replica_fault_tolerance else 1
        return train.seq_len * train.global_batch // groups

    def _memory(self) -> dict:
        """Model states this rank holds (parameters, gradients, optimizer) and its peak."""
        memory = {**self.engine.memory(), "optim_bytes": self.optimizer.state_bytes(),
                  "peak_bytes": peak_memory_bytes(self.device)}
        if self.outer is not None:
            memory["outer_bytes"] = self.outer.state_bytes()
        return memory

    # ------------------------------------------------------------------ the run
    def restore(self) -> None:
        """Resume from ``checkpoint.resume`` if it names a checkpoint, else start from
        ``checkpoint.init_from`` weights if given, else keep the fresh initialisation."""
        from meshtrain.checkpoint import manager, state

        directory = manager.resolve_resume(self.config, warn=self.mesh.is_logging_rank)
        if directory is not None:
            manager.check_compatible(self.config, directory, self.config.model.vocab_size)
            meta = state.load(self, directory)
            self.lr_anchor, note = continue_schedule(
                self.step, self.config.train, meta.get("total_steps"), meta.get("lr_anchor"))
            if self.mesh.is_logging_rank:
                print(f"meshtrain: resumed from {directory} at step {self.step}",
                      file=sys.stderr, flush=True)
                if note and self.step < self.config.train.steps:
                    print(f"meshtrain: {note}", file=sys.stderr, flush=True)
        elif self.config.checkpoint.init_from:
            state.init_from_weights(self, self.config.checkpoint.init_from)

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the current step (every rank takes part)."""
        self.save_checkpoint_path()

    def save_checkpoint_path(self) -> Path:
        """Write a checkpoint of the current step (every rank takes part); return its path."""
        from meshtrain.checkpoint import state

        return state.save(self)

    def fit(self) -> list[dict]:
        """Train to ``train.steps`` (resuming first when asked); rank 0 logs every step and
        saves the final weights; checkpoints every ``checkpoint.every`` steps."""
        train = self.config.train
        self.restore()
        if self.outer is not None and self.outer.quorum is not None:
            self.outer.quorum.join()  # with the other groups; heals when they are ahead
        every = self.config.checkpoint.every
        writer = None
        if train.energy_schedule:
            from meshtrain.training.energy_clocks import install_energy_schedule

            note = install_energy_schedule(self.config, self.device, self.mesh.pp_rank,
                                           self.pipeline)
            if self.mesh.is_logging_rank:
                print(f"meshtrain: train.energy_schedule (rank 0): {note}",
                      file=sys.stderr, flush=True)
        if self.mesh.is_logging_rank:
            writer = MetricsWriter(self.run_dir, train.steps, self.step,
                                   open_trackers(self.config, resuming=self.step > 0))
            self.energy_total_j = writer.resumed_energy_j
            for summary in (reduction_summary(self.engine), transport_summary(
                    self.mesh.comm("pp"), self.config.parallel.pp_shared_memory, self.device)):
                if summary:
                    print(f"meshtrain: {summary}", file=sys.stderr, flush=True)
        history = []
        layout_change = take_change()  # parallel.elastic re-planned this start: on the next line
        self.energy.read()  # the first step's energy starts here, not when the trainer was built
        try:
            while self.step < train.steps:
                record = self.train_step()
                history.append(record)
                replan = self.replan.observe(record) if self.replan is not None else None
                if replan is not None:
                    record["replan"] = replan
                stopping = bool(self.stop_signal) and self.step < train.steps
                if writer is not None and (record["step"] % train.log_every == 0 or stopping
                                           or record["step"] == train.steps or replan):
                    if layout_change is not None:
                        record["layout"], layout_change = layout_change, None
                    writer.log(record)
                saved = None
                if every and (self.step % every == 0 or self.step == train.steps):
                    saved = self.save_checkpoint_path()
                if stopping:  # every rank stops after this step, with a checkpoint of it
                    self.preempted = save_on_signal(self)
                    return history
                if replan is not None and self.replan.relaunch_after(self, replan, saved):
                    return history
            final = self.save_final()
            if writer is not None:  # the trackers record it, and that the run finished
                writer.final_weights(final)
        finally:
            if writer is not None:
                writer.close()
            if self.outer is not None and self.outer.quorum is not None:
                self.outer.quorum.shutdown()
        if writer is not None:
            print(summary_line(self.energy_total_j, self.energy.source, self.mesh.world_size,
                               train.carbon_g_per_kwh, train.price_per_kwh),
                  file=sys.stderr, flush=True)
            if train.energy_schedule:
                from meshtrain.training.energy_clocks import clock_failure

                failure = clock_failure(self.pipeline)
                if failure:
                    print(f"meshtrain: train.energy_schedule (rank 0): {failure}; the run used "
                          "the default clocks", file=sys.stderr, flush=True)
        return history

    def save_final(self) -> Path | None:
        """Write the final weights to ``RUN_DIR/final`` (a collective: every rank takes part):
        the full, unsharded fp32 tensors as sharded safetensors
        (``model-0000i-of-0000K.safetensors`` + ``model.safetensors.index.json``) and
        ``config.json``. Each pipeline stage's writers stream its tensors one at a time, gathered
        over ZeRO-3 / ep / tp, so no rank holds the whole model; the index is written last
        (:mod:`meshtrain.checkpoint.final_weights`). Returns the directory on rank 0, else None."""
        from meshtrain.checkpoint.final_weights import save_final_weights

        return save_final_weights(self.model, self.engine, self.mesh, self.run_dir / "final",
                                  json.dumps(self.config.to_dict(), indent=2), self.step)
