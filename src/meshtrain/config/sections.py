"""The sections of a run's configuration, as typed dataclasses.

A run is described by one :class:`Config` with five sections (``model``, ``parallel``, ``train``,
``data``, ``checkpoint``); each field's type and default is declared here, and
:mod:`meshtrain.config.loading` fills them from a TOML file and ``--set`` overrides.
:func:`meshtrain.validation.run_config.validate_config` refuses impossible values *before* any
worker process starts. Every refusal is a :class:`ConfigError` whose message names the key and the
valid values, which the CLI prints as one paragraph and exits with status 2. The ``[parallel]``
section is a :class:`~meshtrain.config.layout.Layout` with the runtime's options.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config.layout import Layout
from meshtrain.config.model import ModelConfig


class ConfigError(ValueError):
    """A configuration or usage error; the CLI prints its message and exits with status 2."""


LR_SCHEDULES = ("cosine", "constant", "wsd")
PRECISIONS = ("fp32", "bf16")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
OUTER_GRAD_DTYPES = ("fp32", "bf16", "int8", "fp8")
OUTER_AGGREGATES = ("clipped-mean", "trimmed-mean", "median", "mean")
OFFLOAD_KINDS = ("none", "optimizer", "optimizer+params")
OFFLOAD_DEVICES = ("host", "nvme")
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_POLICIES = ("skip", "stop")
DATA_FORMATS = ("text", "chat", "prompt_completion")
TRAIN_ON = ("assistant", "all")


@dataclass
class ParallelConfig(Layout):
    """The ``[parallel]`` section: a :class:`~meshtrain.config.layout.Layout` (degrees of each
    parallel
    axis and how the step is scheduled) and the runtime options that tune it."""

    dp: int = 0
    """Data-parallel degree; 0 = whatever the world size leaves after tp × pp."""
    dp_bucket_mb: float = 25.0
    """Gradient bucket size for data-parallel reduction, in MiB."""
    zero3_prefetch: int = 1
    """ZeRO-3: units gathered ahead of the one running (the next in forward, the previous in
    backward): 0 gathers each unit only when it runs, 1 (default) overlaps the next unit's
    gather with this one's compute, more hold more units at once for a deeper overlap across
    hosts. Each unit ahead costs its full parameters in memory."""
    dp_shared_memory: bool = True
    """Reduce data-parallel gradients (fp32 on CPU, ZeRO stages 0-1) through shared memory
    instead of gloo's loopback TCP when every rank of the group runs on this host; false = always
    the process group's own collectives. See :mod:`meshtrain.parallel.shared_memory`."""
    pp_shared_memory: bool = True
    """Move pipeline activations and gradients between stages (CPU tensors) through shared
    memory instead of gloo's loopback TCP when every rank of the pipeline group runs on this
    host; false = always the process group's point-to-point calls. See
    :mod:`meshtrain.parallel.pipeline.shared_memory_p2p`."""
    grad_reduce_dtype: str = "fp32"
    """dtype gradients are accumulated over micro-batches and reduced over data-parallel ranks
    in: ``fp32`` (default: with bf16 parameters a separate fp32 gradient buffer, as Megatron's
    ``main_grad``) or ``bf16`` (bf16 buffers and reductions; needs ``train.precision = bf16``)."""
    offload: str = "none"
    """Keep this rank's ZeRO shard of model states off the compute device (docs/offload.md):
    ``none``; ``optimizer`` (fp32 masters, Adam moments and, at ZeRO 2-3, the gradient shard;
    ZeRO 1-3) or ``optimizer+params`` (also the parameter shard; ZeRO-3 only). The optimizer
    step runs where the state lives, streamed in chunks of ``offload_chunk_mb``."""
    offload_device: str = "host"
    """Where offloaded state lives: ``host`` (host memory, pinned under CUDA) or ``nvme``
    (memory-mapped files under ``offload_dir``, paged in one chunk at a time)."""
    offload_dir: str = ""
    """Directory of ``offload_device = nvme``'s files (one ``rank<N>`` directory per rank);
    empty = ``RUN_DIR/offload``."""
    offload_chunk_mb: float = 16.0
    """MiB of each fp32 state tensor the offloaded optimizer step (and every pass over
    offloaded state) handles at a time: bounds the resident memory of an nvme step."""
    offload_overlap: bool = False
    """ZeRO-3 with offload: run the optimizer step on a background thread, bucket by bucket
    in the next forward's order, each gather waiting only for its own bucket (the same update,
    bit for bit). Uses a CPU core beside the training thread."""
    check_replicas_every: int = 0
    """Every N steps, check that replicated parameters are identical on all dp ranks; 0 = off."""
    ep_rebalance_every: int = 0
    """Every K steps, re-place hot experts across the ep ranks from the load measured since the
    last time (moving their parameters and optimizer state) so the busiest rank's token count
    falls; 0 = off. Needs ``ep > 1``. See :mod:`meshtrain.parallel.expert.placement`."""
    replicas: int = 1
    """Replica groups (DiLoCo, docs/diloco.md): the outermost mesh dimension; each group runs
    the inner layout above (dp, tp, pp, ep, cp, zero) on its own part of every global batch and
    the groups meet every ``sync_every`` steps. World = replicas × dp × cp × tp × pp."""
    sync_every: int = 1
    """Inner steps per DiLoCo round (H): each group trains this many AdamW steps alone, then the
    groups average their pseudo-gradients and take one outer Nesterov step."""
    sync_fragments: int = 1
    """Streaming DiLoCo: split the blocks into this many fragments that end their rounds at
    staggered inner steps (each still every ``sync_every``), spreading the traffic; 1 = all at
    once."""
    sync_overlap: int = 0
    """Streaming DiLoCo's overlapped communication (τ): a fragment's pseudo-gradient mean is
    sent in the background while its group trains this many more inner steps, and applied
    after them (mixed with the group's own weights by ``train.outer_mix``); 0 = the groups wait
    for the mean at the end of the round. Below ``sync_every``; fp32 or bf16 exchange."""
    outer_grad_dtype: str = "fp32"
    """dtype of the pseudo-gradient exchange between replica groups: ``fp32``, ``bf16`` (half
    the bytes; the sum is taken in bf16), or ``int8`` / ``fp8`` (e4m3; a quarter of fp32's bytes:
    one byte per value and an fp32 scale per 256, the mean taken in fp32 between two exchanges,
    :mod:`meshtrain.training.diloco.quantized_reduce`). The outer step is fp32 in every case."""
    outer_aggregate: str = ""
    """How the replica groups' pseudo-gradients are combined into one outer gradient:
    ``clipped-mean`` (each group's clipped to the median of the groups' norms, then averaged),
    ``trimmed-mean`` (coordinate-wise, without each coordinate's largest and smallest),
    ``median`` (coordinate-wise) or ``mean``; empty = ``clipped-mean`` with 3 or more groups,
    else ``mean``. Before any of them a group whose pseudo-gradient is not finite, or whose
    norm exceeds ``outer_max_norm_ratio`` × the median of the groups' norms, is left out of that
    round (``outer_rejected`` in the metrics; docs/security.md)."""
    outer_max_norm_ratio: float = 10.0
    """A group's pseudo-gradient norm above this many times the median of the groups' norms
    leaves it out of the round (with 3 or more groups; the median of two is their mean)."""
    replica_fault_tolerance: bool = False
    """Each replica group is a job of its own (one ``meshtrain train`` launch per group, its
    world = the inner layout), joined to the others through a torchft lighthouse: a group that
    dies does not stop the others, which average over the groups present, and a restarted group
    heals from a live one's state (docs/diloco.md, "Groups that fail alone"; the ``ft`` extra)."""
    replica_group: int = 0
    """With ``replica_fault_tolerance``: which of the ``replicas`` groups this launch is
    (0 .. replicas - 1): its share of each batch, its ``data.replica_sources`` entry, its id."""
    lighthouse: str = ""
    """With ``replica_fault_tolerance``: the torchft lighthouse's address
    (``HOST:PORT``, or ``http://HOST:PORT`` as ``meshtrain lighthouse`` prints it); empty = the
    ``TORCHFT_LIGHTHOUSE`` environment variable."""
    tls_dir: str = ""
    """This site's directory made by ``meshtrain keys new`` (the run's CA and this site's
    certificate): the link to the lighthouse runs over mutual TLS and heals over HTTPS with
    client certificates, so only parties with a certificate from the run's CA join, see the
    quorum or receive weights; the group's store and torchft manager server, which torchft
    dials directly, listen on ``MESHTRAIN_FT_HOST`` (docs/security.md). Needed, or
    ``insecure_network``, when the groups meet across a network."""
    insecure_network: bool = False
    """Let the control plane of replica groups listen beyond loopback without credentials
    (``tls_dir``): anyone who reaches those ports can join, stall or kill the run. Logged
    loudly; for a trusted network only (docs/security.md)."""
    heal_inner_state: bool = False
    """With ``replica_fault_tolerance``: a restarted group also receives the live group's inner
    AdamW moments and data position when it heals (more bytes to the peer, and what it reveals);
    default: weights and outer state only, the inner moments start again from zero."""
    quorum_timeout_s: float = 600.0
    """With ``replica_fault_tolerance``: longest wait for the other groups at a sync (a
    restarted group waits for the others' next sync to heal from them)."""
    auto: bool = False
    """Let the planner choose dp, tp, pp, zero, microbatches, the schedule, sequence parallelism
    and checkpointing for ``--nproc`` processes (default: GPUs or CPU cores) before launching;
    the choice and why are printed on stderr. See :mod:`meshtrain.replan.auto`."""
    elastic: bool = False
    """Under an elastic launch (torchrun ``--nnodes MIN:MAX``), re-plan the layout when a start's
    world differs from the newest checkpoint's (a node was lost or came back), keeping the global
    batch, and resume from that checkpoint at the new layout. See
    :mod:`meshtrain.replan.elastic`."""
    replan_every: int = 0
    """Re-plan on measurement: after a warm-up step, time this many steps (compute and each
    axis's communication), re-price every layout with those costs and, when one is predicted
    faster by more than ``replan_gain``, checkpoint and relaunch with it; 0 = off. See
    :mod:`meshtrain.replan.on_measurement`."""
    replan_gain: float = 0.10
    """The predicted gain (fraction of the measured step time, in (0, 1)) another layout must
    offer before ``replan_every`` relaunches with it."""
    replan_max: int = 1
    """Relaunches ``replan_every`` may make in one run (counted in the checkpoint directory)."""
    auto_profile: str = ""
    """Hardware profile for ``auto``: a ``meshtrain calibrate`` JSON or a profile name; empty =
    ~/.cache/meshtrain/profile.json if present, else a quick measurement of this machine."""

    def layout(self) -> Layout:
        """The layout this section describes, as a plain :class:`~meshtrain.config.layout.Layout`;
        dp = 0 (auto, before :func:`meshtrain.validation.run_config.resolve_world` fills it) counts
        as 1."""
        return dataclasses.replace(super().layout(), dp=max(self.dp, 1))


