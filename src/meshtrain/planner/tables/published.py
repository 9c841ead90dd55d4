"""Published training runs the cost model is checked against, split into the rows its constants
were fitted on and the rows that report its accuracy.

``python -m meshtrain.planner.tables.published`` prints every row with its error, and with
``--ranks`` where each published layout ranks among the layouts ``plan`` searches (what
docs/planner.md quotes). Each row names its source, table, layout and which figure it is:

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21, arXiv:2104.04473), Table 1: achieved TFLOP/s per GPU counted with full
  recomputation (the paper's ``96 B s l h^2 (1 + s/6h + V/16lh)``: our hardware FLOPs), A100
  80 GB. Micro-batch size, schedule and DDP implementation are not in the table; they are the
  paper's reproduction script's (NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``,
  :data:`NARAYANAN_TABLE_1_RUN`): micro-batches of 16 to 1, interleaved 1F1B for the 76B to
  530B models, PyTorch DDP (``megatron-2021-torch-ddp``) for the four models without a pipeline
  and Megatron-LM's local DDP (``megatron-2021``) for the rest. **Fit**: the Megatron-LM stacks'
  A100 GEMM efficiency (0.70, :data:`~meshtrain.planner.tables.stacks.MEGATRON_2021_A100`,
  also the A100 profiles' default) was chosen on these rows, as the value whose mean signed
  error over them is zero (``--fit`` re-derives it).
- Narayanan et al. 2021, Table 2 (5.2), the PTD-P rows: 174.6B GPT (96 layers, hidden 12288,
  96 heads) at model-parallel size 96 and 529.6B (105 layers, hidden 20480, 128 heads) at 280,
  i.e. tp 8 within a node × pp 12 and × pp 35, micro-batch 1, global batch 1536 and 2240 on 384 to
  2240 GPUs; the same FLOPs definition as Table 1, the ``megatron-2021`` stack. The table gives
  no schedule: priced as 1F1B (with 96 to 384 micro-batches per pipeline
  the interleaved schedule's smaller bubble, against v times the sends, moves the prediction by
  -1 % to +6 %). **Report**. Table 2's ZeRO-3 rows ran DeepSpeed's ZeRO-3 without model
  parallelism, a stack with no profile here; they are not in the set.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Table 5: seconds per iteration with full recomputation and with sequence
  parallelism + selective recomputation, layouts of its Table 3 (22B: one micro-batch of 4;
  175B and 530B: interleaved 1F1B, 3 chunks per rank; 1T: 1F1B; micro-batch 1 elsewhere), the
  ``megatron-2022`` stack (sequence parallelism and selective recompute are this paper's).
  **Report**: nothing was fitted on them.
- torchtitan, docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8 H100 96 GB (Grand Teton:
  HBM2e at 2.4 TB/s, the default 500 W power limit), seq 8192, local batch 2, per-op selective
  checkpointing, no torch.compile: 82.4 GiB of memory and 5,762 tokens/s per GPU (compared as
  the 8 GPUs' ``tokens_per_s``). Priced on ``h100-96g-hbm2e-500w``. **Report** (memory and
  throughput).
- torchtitan, docs/performance.md as of its 2024 A100 tables ("Llama 3 performance numbers",
  "Llama 2 performance numbers"): FSDP2 (ZeRO-3) on 64 A100 80 GB, tokens/s per GPU ("WPS"),
  Llama 3 at seq 8192, Llama 2 at 4096, per-op selective ("selective op"), full or no
  checkpointing, local batch as listed. The Llama 2 13B run without checkpointing (61.1 % MFU)
  sets the A100 MFU cap (``hardware.PUBLISHED_MFU_CAPS``) and the ``torchtitan-2024`` stack's
  A100 GEMM efficiency (0.74, :data:`~meshtrain.planner.tables.stacks.TORCHTITAN_2024_A100`):
  **fit**; the other five **report**.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import (
    MEGATRON_2021,
    MEGATRON_2021_TORCH_DDP,
    MEGATRON_2022,
    TORCHTITAN_2024,
    Workload,
)
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.hardware.stack_efficiency import StackEfficiency
from meshtrain.planner.tables.profiles import PROFILES


@dataclasses.dataclass(frozen=True)
class PublishedRow:
    """One published figure and how to price it."""

    name: str
    source: str
    use: str
    """``fit`` (a constant was chosen on it) or ``report`` (accuracy)."""
    metric: str
    """The estimate's key compared: ``hardware_tflops_per_gpu``, ``step_time_s`` or
    ``memory_gb_per_gpu``."""
    published: float
    workload: Workload
    layout: Layout
    profile: str


def _gpt(hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads,
                       ffn_dim=4 * hidden, mlp="gelu")


# (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

NARAYANAN_TABLE_1_RUN = {
    1.7: (16, 1, "torch"), 3.6: (16, 1, "torch"), 7.5: (16, 1, "torch"), 18.4: (8, 1, "torch"),
    39.1: (4, 1, "local"), 76.1: (2, 3, "local"), 145.6: (2, 2, "local"), 310.1: (1, 2, "local"),
    529.6: (1, 3, "local"), 1008.0: (1, 1, "local"),
}
"""How each Table 1 model ran, from the paper's reproduction script (NVIDIA/Megatron-LM,
``examples/sc21/run_table_1.sh``): params B -> (micro-batch size, chunks per rank, DDP
implementation). Chunks are the stage's layers over ``--num-layers-per-virtual-pipeline-stage``
(5, 5, 3 and 1 for the 76B, 145B, 310B and 530B models; the others run plain 1F1B)."""

# (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU); micro-batch 1
NARAYANAN_TABLE_2_PTDP = (
    (174.6, 96, 12288, 96, 8, 12, 384, 1536, 153), (174.6, 96, 12288, 96, 8, 12, 768, 1536, 149),
    (174.6, 96, 12288, 96, 8, 12, 1536, 1536, 141),
    (529.6, 128, 20480, 105, 8, 35, 560, 2240, 171),
    (529.6, 128, 20480, 105, 8, 35, 1120, 2240, 167),
    (529.6, 128, 20480, 105, 8, 35, 2240, 2240, 159),
)

# (name, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, chunks, full s, selective s)
KORTHIKANTI_TABLE_5 = (
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
)


_LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14336, mlp="swiglu", rope_theta=500000.0)
_LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                          ffn_dim=28672, mlp="swiglu", rope_theta=500000.0)
_LLAMA2_13B = ModelConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824,
                          mlp="swiglu")
_LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                          ffn_dim=28672, mlp="swiglu")

# (model, shape, seq, local batch, checkpointing, tokens/s per GPU): FSDP2 on 64 A100 80 GB
TORCHTITAN_A100 = (
    ("Llama 3 8B", _LLAMA3_8B, 8192, 1, "selective", 2973),
    ("Llama 3 70B", _LLAMA3_70B, 8192, 1, "full", 331),
    ("Llama 2 13B", _LLAMA2_13B, 4096, 2, "none", 2162),
    ("Llama 2 13B", _LLAMA2_13B, 4096, 2, "selective", 1904),
    ("Llama 2 70B", _LLAMA2_70B, 4096, 1, "selective", 355),
    ("Llama 2 70B", _LLAMA2_70B, 4096, 2, "full", 353),
)


def published_rows() -> list[PublishedRow]:
    """Every row of the validation set."""
    rows = []
    narayanan = [("Narayanan 2021 Table 1", "fit", NARAYANAN_TABLE_1),
                 ("Narayanan 2021 Table 2", "report", NARAYANAN_TABLE_2_PTDP)]
    for source, role, table in narayanan:
        for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in table:
            dp = gpus // (tp * pp)
            mb, chunks, ddp = NARAYANAN_TABLE_1_RUN[size] if role == "fit" else (1, 1, "local")
            stack = MEGATRON_2021_TORCH_DDP if ddp == "torch" else MEGATRON_2021
            rows.append(PublishedRow(
                f"GPT {size}B tp{tp} pp{pp} dp{dp}", source, role, "hardware_tflops_per_gpu",
                tflops, Workload(_gpt(hidden, layers, heads), 2048, batch, "bf16", stack),
                Layout(dp=dp, tp=tp, pp=pp, microbatches=batch // (dp * mb),
                       pp_schedule="interleaved-1f1b" if chunks > 1 else "1f1b",
                       virtual_stages=chunks, activation_checkpointing="full"), "a100-80g"))
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, chunks, *times in \
            KORTHIKANTI_TABLE_5:
        schedule = "interleaved-1f1b" if chunks > 1 else "1f1b"
        for mode, seconds in zip(("full", "selective"), times, strict=True):
            rows.append(PublishedRow(
                f"GPT {name} tp{tp} pp{pp} {mode}", "Korthikanti 2022 Table 5", "report",
                "step_time_s", seconds,
                Workload(_gpt(hidden, layers, heads), 2048, batch, "bf16", MEGATRON_2022),
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, microbatches=batch // mb,
                       sequence_parallel=True, pp_schedule=schedule, virtual_stages=chunks,
                       activation_checkpointing=mode), "a100-80g"))
    llama = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_dim=14336, mlp="swiglu", rope_theta=500000.0)
    rows.append(PublishedRow(
        "Llama 3.1 8B FSDP 8 selective", "torchtitan docs/performance.md Table 1", "report",
        "memory_gb_per_gpu", 82.4 * 2**30 / 1e9,
        Workload(llama, 8192, 16, "bf16", TORCHTITAN_2024),
        Layout(dp=8, zero=3, activation_checkpointing="selective"), "h100-96g-hbm2e-500w"))
    rows.append(dataclasses.replace(
        rows[-1], name="Llama 3.1 8B FSDP 8 selective TPS", metric="tokens_per_s",
        published=5762 * 8))
    for name, model, seq, local, mode, per_gpu in TORCHTITAN_A100:
        rows.append(PublishedRow(
            f"{name} FSDP 64 A100 {mode}", "torchtitan docs/performance.md (A100)",
            "fit" if name == "Llama 2 13B" and mode == "none" else "report",
            "tokens_per_s", per_gpu * 64, Workload(model, seq, 64 * local, "bf16", TORCHTITAN_2024),
            Layout(dp=64, zero=3, activation_checkpointing=mode), "a100-80g"))
    return rows


def evaluate(row: PublishedRow) -> dict:
    """The row priced: ``predicted``, ``error`` (predicted / published - 1) and ``fits``."""
    gpus = row.layout.world_size
    result = estimate(row.workload, row.layout, Cluster(PROFILES[row.profile], gpus, 8))
    predicted = result[row.metric]
    return {"name": row.name, "source": row.source, "use": row.use, "metric": row.metric,
            "published": row.published, "predicted": predicted,
            "error": predicted / row.published - 1, "fits": result["fits"]}


def with_gemm_efficiency(row: PublishedRow, gemm: float) -> PublishedRow:
    """``row`` priced with its stack's GEMM efficiency on the row's GPU set to ``gemm``."""
    profile = PROFILES[row.profile]
    traits = row.workload.traits
    entries = tuple((f, e) for f, e in traits.kernel_efficiency if f != profile.family)
    trial = StackEfficiency(gemm=gemm, source="trial")
    traits = dataclasses.replace(traits, kernel_efficiency=((profile.family, trial), *entries))
    return dataclasses.replace(row, workload=dataclasses.replace(row.workload, traits=traits))


def mean_signed_error(rows: list[PublishedRow], gemm: float | None = None) -> float:
    """Mean of predicted / published - 1 over ``rows``, at GEMM efficiency ``gemm`` (None: as
    the stacks have it)."""
    priced = rows if gemm is None else [with_gemm_efficiency(row, gemm) for row in rows]
    return sum(evaluate(row)["error"] for row in priced) / len(priced)


def fit_gemm_efficiency(rows: list[PublishedRow], tolerance: float = 5e-4) -> float:
    """The GEMM efficiency whose mean signed error over ``rows`` (fit rows of one stack on one
    GPU generation) is zero, by bisection: how the
    :mod:`meshtrain.planner.hardware.stack_efficiency`
    entries were chosen (``--fit`` prints them)."""
    low, high = 0.3, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if mean_signed_error(rows, middle) < 0 else (low, middle)
    return (low + high) / 2


def fit_groups() -> dict[str, list[PublishedRow]]:
    """The fit rows behind each stack efficiency entry, by entry (the rows with ``use`` fit
    whose metric is a throughput; the torchtitan row also sets the A100 MFU cap)."""
    rows = [r for r in published_rows() if r.use == "fit"]
    return {"megatron-2021 a100": [r for r in rows if r.source == "Narayanan 2021 Table 1"],
            "torchtitan-2024 a100": [r for r in rows if r.source.startswith("torchtitan")]}


def summary(results: list[dict], use: str) -> tuple[float, float]:
    """(mean absolute error, worst absolute error) over the rows of ``use``."""
    errors = [abs(r["error"]) for r in results if r["use"] == use]
    return sum(errors) / len(errors), max(errors)


def rank_among_searched(row: PublishedRow) -> dict:
    """Where the published layout stands among every layout ``plan`` searches for the same
    model, batch, cluster and stack, with the row's own recompute mode (the papers' variable,
    not a layout choice), all priced as ``plan`` first ranks them (closed-form pipeline).

    ``rank``: 1 + how many feasible layouts are predicted faster; ``searched``, ``feasible``;
    ``fastest`` (that layout's estimate) and ``behind`` (the published layout's step time over
    the fastest's, minus 1); ``best_variant``: the rank of the fastest layout with the
    published tp, pp and dp (what a source that leaves micro-batch and schedule open allows).
    """
    from meshtrain.planner.search.layouts import _speed, enumerate_layouts, price_layouts

    cluster = Cluster(PROFILES[row.profile], row.layout.world_size, 8)
    mine = estimate(row.workload, row.layout, cluster, use_simulator=False)
    layouts = enumerate_layouts(row.workload, cluster,
                                checkpointing=(row.layout.activation_checkpointing,))
    priced = price_layouts(row.workload, cluster, layouts)
    feasible = [(layout, result) for layout, result in priced if result["fits"]]
    feasible.sort(key=lambda item: _speed(item[1]))
    degrees = (row.layout.tp, row.layout.pp, row.layout.dp)
    variant = next((i for i, (lay, r) in enumerate(feasible)
                    if (lay.tp, lay.pp, lay.dp) == degrees or _speed(r) >= _speed(mine)),
                   len(feasible))
    fastest = feasible[0][1] if feasible else mine
    return {"rank": 1 + sum(_speed(r) < _speed(mine) for _, r in feasible),
            "searched": len(priced), "feasible": len(feasible), "fastest": fastest,
            "behind": mine["step_time_s"] / fastest["step_time_s"] - 1,
            "best_variant": variant + 1}


def _layout_words(result: dict) -> str:
    lay = result["layout"]
    schedule = ("" if lay["pp"] == 1 else ", 1F1B" if lay["schedule"] == "1f1b" else
                f", interleaved {lay['virtual_stages']} chunks"
                if lay["schedule"] == "interleaved-1f1b" else f", {lay['schedule']}")
    return (f"tp {lay['tp']} × pp {lay['pp']} × dp {lay['dp']}"
            f"{', ZeRO-' + str(lay['zero']) if lay['zero'] else ''}"
            f"{', SP' if lay['sequence_parallel'] else ''}{schedule}, "
            f"micro-batch {result['micro_batch_size']}")


def print_ranks(rows: list[PublishedRow]) -> None:
    """Print the docs/planner.md table of :func:`rank_among_searched` for ``rows``."""
    print("| row | source | searched | feasible | rank | best variant | fastest layout | behind |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        r = rank_among_searched(row)
        variant = r["best_variant"] if row.source == "Narayanan 2021 Table 2" else "—"
        behind = f"{100 * r['behind']:+.1f} %".replace("-", "−")
        source = (row.source.replace("Narayanan 2021", "N21").replace("Korthikanti 2022", "K22")
                  .replace(" docs/performance.md", ""))
        print(f"| {row.name} | {source} | {r['searched']} | {r['feasible']} | "
              f"**{r['rank']}** | {variant} | {_layout_words(r['fastest'])} | {behind} |")


def main(argv: list[str] | None = None) -> None:
    """Print the validation set with errors, fitted rows apart from reported ones; with
    ``--ranks``, where each published layout ranks in ``plan``'s search instead; with
    ``--fit``, the stack GEMM efficiencies the fit rows give."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--fit" in args:
        for entry, rows in fit_groups().items():
            print(f"{entry}: GEMM efficiency {fit_gemm_efficiency(rows):.3f} "
                  f"(mean signed error zero over {len(rows)} fit row(s))")
        return
    if "--ranks" in args:
        print_ranks(published_rows())
        return
    results = [evaluate(row) for row in published_rows()]
    for use in ("fit", "report"):
        print(f"{use} rows:")
        for r in (r for r in results if r["use"] == use):
            print(f"  {r['name']:<34} {r['source']:<40} {r['metric']:<24} "
                  f"{r['published']:>8.2f} {r['predicted']:>8.2f} {r['error']:+7.1%}"
                  f"{'' if r['fits'] else '  (does not fit)'}")
        mean, worst = summary(results, use)
        print(f"  mean |error| {mean:.1%}, worst {worst:.1%}")


if __name__ == "__main__":
    main()
