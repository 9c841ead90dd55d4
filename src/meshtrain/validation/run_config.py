"""Checks that refuse an impossible configuration before any worker process starts.

Every check raises :class:`~meshtrain.config.ConfigError` with a message that names the key, the
value given and what would be valid, so the CLI can print it and exit with status 2.
"""

from __future__ import annotations

import math
from pathlib import Path

from meshtrain.config import (
    DEVICES,
    GRAD_REDUCE_DTYPES,
    LR_SCHEDULES,
    NONFINITE_POLICIES,
    PRECISIONS,
    Config,
    ConfigError,
)
from meshtrain.config.layout import ACTIVATION_CHECKPOINTING_KINDS, PP_SCHEDULES
from meshtrain.config.layout_rules import (
    ALL_REDUCE_OUTER_DTYPES,
    at_least,
    check_context_parallel,
    check_expert_degree,
    check_global_batch,
    check_replica_groups_needed,
    check_replica_keys,
    check_sequence_parallel,
    check_tensor_parallel,
    check_world_size,
    check_zero_stage,
    choice,
    dp_for_world,
    model_parallel_size,
)
from meshtrain.config.sections import OUTER_AGGREGATES
from meshtrain.validation.data_format import validate_data_format
from meshtrain.validation.model import validate_model
from meshtrain.validation.offload import validate_offload
from meshtrain.validation.reporting import validate_reporting

MAX_PIPELINE_WORK = 1_000_000  # pp x microbatches x virtual_stages: beyond it, refuse, not hang


def resolve_world(config: Config, nproc: int | None) -> int:
    """Fill in ``parallel.dp`` when it is 0 (auto) and return the world size.

    With ``nproc`` given, dp = nproc / (replicas × cp × tp × pp); without it, the world is
    replicas × dp × cp × tp × pp.
    """
    par = config.parallel
    for key in ("tp", "pp", "ep", "cp"):
        at_least(getattr(par, key), 1, f"parallel.{key}")
    at_least(par.dp, 0, "parallel.dp")
    at_least(par.replicas, 1, "parallel.replicas")
    # Fault-tolerant replica groups are jobs of their own: this world is one group's.
    groups = 1 if par.replica_fault_tolerance else par.replicas
    degrees = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "replicas": groups}
    if nproc is None:
        par.dp = par.dp or 1
        return par.dp * model_parallel_size(**degrees)
    at_least(nproc, 1, "--nproc")
    if par.dp == 0:
        par.dp = dp_for_world(nproc, **degrees)
    check_world_size(nproc, dp=par.dp, **degrees)
    return nproc


def validate_replicas(config: Config) -> None:
    """DiLoCo replica groups (``parallel.replicas``) and their outer optimizer."""
    par, train = config.parallel, config.train
    check_replica_keys(replicas=par.replicas, sync_every=par.sync_every,
                       sync_fragments=par.sync_fragments, outer_grad_dtype=par.outer_grad_dtype,
                       sync_overlap=par.sync_overlap, n_layers=config.model.n_layers)
    check_replica_groups_needed(par.replicas, par.sync_fragments, par.sync_overlap)
    validate_sync_overlap(config)
    if train.outer_lr <= 0:
        raise ConfigError(f"train.outer_lr = {train.outer_lr} must be positive (DiLoCo's "
                          "default 0.7; 1.0 with outer_momentum = 0 averages the groups).")
    if not 0 <= train.outer_momentum < 1:
        raise ConfigError(f"train.outer_momentum = {train.outer_momentum} must be in [0, 1) "
                          "(DiLoCo's default 0.9; 0 = plain outer SGD).")
    validate_outer_aggregate(config)
    if par.replica_fault_tolerance:
        validate_replica_fault_tolerance(config)
    if par.replicas == 1:
        return
    if par.auto:
        raise ConfigError("parallel.auto does not plan replica groups yet; with "
                          f"parallel.replicas = {par.replicas} the valid setting is "
                          "parallel.auto = false and an inner layout (dp, tp, pp, ...) of your "
                          "own, or use parallel.replicas = 1.")
    if par.ep_rebalance_every:
        raise ConfigError("parallel.ep_rebalance_every re-places experts per group, so the "
                          "groups' expert layouts would differ and their pseudo-gradients no "
                          "longer line up; with parallel.replicas > 1 the valid value is 0.")
    if par.check_replicas_every:
        raise ConfigError("parallel.check_replicas_every checks dp replicas within a group; "
                          "with parallel.replicas > 1 the groups differ between syncs by design, "
                          "so the valid value is 0.")


