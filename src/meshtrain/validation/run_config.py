"""Checks that refuse an impossible configuration before any worker process starts.

Every check raises :class:`~meshtrain.config.ConfigError` with a message that names the key, the
value given and what would be valid, so the CLI can print it and exit with status 2.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.config import (
    DEVICES,
    GRAD_REDUCE_DTYPES,
    LR_SCHEDULES,
    NONFINITE_POLICIES,
    OUTER_GRAD_DTYPES,
    PRECISIONS,
    Config,
    ConfigError,
)
from meshtrain.config.layout import ACTIVATION_CHECKPOINTING_KINDS, PP_SCHEDULES
from meshtrain.validation.model import (
    at_least,
    choice,
    divisors,
    validate_model,
)

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
    model_parallel = groups * par.cp * par.tp * par.pp
    shown = [("replicas", groups), ("cp", par.cp)]
    shown = [(k, v) for k, v in shown if v > 1] + [("tp", par.tp), ("pp", par.pp)]
    names = " × ".join(k for k, _ in shown)
    values = " × ".join(str(v) for _, v in shown)
    if nproc is None:
        par.dp = par.dp or 1
        return par.dp * model_parallel
    at_least(nproc, 1, "--nproc")
    if par.dp == 0:
        if nproc % model_parallel:
            raise ConfigError(
                f"--nproc {nproc} is not a multiple of {names} = {values} = "
                f"{model_parallel}; valid process counts are multiples of {model_parallel}."
            )
        par.dp = nproc // model_parallel
    if par.dp * model_parallel != nproc:
        raise ConfigError(
            f"dp × {names} = {par.dp} × {values} = {par.dp * model_parallel} does not "
            f"equal --nproc {nproc}; set --nproc {par.dp * model_parallel}, or leave parallel.dp "
            f"at 0 to fill the remaining processes with data parallelism."
        )
    return nproc


def validate_replicas(config: Config) -> None:
    """DiLoCo replica groups (``parallel.replicas``) and their outer optimizer."""
    par, train = config.parallel, config.train
    at_least(par.replicas, 1, "parallel.replicas")
    at_least(par.sync_every, 1, "parallel.sync_every")
    choice(par.outer_grad_dtype, OUTER_GRAD_DTYPES, "parallel.outer_grad_dtype")
    at_least(par.sync_fragments, 1, "parallel.sync_fragments")
    most = min(par.sync_every, config.model.n_layers)
    if par.sync_fragments > most:
        raise ConfigError(
            f"parallel.sync_fragments = {par.sync_fragments} is more than parallel.sync_every = "
            f"{par.sync_every} or model.n_layers = {config.model.n_layers} allow: each fragment "
            f"is whole blocks and ends its rounds at its own inner step; valid: 1 to {most}.")
    if par.sync_fragments > 1 and par.replicas == 1:
        raise ConfigError("parallel.sync_fragments > 1 needs parallel.replicas > 1 (fragments "
                          "are synchronised between replica groups); valid here: 1.")
    validate_sync_overlap(config)
    if train.outer_lr <= 0:
        raise ConfigError(f"train.outer_lr = {train.outer_lr} must be positive (DiLoCo's "
                          "default 0.7; 1.0 with outer_momentum = 0 averages the groups).")
    if not 0 <= train.outer_momentum < 1:
        raise ConfigError(f"train.outer_momentum = {train.outer_momentum} must be in [0, 1) "
                          "(DiLoCo's default 0.9; 0 = plain outer SGD).")
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


def validate_sync_overlap(config: Config) -> None:
    """``parallel.sync_overlap`` (τ) and ``train.outer_mix``."""
    par, train = config.parallel, config.train
    at_least(par.sync_overlap, 0, "parallel.sync_overlap")
    if not 0 <= train.outer_mix < 1:
        raise ConfigError(f"train.outer_mix = {train.outer_mix} must be in [0, 1): the share of "
                          "a group's own weights in the merge after a delayed outer step "
                          "(Streaming DiLoCo uses 0.5; 0 = take the outer result).")
    if not par.sync_overlap:
        return
    if par.replicas == 1:
        raise ConfigError("parallel.sync_overlap > 0 needs parallel.replicas > 1 (it overlaps "
                          "the exchange between replica groups); valid here: 0.")
    if par.sync_overlap >= par.sync_every:
        raise ConfigError(f"parallel.sync_overlap = {par.sync_overlap} must be below "
                          f"parallel.sync_every = {par.sync_every}: a fragment's mean is applied "
                          "before its next round ends; valid: 0 to "
                          f"{par.sync_every - 1}.")
    if par.outer_grad_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"parallel.outer_grad_dtype = {par.outer_grad_dtype} takes two "
                          "dependent exchanges (all-to-all, then all-gather), which do not run "
                          "in the background; with parallel.sync_overlap > 0 the valid values "
                          "are fp32 and bf16.")
    if par.replica_fault_tolerance:
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
    if par.outer_grad_dtype not in ("fp32", "bf16"):
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


def validate_parallel(config: Config) -> None:
    """Degrees that this version can run and that divide the batch."""
    par, train = config.parallel, config.train
    choice(par.pp_schedule, PP_SCHEDULES, "parallel.pp_schedule")
    choice(par.activation_checkpointing, ACTIVATION_CHECKPOINTING_KINDS,
            "parallel.activation_checkpointing")
    if not 0 <= par.zero <= 3:
        raise ConfigError(f"parallel.zero = {par.zero} is not a ZeRO stage; valid: 0, 1, 2, 3.")
    at_least(par.virtual_stages, 1, "parallel.virtual_stages")
    at_least(par.microbatches, 1, "parallel.microbatches")
    if par.dp_bucket_mb <= 0:
        raise ConfigError(f"parallel.dp_bucket_mb = {par.dp_bucket_mb} must be positive.")
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
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tp > 1.")
    dp = max(par.dp, 1)
    # Replica groups read disjoint parts of each global batch, like extra dp ranks.
    readers = dp * max(par.replicas, 1)
    per_step = readers * par.microbatches
    if train.global_batch % per_step:  # first: it bounds microbatches for the schedule below
        valid = [m for m in divisors(train.global_batch // readers)
                 if train.global_batch % readers == 0]
        what = "replicas × dp" if par.replicas > 1 else "dp"
        hint = (f"valid parallel.microbatches for {what}={readers}: {', '.join(map(str, valid))}"
                if valid else f"choose a global_batch that is a multiple of {per_step}")
        raise ConfigError(
            f"train.global_batch = {train.global_batch} is not divisible by {what} × "
            f"microbatches = {readers} × {par.microbatches} = {per_step}; {hint}."
        )
    if par.tp > 1:
        validate_tensor_parallel(config)
    validate_pipeline(config)
    if par.ep > 1:
        validate_expert_parallel(config, dp)
    if par.cp > 1:
        validate_context_parallel(config)


def validate_context_parallel(config: Config) -> None:
    """cp splits every sequence into 2 × cp chunks (each rank one early and one late chunk)."""
    par, train, m = config.parallel, config.train, config.model
    cp, seq = par.cp, train.seq_len
    sp = par.tp if par.sequence_parallel else 1

    def fits(c: int) -> bool:  # 2c equal chunks, and each rank's part splits over tp (SP)
        return seq % (2 * c) == 0 and (seq // c) % sp == 0

    if not fits(cp):
        what = (f"2 × cp = {2 * cp} with each rank's seq_len / cp divisible by tp = {sp} "
                "(sequence parallel)" if sp > 1 else f"2 × cp = {2 * cp}")
        valid = [c for c in range(2, min(seq, 64) + 1) if fits(c)]
        hint = (f"valid cp for seq_len {seq}: {', '.join(map(str, valid))}" if valid
                else f"choose a seq_len that is a multiple of {2 * cp * sp}")
        raise ConfigError(
            f"train.seq_len = {seq} is not divisible by {what}: each context-parallel rank holds "
            f"two of the 2 × cp equal chunks of every sequence; {hint}.")
    chunk = seq // (2 * cp)
    group = m.moe_capacity_group
    if m.moe_experts and m.moe_capacity_factor > 0 and (not group or chunk % group):
        valid = ", ".join(map(str, divisors(chunk)))
        now = f"{group}" if group else "0 = the whole sequence"
        raise ConfigError(
            f"model.moe_capacity_factor = {m.moe_capacity_factor} with parallel.cp = {cp} needs "
            f"routing groups inside one context-parallel chunk of seq_len / (2 × cp) = {chunk} "
            f"tokens (model.moe_capacity_group = {now}); set model.moe_capacity_group to a "
            f"divisor of {chunk}: {valid}, or use "
            f"model.moe_capacity_factor = 0 (dropless) or parallel.cp = 1.")


def valid_expert_degrees(dp: int, tp: int, experts: int) -> list[int]:
    """The ``parallel.ep`` the folded expert layout can place: divisors of ``dp × tp`` that
    divide ``tp`` or are a multiple of it, and divide ``experts``."""
    return [e for e in divisors(dp * tp) if (tp % e == 0 or e % tp == 0) and experts % e == 0]


def validate_expert_parallel(config: Config, dp: int) -> None:
    """ep splits the experts of an MoE model over groups of a stage's dp × tp ranks."""
    par, m = config.parallel, config.model
    tp = par.tp
    if not m.moe_experts:
        raise ConfigError(f"parallel.ep = {par.ep} needs a Mixture-of-Experts model "
                          f"(model.moe_experts > 0); use parallel.ep = 1 for a dense model.")
    valid = ", ".join(map(str, valid_expert_degrees(dp, tp, m.moe_experts)))
    if (dp * tp) % par.ep:
        raise ConfigError(f"parallel.ep = {par.ep} does not divide parallel.dp × parallel.tp = "
                          f"{dp} × {tp} = {dp * tp} (expert parallelism splits the data- and "
                          f"tensor-parallel ranks of a stage); valid ep: {valid}.")
    if tp % par.ep and par.ep % tp:
        raise ConfigError(f"parallel.ep = {par.ep} neither divides parallel.tp = {tp} nor is a "
                          f"multiple of it (an expert group is a slice of one tp group or a run "
                          f"of whole tp groups); valid ep: {valid}.")
    if m.moe_experts % par.ep:
        raise ConfigError(f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep = "
                          f"{par.ep}; every expert-parallel rank must hold the same number of "
                          f"experts. Valid ep: {valid}.")


