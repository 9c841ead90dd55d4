"""The rules every parallel layout obeys, each written once.

The validation of a run config (:mod:`meshtrain.validation.run_config`), the process mesh
(:class:`meshtrain.parallel.mesh.ParallelMesh`), the pipeline's schedules and stage split,
elastic re-planning (:mod:`meshtrain.replan.elastic`) and the planner's cost model and search
(:mod:`meshtrain.planner`) all call these functions instead of restating the arithmetic, so that
they accept and refuse the same layouts. Each ``check_*`` function raises
:class:`~meshtrain.config.sections.ConfigError` (a ``ValueError``) with a message that names the
key, the value given and what would be valid; the planner's search uses the boolean forms
(``*_ok`` / ``*_fits``) next to them, built on the same arithmetic.

Plain arithmetic on integers and the model's shape: nothing here imports torch.
"""

from __future__ import annotations

import math

from meshtrain.config.layout import Layout
from meshtrain.config.model import ModelConfig
from meshtrain.config.sections import OUTER_GRAD_DTYPES, ConfigError

ALL_REDUCE_OUTER_DTYPES = ("fp32", "bf16")
"""``parallel.outer_grad_dtype`` values exchanged by one all-reduce between replica groups (int8
and fp8 take two dependent exchanges, an all-to-all and an all-gather): the ones that can run in
the background (``parallel.sync_overlap``) or through torchft."""


# ---------------------------------------------------------------- generic helpers
def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (O(sqrt n): configs may hold huge values)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


def choice(value: str, options: tuple[str, ...], key: str) -> None:
    """Refuse ``key = value`` unless it is one of ``options``."""
    if value not in options:
        raise ConfigError(f'{key} = "{value}" is not valid; choose one of: {", ".join(options)}.')


def at_least(value: float, minimum: float, key: str) -> None:
    """Refuse ``key = value`` below ``minimum``."""
    if value < minimum:
        raise ConfigError(f"{key} = {value} is too small; it must be at least {minimum}.")


def _joined(values: list[int]) -> str:
    return ", ".join(map(str, values))


# ---------------------------------------------------------------- world size
def world_size(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, replicas: int = 1) -> int:
    """Processes a layout needs: replicas × dp × cp × tp × pp (one replica group's share is
    :attr:`Layout.world_size <meshtrain.config.layout.Layout.world_size>`)."""
    return replicas * Layout(dp=dp, tp=tp, pp=pp, cp=cp).world_size


def model_parallel_size(tp: int = 1, pp: int = 1, cp: int = 1, replicas: int = 1) -> int:
    """Processes per data-parallel rank: replicas × cp × tp × pp (the world at dp = 1); a world
    takes this layout when it is a multiple of it."""
    return world_size(1, tp, pp, cp, replicas)


def _degrees_text(tp: int, pp: int, cp: int, replicas: int) -> tuple[str, str]:
    """``("replicas × cp × tp × pp", "2 × 2 × 1 × 1")``: the axes besides dp, replicas and cp
    only when above 1."""
    shown = [(k, v) for k, v in (("replicas", replicas), ("cp", cp)) if v > 1]
    shown += [("tp", tp), ("pp", pp)]
    return " × ".join(k for k, _ in shown), " × ".join(str(v) for _, v in shown)


def dp_for_world(world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, replicas: int = 1,
                 what: str = "--nproc") -> int:
    """The data-parallel degree that fills ``world`` processes (``what``: how the user gave that
    number); :class:`ConfigError` when ``world`` is not a multiple of
    :func:`model_parallel_size`."""
    per_dp = model_parallel_size(tp, pp, cp, replicas)
    if world % per_dp:
        names, values = _degrees_text(tp, pp, cp, replicas)
        raise ConfigError(
            f"{what} {world} is not a multiple of {names} = {values} = {per_dp}; valid process "
            f"counts are multiples of {per_dp}.")
    return world // per_dp


def world_fits(world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, replicas: int = 1) -> bool:
    """Whether some data-parallel degree fills ``world`` processes (:func:`dp_for_world`)."""
    return world % model_parallel_size(tp, pp, cp, replicas) == 0


def check_world_size(world: int, *, dp: int, tp: int = 1, pp: int = 1, cp: int = 1,
                     replicas: int = 1, what: str = "--nproc") -> None:
    """Refuse a layout whose :func:`world_size` is not ``world`` (``what``: how the user gave
    that number)."""
    needed = world_size(dp, tp, pp, cp, replicas)
    if needed != world:
        names, values = _degrees_text(tp, pp, cp, replicas)
        raise ConfigError(
            f"dp × {names} = {dp} × {values} = {needed} does not equal {what} {world}; set "
            f"{what} {needed}, or leave parallel.dp at 0 to fill the remaining processes with "
            f"data parallelism.")