def validate_outer_aggregate(config: Config) -> None:
    """``parallel.outer_aggregate`` and ``parallel.outer_max_norm_ratio``."""
    par = config.parallel
    if par.outer_aggregate:
        choice(par.outer_aggregate, OUTER_AGGREGATES, "parallel.outer_aggregate")
    if par.outer_aggregate == "trimmed-mean" and par.replicas < 3:
        raise ConfigError(f'parallel.outer_aggregate = "trimmed-mean" drops each coordinate\'s '
                          f"largest and smallest value, which needs at least 3 groups, not "
                          f"parallel.replicas = {par.replicas}; valid here: clipped-mean, "
                          "median, mean.")
    if not (math.isfinite(par.outer_max_norm_ratio) and par.outer_max_norm_ratio > 1):
        raise ConfigError(f"parallel.outer_max_norm_ratio = {par.outer_max_norm_ratio} must be "
                          "a finite number above 1 (default 10: a group whose pseudo-gradient "
                          "norm is over 10 × the median of the groups' is left out).")


def validate_sync_overlap(config: Config) -> None:
    """``train.outer_mix``, and ``parallel.sync_overlap`` (τ) with fault tolerance (its range
    and dtypes: :func:`~meshtrain.config.layout_rules.check_replica_keys`)."""
    par, train = config.parallel, config.train
    if not 0 <= train.outer_mix < 1:
        raise ConfigError(f"train.outer_mix = {train.outer_mix} must be in [0, 1): the share of "
                          "a group's own weights in the merge after a delayed outer step "
                          "(Streaming DiLoCo uses 0.5; 0 = take the outer result).")
    if par.sync_overlap and par.replica_fault_tolerance:
        raise ConfigError("parallel.sync_overlap > 0 is not combined with "
                          "parallel.replica_fault_tolerance (torchft's quorum is taken at the "
                          "sync itself); valid with fault tolerance: 0.")