def tp_problems(config: Config, tp: int) -> list[str]:
    """Why ``tp`` cannot split this model (empty when it can)."""
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    m = config.model
    vocab = m.vocab_size or tokenizer_vocab_size(config.data.tokenizer)
    problems = []
    if m.n_heads % tp:
        problems.append(f"n_heads = {m.n_heads}")
    if m.ffn_dim % tp:
        problems.append(f"ffn_dim = {m.ffn_dim}")
    if vocab % tp:
        problems.append(f"the (padded) vocabulary {vocab} (set model.vocab_size to a multiple "
                        f"of {tp} to pad it)")
    if m.kv_heads % tp and tp % m.kv_heads:
        problems.append(f"n_kv_heads = {m.kv_heads} (must divide tp, or tp must divide it)")
    if config.parallel.sequence_parallel and config.train.seq_len % tp:
        problems.append(f"seq_len = {config.train.seq_len} (sequence parallel)")
    return problems


def validate_tensor_parallel(config: Config) -> None:
    """tp must split heads, MLP width and vocabulary evenly; kv heads split or replicated."""
    tp = config.parallel.tp
    problems = tp_problems(config, tp)
    if problems:
        valid = [t for t in divisors(config.model.n_heads) if not tp_problems(config, t)]
        raise ConfigError(f"parallel.tp = {tp} does not evenly split {'; '.join(problems)}. "
                          f"Valid tp for this model: {', '.join(map(str, valid))}.")


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
        from meshtrain.data.stream import find_source_files

        find_source_files(d.source)  # raises ConfigError when nothing matches
    if d.tokenizer != "bytes" and not Path(d.tokenizer).is_file():
        raise ConfigError(f'data.tokenizer = "{d.tokenizer}": no such file; use "bytes" or the '
                          f"path of a Hugging Face tokenizer.json.")
    at_least(d.max_bytes, 1, "data.max_bytes")
    if d.sources:
        if d.source != "builtin":
            raise ConfigError(f'data.sources (a mixture) and data.source = "{d.source}" are both '
                              "set; give one: clear data.source or data.sources.")
        from meshtrain.data.stream import find_source_files

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
        from meshtrain.data.stream import find_source_files

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
    from meshtrain.data.stream import find_source_files

    for path in d.replica_sources:
        if path != "builtin" and not (Path(path).expanduser() / "meta.json").is_file():
            find_source_files(path)  # raises ConfigError when nothing matches


def validate_config(config: Config, world_size: int | None = None) -> int:
    """Run every check; fills ``parallel.dp`` when auto and returns the world size."""
    world = resolve_world(config, world_size)
    validate_train(config)
    validate_data_and_checkpoint(config)
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    validate_model(config, tokenizer_vocab_size(config.data.tokenizer))
    validate_parallel(config)
    validate_replicas(config)
    return world