# ---------------------------------------------------------------- batch
def batch_readers(dp: int, replicas: int = 1) -> int:
    """Ranks that read disjoint parts of each global batch: replicas × dp (replica groups read
    theirs like extra data-parallel ranks)."""
    return replicas * dp


def check_global_batch(global_batch: int, dp: int, microbatches: int, replicas: int = 1) -> None:
    """``train.global_batch`` splits evenly over the readers (:func:`batch_readers`) and the
    micro-batches of each."""
    readers = batch_readers(dp, replicas)
    per_step = readers * microbatches
    if global_batch % per_step:
        valid = divisors(global_batch // readers) if global_batch % readers == 0 else []
        what = "replicas × dp" if replicas > 1 else "dp"
        hint = (f"valid parallel.microbatches for {what}={readers}: {_joined(valid)}" if valid
                else f"choose a global_batch that is a multiple of {per_step}")
        raise ConfigError(
            f"train.global_batch = {global_batch} is not divisible by {what} × microbatches = "
            f"{readers} × {microbatches} = {per_step}; {hint}.")


# ---------------------------------------------------------------- ZeRO, sequence parallelism
def check_zero_stage(zero: int) -> None:
    """``parallel.zero`` is a ZeRO stage, 0 to 3."""
    if not 0 <= zero <= 3:
        raise ConfigError(f"parallel.zero = {zero} is not a ZeRO stage; valid: 0, 1, 2, 3.")


def check_sequence_parallel(sequence_parallel: bool, tp: int) -> None:
    """Sequence parallelism splits over the tp ranks, so it needs some."""
    if sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tp > 1.")


# ---------------------------------------------------------------- tensor parallelism
def tp_problems(tp: int, *, n_heads: int, kv_heads: int, ffn_dim: int,
                expert_ffn_dim: int | None = None, vocab: int | None = None,
                seq_len: int | None = None) -> list[str]:
    """Why ``tp`` cannot split a model of this shape (empty when it can): the heads, the MLP
    width (and the experts' ``expert_ffn_dim``) and the vocabulary split evenly; the key/value
    heads split evenly or are replicated (tp a multiple of them); under sequence parallelism
    (``seq_len`` given) the sequence splits too. A size given as None is not checked."""
    problems = []
    if n_heads % tp:
        problems.append(f"n_heads = {n_heads}")
    if ffn_dim % tp:
        problems.append(f"ffn_dim = {ffn_dim}")
    if expert_ffn_dim is not None and expert_ffn_dim % tp:
        problems.append(f"the experts' hidden size {expert_ffn_dim} (model.moe_ffn_dim)")
    if vocab is not None and vocab % tp:
        problems.append(f"the (padded) vocabulary {vocab} (set model.vocab_size to a multiple "
                        f"of {tp} to pad it)")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"n_kv_heads = {kv_heads} (must divide tp, or tp must divide it)")
    if seq_len is not None and seq_len % tp:
        problems.append(f"seq_len = {seq_len} (sequence parallel)")
    return problems


def tp_fits(tp: int, **shape: int | None) -> bool:
    """Whether ``tp`` splits a model of this shape (:func:`tp_problems`'s keywords)."""
    return not tp_problems(tp, **shape)


def check_tensor_parallel(tp: int, **shape: int | None) -> None:
    """Refuse a ``parallel.tp`` that cannot split a model of this shape (:func:`tp_problems`'s
    keywords), naming the degrees that can."""
    problems = tp_problems(tp, **shape)
    if problems:
        valid = [t for t in divisors(shape["n_heads"]) if not tp_problems(t, **shape)]
        raise ConfigError(f"parallel.tp = {tp} does not evenly split {'; '.join(problems)}. "
                          f"Valid tp for this model: {_joined(valid)}.")