def validate_replica_fault_tolerance(config: Config) -> None:
    """``parallel.replica_fault_tolerance``: one group per launch, joined through torchft."""
    import importlib.util
    import os

    par = config.parallel
    if par.replicas < 2:
        raise ConfigError(f"parallel.replica_fault_tolerance = true needs parallel.replicas >= 2 "
                          f"(the groups that survive each other), not {par.replicas}; set "
                          "parallel.replicas to the number of groups, or turn it off.")
    if not 0 <= par.replica_group < par.replicas:
        raise ConfigError(f"parallel.replica_group = {par.replica_group} is not a group of "
                          f"parallel.replicas = {par.replicas}; valid: 0 to {par.replicas - 1} "
                          "(one launch per group).")
    if par.outer_grad_dtype not in ALL_REDUCE_OUTER_DTYPES:
        raise ConfigError(f"parallel.outer_grad_dtype = {par.outer_grad_dtype} is exchanged in "
                          "two steps (all-to-all, all-gather) that torchft's fault-tolerant "
                          "all-reduce does not offer; with parallel.replica_fault_tolerance the "
                          "valid values are fp32 and bf16.")
    if not (par.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError("parallel.replica_fault_tolerance = true needs the torchft "
                          "lighthouse's address: set parallel.lighthouse = \"HOST:PORT\" "
                          "(as `meshtrain lighthouse` prints it) or TORCHFT_LIGHTHOUSE.")
    if par.quorum_timeout_s <= 0:
        raise ConfigError(f"parallel.quorum_timeout_s = {par.quorum_timeout_s} must be positive "
                          "(seconds to wait for the other groups at a sync; default 600).")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("parallel.replica_fault_tolerance = true needs torchft, which is not "
                          "installed: pip install 'meshtrain[ft]' (or pip install torchft).")
    from meshtrain.validation.network import validate_network_exposure

    validate_network_exposure(config)


def validate_parallel(config: Config) -> None:
    """Degrees that this version can run and that divide the batch."""
    par, train = config.parallel, config.train
    choice(par.pp_schedule, PP_SCHEDULES, "parallel.pp_schedule")
    choice(par.activation_checkpointing, ACTIVATION_CHECKPOINTING_KINDS,
            "parallel.activation_checkpointing")
    check_zero_stage(par.zero)
    at_least(par.virtual_stages, 1, "parallel.virtual_stages")
    at_least(par.microbatches, 1, "parallel.microbatches")
    if par.dp_bucket_mb <= 0:
        raise ConfigError(f"parallel.dp_bucket_mb = {par.dp_bucket_mb} must be positive.")
    if isinstance(par.zero3_prefetch, bool) or not isinstance(par.zero3_prefetch, int) \
            or par.zero3_prefetch < 0:
        raise ConfigError(f"parallel.zero3_prefetch = {par.zero3_prefetch!r} must be a whole "
                          "number of units, 0 or more (1: the next unit, the default).")
    choice(par.grad_reduce_dtype, GRAD_REDUCE_DTYPES, "parallel.grad_reduce_dtype")
    if par.grad_reduce_dtype == "bf16" and train.precision != "bf16":
        raise ConfigError("parallel.grad_reduce_dtype = bf16 needs train.precision = bf16 (fp32 "
                          "parameters keep fp32 gradients); valid here: fp32.")
    at_least(par.ep_rebalance_every, 0, "parallel.ep_rebalance_every")
    if par.ep_rebalance_every > 0 and par.ep <= 1:
        raise ConfigError(
            f"parallel.ep_rebalance_every = {par.ep_rebalance_every} needs parallel.ep > 1: it "
            f"moves experts between expert-parallel ranks. Set parallel.ep > 1 (an MoE model), "
            f"or parallel.ep_rebalance_every = 0."
        )
    validate_offload(config)
    check_sequence_parallel(par.sequence_parallel, par.tp)
    dp = max(par.dp, 1)
    # first: it bounds microbatches for the schedule below
    check_global_batch(train.global_batch, dp, par.microbatches, max(par.replicas, 1))
    if par.tp > 1:
        validate_tensor_parallel(config)
    validate_pipeline(config)
    if par.ep > 1:
        validate_expert_parallel(config, dp)
    if par.cp > 1:
        validate_context_parallel(config)


def validate_context_parallel(config: Config) -> None:
    """cp splits every sequence into 2 × cp chunks (each rank one early and one late chunk)
    (:func:`~meshtrain.config.layout_rules.check_context_parallel`)."""
    par = config.parallel
    check_context_parallel(config.train.seq_len, par.cp,
                           par.tp if par.sequence_parallel else 1, config.model)


def validate_expert_parallel(config: Config, dp: int) -> None:
    """ep splits the experts of an MoE model over groups of a stage's dp × tp ranks
    (:func:`~meshtrain.config.layout_rules.check_expert_degree`)."""
    check_expert_degree(config.parallel.ep, dp, config.parallel.tp, config.model.moe_experts)


def tp_shape(config: Config) -> dict[str, int | None]:
    """What ``parallel.tp`` must split in this run (the keywords of
    :func:`~meshtrain.config.layout_rules.tp_problems`): the model's shape, its (padded)
    vocabulary, and the sequence under sequence parallelism."""
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    m = config.model
    return {"n_heads": m.n_heads, "kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim,
            "vocab": m.vocab_size or tokenizer_vocab_size(config.data.tokenizer),
            "seq_len": config.train.seq_len if config.parallel.sequence_parallel else None}


def validate_tensor_parallel(config: Config) -> None:
    """tp must split heads, MLP width and vocabulary evenly; kv heads split or replicated
    (:func:`~meshtrain.config.layout_rules.check_tensor_parallel`)."""
    check_tensor_parallel(config.parallel.tp, **tp_shape(config))


def validate_pipeline(config: Config) -> None:
    """The schedule exists for (pp, microbatches, virtual_stages) and the layers split."""
    from meshtrain.data.tokenizer import tokenizer_vocab_size
    from meshtrain.parallel.pipeline import build_schedule
    from meshtrain.parallel.pipeline.stage_split import stage_layers

    par, m = config.parallel, config.model
    if par.pp == 1:
        # One stage runs no schedule: check only the name/chunk combination, cheaply (the
        # action lists grow with microbatches x virtual_stages).
        build_schedule(par.pp_schedule, 1, 1, min(par.virtual_stages, 3))
        if par.pp_split:
            raise ConfigError("parallel.pp_split is set but parallel.pp = 1; remove it or set pp.")
        return
    actions = par.pp * par.microbatches * par.virtual_stages
    if actions > MAX_PIPELINE_WORK:
        raise ConfigError(
            f"parallel.pp × microbatches × virtual_stages = {par.pp} × {par.microbatches} × "
            f"{par.virtual_stages} = {actions} is far more pipeline work items than any schedule "
            f"needs (at most {MAX_PIPELINE_WORK}); use fewer micro-batches or virtual stages.")
    schedule = build_schedule(par.pp_schedule, par.pp, par.microbatches, par.virtual_stages)
    vocab = m.vocab_size or tokenizer_vocab_size(config.data.tokenizer)
    stage_layers(m, vocab, schedule.num_stages, par.pp_split)


def validate_train(config: Config) -> None:
    """Optimiser, schedule, precision and device settings."""
    t = config.train
    at_least(t.steps, 1, "train.steps")
    at_least(t.global_batch, 1, "train.global_batch")
    at_least(t.seq_len, 1, "train.seq_len")
    if t.lr <= 0:
        raise ConfigError(f"train.lr = {t.lr} must be positive.")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} must lie between 0 and train.lr = {t.lr}.")
    choice(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    at_least(t.warmup_steps, 0, "train.warmup_steps")
    if not 0 < t.decay_fraction <= 1:
        raise ConfigError(f"train.decay_fraction = {t.decay_fraction} must be in (0, 1].")
    at_least(t.weight_decay, 0.0, "train.weight_decay")
    at_least(t.grad_clip, 0.0, "train.grad_clip")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key} = {getattr(t, key)} must be in [0, 1).")
    if t.adam_eps <= 0:
        raise ConfigError(f"train.adam_eps = {t.adam_eps} must be positive.")
    choice(t.precision, PRECISIONS, "train.precision")
    choice(t.device, DEVICES, "train.device")
    at_least(t.log_every, 1, "train.log_every")
    at_least(t.peak_tflops, 0.0, "train.peak_tflops")
    at_least(t.threads_per_worker, 0, "train.threads_per_worker")
    if not 0 < t.collective_timeout_s < 1e7:
        raise ConfigError(f"train.collective_timeout_s = {t.collective_timeout_s} must be a "
                          f"positive number of seconds (default 300).")
    choice(t.on_nonfinite, NONFINITE_POLICIES, "train.on_nonfinite")
    at_least(t.max_nonfinite_skips, 1, "train.max_nonfinite_skips")
    at_least(t.max_restarts, 0, "train.max_restarts")
    if t.straggler_factor != 0 and not 1 < t.straggler_factor < 1e6:
        raise ConfigError(f"train.straggler_factor = {t.straggler_factor} must be above 1 (a rank "
                          f"this many times slower than the others' median is warned about, "
                          f"e.g. 1.5, the default), or 0 for no warning.")
    at_least(t.straggler_steps, 1, "train.straggler_steps")
    at_least(t.eval_every, 0, "train.eval_every")
    at_least(t.eval_batches, 1, "train.eval_batches")
    if t.eval_every and not (config.data.valid_source or config.data.valid_fraction):
        raise ConfigError(f"train.eval_every = {t.eval_every} needs held-out data: set "
                          "data.valid_source (a file, directory, glob or prepared corpus) or "
                          "data.valid_fraction (e.g. 0.01), or train.eval_every = 0.")
    if t.compile:
        _check_compile(config)
    if t.energy_schedule and config.parallel.pp < 2:
        raise ConfigError("train.energy_schedule = true needs a pipeline (parallel.pp > 1): "
                          "without one every rank is on the critical path and no clock can be "
                          "lowered. Set parallel.pp > 1 or train.energy_schedule = false.")
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError('train.device = "cuda" but no CUDA device is visible; use "auto" '
                              'or "cpu".')
    if t.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("train.tensorboard = true needs the tensorboard package "
                              "(pip install tensorboard).") from None