@dataclass
class TrainConfig:
    """Optimisation and run-length settings."""

    steps: int = 100
    """Total optimizer steps; a resumed run continues up to this number."""
    global_batch: int = 16
    """Sequences per optimizer step, summed over all data-parallel ranks and micro-batches."""
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    """For ``wsd``: the fraction of steps spent in the final decay."""
    lr_schedule_reset: bool = False
    """Resuming with a larger ``train.steps``: false = the learning rate continues from the rate
    the checkpoint's run had reached and decays over the remaining steps (no second warm-up);
    true = recompute the whole schedule over the new total, as if the run had always been that
    long (the rate jumps at the resumed step)."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    precision: str = "fp32"
    device: str = "auto"
    run_dir: str = "runs/latest"
    log_every: int = 1
    tensorboard: bool = False
    """Write TensorBoard logs to RUN_DIR/tensorboard: the same as ``"tensorboard"`` in
    ``loggers``."""
    loggers: list[str] = field(default_factory=list)
    """Experiment trackers that receive the resolved config, every metrics row (with eval and
    task scores) and the final weights' path, from the logging rank: any of ``"tensorboard"``,
    ``"wandb"`` (offline under RUN_DIR/wandb unless ``WANDB_MODE`` says otherwise) and
    ``"mlflow"`` (``sqlite:///RUN_DIR/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` is set). TOML
    ``["wandb", "mlflow"]`` or ``--set train.loggers=wandb,mlflow``. See
    :mod:`meshtrain.training.trackers`."""
    peak_tflops: float = 0.0
    """Device peak dense TFLOP/s for MFU; 0 = look the device up (unknown devices report null)."""
    timeline_step: int = 0
    """Record every rank's pipeline actions at this step (1-based) and write
    RUN_DIR/timeline.json (Chrome trace) and timeline.png; 0 = off."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker process; 0 = the machine's cores split over the workers."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks (start-up waits at least 60 s).
    When it expires the run exits 1 with one summary naming the rank(s) that did not arrive and
    where every rank waits; each rank's recent collectives are in RUN_DIR/diagnostics/."""
    debug_collectives: bool = False
    """Before every collective, check that all ranks of the group call the same op with the same
    shape and report the first mismatch (one small all-gather per collective: debugging only)."""
    on_nonfinite: str = "skip"
    """A NaN or infinite loss or gradient norm: ``skip`` the optimizer step (and stop after
    max_nonfinite_skips in a row) or ``stop`` the run at once (exit 1)."""
    max_nonfinite_skips: int = 3
    """With on_nonfinite = "skip": stop when this many steps in a row were non-finite."""
    compile: bool = False
    """Compile each transformer block's forward with ``torch.compile`` (every axis; collectives
    and MoE layers stay eager; see :mod:`meshtrain.parallel.compile`). The first step pays the
    compilation."""
    eval_every: int = 0
    """Every N steps (and after the last), measure the held-out loss (``data.valid_source`` or
    ``data.valid_fraction``) and write ``eval_loss``/``eval_ppl`` into that step's record;
    0 = off."""
    eval_batches: int = 4
    """Global batches (``train.global_batch`` sequences each) per evaluation: the same held-out
    sequences every time, so evaluations are comparable."""
    eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks to score during training, as ``meshtrain eval --tasks``
    names them: every ``eval_tasks_every`` steps and after the last, the logging rank scores the
    gathered weights and writes each task's metrics into that step's record under ``tasks``.
    Needs the ``eval`` extra; empty = off. See :mod:`meshtrain.training.harness`."""
    eval_tasks_every: int = 0
    """Score ``eval_tasks`` every N steps and after the last; 0 = after the last step only."""
    eval_tasks_include: str = ""
    """A directory of local task YAMLs that ``eval_tasks`` may name (``--include-path``)."""
    eval_tasks_limit: int = 0
    """Score at most this many documents of each task (``--limit``); 0 = all of them."""
    max_restarts: int = 0
    """Restart every worker up to this many times after a failure; a restarted run resumes from
    the newest valid checkpoint (needs checkpoint.every > 0 to lose little work)."""
    straggler_factor: float = 1.5
    """Warn (rank 0's log) when a rank's compute per step is above this many times the other
    ranks' median for straggler_steps steps in a row; 0 = no warning (docs/reliability.md)."""
    straggler_steps: int = 3
    """Consecutive steps a rank must be above straggler_factor before the warning."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov SGD (``parallel.replicas > 1``): learning rate and momentum on
    the averaged pseudo-gradient (Douillard et al. 2023: 0.7 and 0.9)."""
    outer_mix: float = 0.5
    """With ``parallel.sync_overlap > 0``: a fragment's weights after its delayed outer step
    are ``outer_mix`` × the group's own (trained on meanwhile) + (1 − ``outer_mix``) × the
    outer result (Streaming DiLoCo's merge); 0 = take the outer result. In [0, 1)."""
    carbon_g_per_kwh: float = 0.0
    price_per_kwh: float = 0.0
    """Grid g CO2 per kWh and price per kWh for the run summary's CO2 and cost; 0 = omitted."""
    energy_schedule: bool = False
    """Lock each pipeline rank's GPU clocks to its energy schedule's (docs/energy.md)."""


@dataclass
class DataConfig:
    """Where training text comes from and how it is tokenized."""

    source: str = "builtin"
    """``builtin`` (the interpreter's own standard-library sources) or a path / glob of
    .txt, .jsonl, .parquet or pre-tokenized .bin files (or a directory of them)."""
    tokenizer: str = "bytes"
    """``bytes`` (byte-level, 264 ids) or the path of a Hugging Face ``tokenizer.json``."""
    text_field: str = "text"
    """Field holding the text in .jsonl and .parquet sources."""
    max_bytes: int = 4_000_000
    """Upper bound on the built-in corpus size, so start-up stays fast."""
    sources: list = field(default_factory=list)
    """A weighted mixture instead of ``source``: ``[{path = "...", weight = 0.7}, ...]`` in TOML,
    or ``--set data.sources=PATH:WEIGHT,PATH:WEIGHT``; each path is a file, directory, glob or
    prepared corpus as ``source`` takes. See :mod:`meshtrain.data.mixture`."""
    document_mask: bool = False
    """Attention stays within each document of a packed sample and positions restart at each
    document (block-diagonal causal mask; needs a tokenizer with an eos id). See
    :mod:`meshtrain.model.document_mask`."""
    replica_sources: list[str] = field(default_factory=list)
    """One training source per DiLoCo replica group (``parallel.replicas`` entries, each a path
    as ``source`` takes): group g reads only ``replica_sources[g]``, its share of each step's
    ``train.global_batch`` (global_batch / replicas), so no group's data reaches another. Empty
    = every group reads disjoint parts of ``source``. TOML ``["a/", "b/"]`` or ``--set
    data.replica_sources=a/,b/``."""
    valid_source: str = ""
    """Held-out data for ``train.eval_every``: a file, directory, glob or prepared corpus like
    ``source`` (tokenized the same way); empty = none (see ``valid_fraction``)."""
    valid_fraction: float = 0.0
    """Hold out this fraction of the training source's tokens, at its end and starting at a
    document boundary (as Megatron-LM's contiguous splits): never trained on, evaluated by
    ``train.eval_every``. 0 = nothing held out; not combined with ``valid_source``."""
    format: str = "text"
    """What a document of a raw source is: ``text`` (plain documents, every token trained on),
    ``chat`` (``.jsonl`` rows ``{"messages": [{"role", "content"}, ...]}`` rendered with the
    chat template) or ``prompt_completion`` (``.jsonl`` rows ``{"prompt", "completion"}``).
    A prepared directory keeps the format it was prepared with. See docs/data.md."""
    train_on: str = "assistant"
    """Which tokens of chat / prompt_completion data the loss is taken on: ``assistant`` (the
    assistant turns / the completion; the rest is masked) or ``all``. Text data: every token."""
    chat_template: str = ""
    """The chat template of ``format = "chat"``: a Jinja template string or the path of a file
    holding one; empty = the one beside ``tokenizer`` (its ``chat_template.jinja`` or
    ``tokenizer_config.json``'s ``chat_template``), as Hugging Face renders it."""


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and what to resume from."""

    dir: str = ""
    """Checkpoint directory; empty = RUN_DIR/checkpoints."""
    every: int = 0
    """Save every N steps; 0 = only the final weights."""
    keep: int = 3
    resume: str = "none"
    """``auto`` (newest valid checkpoint in dir), ``none``, or a checkpoint path."""
    init_from: str = ""
    """Start from these weights (a meshtrain weights dir such as RUN_DIR/final, or a Hugging Face
    model dir) at any layout, when there is no checkpoint to resume from."""


@dataclass
class Config:
    """A whole run: the five sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A plain nested dict (TOML/JSON-serialisable)."""
        return dataclasses.asdict(self)


SECTION_NAMES = tuple(f.name for f in dataclasses.fields(Config))