# ---------------------------------------------------------------- context parallelism
def context_parallel_fits(seq_len: int, cp: int, sp: int = 1) -> bool:
    """Whether ``cp`` ranks split every sequence into 2 × cp equal chunks (each rank one early
    and one late chunk), each rank's part also splitting over ``sp`` (tp under sequence
    parallelism, else 1)."""
    return seq_len % (2 * cp) == 0 and (seq_len // cp) % sp == 0


def check_context_parallel(seq_len: int, cp: int, sp: int = 1,
                           model: ModelConfig | None = None) -> None:
    """Refuse a ``parallel.cp`` that cannot split ``seq_len`` (:func:`context_parallel_fits`),
    or, for an MoE ``model`` with capacity, whose chunks do not hold whole routing groups.
    ``cp = 1`` splits nothing and always passes."""
    if cp <= 1:
        return
    if not context_parallel_fits(seq_len, cp, sp):
        what = (f"2 × cp = {2 * cp} with each rank's seq_len / cp divisible by tp = {sp} "
                "(sequence parallel)" if sp > 1 else f"2 × cp = {2 * cp}")
        valid = [c for c in range(2, min(seq_len, 64) + 1) if context_parallel_fits(seq_len, c, sp)]
        hint = (f"valid cp for seq_len {seq_len}: {_joined(valid)}" if valid
                else f"choose a seq_len that is a multiple of {2 * cp * sp}")
        raise ConfigError(
            f"train.seq_len = {seq_len} is not divisible by {what}: each context-parallel rank "
            f"holds two of the 2 × cp equal chunks of every sequence; {hint}.")
    if model is None:
        return
    chunk = seq_len // (2 * cp)
    group = model.moe_capacity_group
    if model.moe_experts and model.moe_capacity_factor > 0 and (not group or chunk % group):
        now = f"{group}" if group else "0 = the whole sequence"
        raise ConfigError(
            f"model.moe_capacity_factor = {model.moe_capacity_factor} with parallel.cp = {cp} "
            f"needs routing groups inside one context-parallel chunk of seq_len / (2 × cp) = "
            f"{chunk} tokens (model.moe_capacity_group = {now}); set model.moe_capacity_group "
            f"to a divisor of {chunk}: {_joined(divisors(chunk))}, or use "
            f"model.moe_capacity_factor = 0 (dropless) or parallel.cp = 1.")


# ---------------------------------------------------------------- pipeline parallelism
def pipeline_stages_fit(stages: int, n_layers: int) -> bool:
    """Whether ``n_layers`` layers give each of ``stages`` pipeline stages (pp × chunks per
    rank) at least one."""
    return stages <= n_layers


def check_pipeline_stages(stages: int, n_layers: int) -> None:
    """Refuse more pipeline stages (pp × virtual stages) than layers."""
    if not pipeline_stages_fit(stages, n_layers):
        raise ConfigError(f"model.n_layers = {n_layers} is fewer than the {stages} pipeline "
                          f"stages (pp × virtual_stages); use pp × virtual_stages <= {n_layers}, "
                          f"or give parallel.pp_split: {stages} layer counts adding up to "
                          f"{n_layers}, where a 0 is a stage without blocks (e.g. the first "
                          "holding only the embedding, the last only the head).")


def interleaving_fits(pp: int, microbatches: int) -> bool:
    """Whether interleaved 1F1B can run ``microbatches`` micro-batches on ``pp`` ranks: a
    multiple of pp (Megatron-LM's constraint)."""
    return microbatches % pp == 0


def check_interleaved_microbatches(pp: int, microbatches: int) -> None:
    """Refuse interleaved 1F1B with micro-batches that are not a multiple of pp."""
    if not interleaving_fits(pp, microbatches):
        valid = ", ".join(str(pp * k) for k in range(1, 5))
        raise ConfigError(f"interleaved-1f1b needs microbatches divisible by pp (Megatron-LM's "
                          f"constraint): {microbatches} is not a multiple of pp = {pp}; valid: "
                          f"{valid}, ...")


# ---------------------------------------------------------------- expert parallelism
def _expert_degree_problem(ep: int, dp: int | None, tp: int | None,
                           experts: int | None) -> str | None:
    """Which part of the expert-degree rule ``ep`` breaks, or None. The one place its
    arithmetic is written: ep >= 1; ep > 1 needs experts; ep divides dp × tp and divides tp or
    is a multiple of it (an expert group is a slice of one tp group or a run of whole tp
    groups); ep divides the experts. None (unknown) skips the parts that need it."""
    if ep < 1:
        return "at_least"
    if experts is not None and ep > 1 and not experts:
        return "dense"
    if dp is not None and tp is not None:
        if (dp * tp) % ep:
            return "dp_tp"
        if tp % ep and ep % tp:
            return "tp"
    if experts is not None and experts % ep:
        return "experts"
    return None


def expert_degree_ok(ep: int, dp: int | None = None, tp: int | None = None,
                     experts: int | None = None) -> bool:
    """Whether the folded expert layout can place ``ep`` (:func:`check_expert_degree`)."""
    return _expert_degree_problem(ep, dp, tp, experts) is None


def valid_expert_degrees(dp: int, tp: int, experts: int | None = None) -> list[int]:
    """Every ``parallel.ep`` the folded expert layout can place on ``dp × tp`` ranks (with
    ``experts`` experts, when given), increasing: [1] for a dense model."""
    return [e for e in divisors(dp * tp) if expert_degree_ok(e, dp, tp, experts)]


def check_expert_degree(ep: int, dp: int | None = None, tp: int | None = None,
                        experts: int | None = None) -> None:
    """Refuse an expert-parallel degree the folded layout cannot place (see
    :func:`_expert_degree_problem`); ``experts``: ``model.moe_experts`` (0 = a dense model),
    None when not known (the mesh); ``dp``, ``tp`` None when not known (an expert layer)."""
    problem = _expert_degree_problem(ep, dp, tp, experts)
    if problem is None:
        return
    if dp is not None and tp is not None:
        valid = _joined(valid_expert_degrees(dp, tp, experts))
    else:
        valid = _joined(divisors(experts or 0)) or "1"
    if problem == "at_least":
        raise ConfigError(f"parallel.ep = {ep} is too small; it must be at least 1 (valid ep: "
                          f"{valid}).")
    if problem == "dense":
        raise ConfigError(f"parallel.ep = {ep} needs a Mixture-of-Experts model "
                          f"(model.moe_experts > 0); use parallel.ep = 1 for a dense model.")
    if problem == "dp_tp":
        raise ConfigError(f"parallel.ep = {ep} does not divide parallel.dp × parallel.tp = "
                          f"{dp} × {tp} = {dp * tp} (ep must divide dp × tp: expert "
                          f"parallelism splits the data- and tensor-parallel ranks of a stage); "
                          f"valid ep: {valid}.")
    if problem == "tp":
        raise ConfigError(f"parallel.ep = {ep} neither divides parallel.tp = {tp} nor is a "
                          f"multiple of it (ep must divide tp or be a multiple of it: an expert "
                          f"group is a slice of one tp group or a run of whole tp groups); "
                          f"valid ep: {valid}.")
    raise ConfigError(f"model.moe_experts = {experts} is not divisible by parallel.ep = {ep}; "
                      f"every expert-parallel rank must hold the same number of experts. "
                      f"Valid ep: {valid}.")


# ---------------------------------------------------------------- DiLoCo replica groups
def max_sync_fragments(sync_every: int, n_layers: int) -> int:
    """The most Streaming-DiLoCo fragments a round can have: each is whole blocks and ends its
    rounds at its own inner step."""
    return min(sync_every, n_layers)


def check_replica_keys(*, replicas: int, sync_every: int, sync_fragments: int,
                       outer_grad_dtype: str, sync_overlap: int, n_layers: int) -> None:
    """The DiLoCo keys of ``[parallel]`` and what is valid together: at least one group and
    one inner step per round; a known ``outer_grad_dtype``; 1 to min(sync_every, n_layers)
    fragments (each whole blocks, ending its rounds at its own inner step); an overlap below
    ``sync_every`` and only with a dtype exchanged by one all-reduce
    (:data:`ALL_REDUCE_OUTER_DTYPES`)."""
    at_least(replicas, 1, "parallel.replicas")
    at_least(sync_every, 1, "parallel.sync_every")
    choice(outer_grad_dtype, OUTER_GRAD_DTYPES, "parallel.outer_grad_dtype")
    at_least(sync_fragments, 1, "parallel.sync_fragments")
    most = max_sync_fragments(sync_every, n_layers)
    if sync_fragments > most:
        raise ConfigError(
            f"parallel.sync_fragments = {sync_fragments} is more than parallel.sync_every = "
            f"{sync_every} or model.n_layers = {n_layers} allow: each fragment is whole blocks "
            f"and ends its rounds at its own inner step; valid: 1 to {most}.")
    at_least(sync_overlap, 0, "parallel.sync_overlap")
    if not sync_overlap:
        return
    if sync_overlap >= sync_every:
        raise ConfigError(f"parallel.sync_overlap = {sync_overlap} must be below "
                          f"parallel.sync_every = {sync_every}: a fragment's mean is applied "
                          f"before its next round ends; valid: 0 to {sync_every - 1}.")
    if outer_grad_dtype not in ALL_REDUCE_OUTER_DTYPES:
        raise ConfigError(f"parallel.outer_grad_dtype = {outer_grad_dtype} takes two dependent "
                          "exchanges (all-to-all, then all-gather), which do not run in the "
                          "background; with parallel.sync_overlap > 0 the valid values are "
                          f"{' and '.join(ALL_REDUCE_OUTER_DTYPES)}.")


def check_replica_groups_needed(replicas: int, sync_fragments: int, sync_overlap: int) -> None:
    """Streaming fragments and overlapped exchanges are between replica groups: they need
    ``parallel.replicas > 1``."""
    if replicas > 1:
        return
    if sync_fragments > 1:
        raise ConfigError("parallel.sync_fragments > 1 needs parallel.replicas > 1 (fragments "
                          "are synchronised between replica groups); valid here: 1.")
    if sync_overlap:
        raise ConfigError("parallel.sync_overlap > 0 needs parallel.replicas > 1 (it overlaps "
                          "the exchange between replica groups); valid here: 0.")