def _check_compile(config: Config) -> None:
    """``train.compile`` covers every axis; not ``selective`` checkpointing
    (meshtrain.parallel.compile)."""
    if config.parallel.activation_checkpointing == "selective":
        raise ConfigError('train.compile = true does not combine with '
                          'parallel.activation_checkpointing = "selective" (checkpointed '
                          'submodules inside a compiled block); valid: "none", "full". Set '
                          "train.compile = false or change the checkpointing.")


def validate_data_and_checkpoint(config: Config) -> None:
    """Paths that must exist, and checkpoint cadence."""
    d, c = config.data, config.checkpoint
    if d.source != "builtin":
        from meshtrain.data.readers import find_source_files

        find_source_files(d.source)  # raises ConfigError when nothing matches
    if d.tokenizer != "bytes" and not Path(d.tokenizer).is_file():
        raise ConfigError(f'data.tokenizer = "{d.tokenizer}": no such file; use "bytes" or the '
                          f"path of a Hugging Face tokenizer.json.")
    at_least(d.max_bytes, 1, "data.max_bytes")
    if d.sources:
        if d.source != "builtin":
            raise ConfigError(f'data.sources (a mixture) and data.source = "{d.source}" are both '
                              "set; give one: clear data.source or data.sources.")
        from meshtrain.data.readers import find_source_files

        for item in d.sources:
            if not item["weight"] > 0:
                raise ConfigError(f'data.sources: "{item["path"]}" has weight {item["weight"]}; '
                                  "weights must be positive (they are normalised to sum to 1).")
            if item["path"] != "builtin" and not (
                    Path(item["path"]).expanduser() / "meta.json").is_file():
                find_source_files(item["path"])  # raises ConfigError when nothing matches
    if d.replica_sources:
        validate_replica_sources(config)
    if not 0 <= d.valid_fraction < 1:
        raise ConfigError(f"data.valid_fraction = {d.valid_fraction} must be in [0, 1) (the "
                          "fraction of the training tokens held out, e.g. 0.01).")
    if d.valid_fraction and d.valid_source:
        raise ConfigError("data.valid_source and data.valid_fraction are both set; held-out data "
                          "comes from one of them: clear one.")
    if d.valid_source:
        from meshtrain.data.readers import find_source_files

        if not (Path(d.valid_source).expanduser() / "meta.json").is_file():
            find_source_files(d.valid_source)  # raises ConfigError when nothing matches
    at_least(c.every, 0, "checkpoint.every")
    at_least(c.keep, 1, "checkpoint.keep")
    if c.init_from and not Path(c.init_from).exists():
        raise ConfigError(f'checkpoint.init_from = "{c.init_from}": no such directory; give a '
                          f"meshtrain weights dir (e.g. RUN_DIR/final) or a Hugging Face model "
                          f"dir.")
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f'checkpoint.resume = "{c.resume}": no such checkpoint; use "auto", '
                          f'"none" or an existing checkpoint path.')


def validate_replica_sources(config: Config) -> None:
    """``data.replica_sources``: one existing source per replica group, nothing it replaces."""
    d, replicas = config.data, config.parallel.replicas
    given = len(d.replica_sources)
    if given != replicas:
        raise ConfigError(f"data.replica_sources has {given} source(s) but parallel.replicas = "
                          f"{replicas}; give one source per replica group ({replicas}), or none "
                          "to let the groups share data.source.")
    if d.sources or d.source != "builtin":
        raise ConfigError("data.replica_sources replaces data.source and data.sources (each group "
                          "reads its own); clear data.source and data.sources.")
    from meshtrain.data.readers import find_source_files
    from meshtrain.validation.preflight import replica_groups_here

    for path in (d.replica_sources[g] for g in replica_groups_here(config)):  # this site's only
        if path != "builtin" and not (Path(path).expanduser() / "meta.json").is_file():
            find_source_files(path)  # raises ConfigError when nothing matches


def validate_config(config: Config, world_size: int | None = None) -> int:
    """Run every check; fills ``parallel.dp`` when auto and returns the world size."""
    world = resolve_world(config, world_size)
    validate_train(config)
    validate_reporting(config)  # trackers, train.eval_tasks
    validate_data_and_checkpoint(config)
    validate_data_format(config)  # data.format, data.train_on, data.chat_template
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    validate_model(config, tokenizer_vocab_size(config.data.tokenizer))
    validate_parallel(config)
    validate_replicas(config)
    return world
