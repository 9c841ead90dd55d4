"""Where each published layout ranks among the layouts ``plan`` searches for the same model,
batch, cluster and stack: ``python -m meshtrain.planner.tables.published --ranks`` prints the
table docs/planner.md shows (:func:`print_ranks`).
"""

from __future__ import annotations

from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.runs_row import PublishedRow

RANKED_SOURCES = ("Narayanan 2021", "Korthikanti 2022", "torchtitan docs/performance.md (A100)",
                  "torchtitan docs/performance.md Table 1",
                  "NVIDIA dgxc-benchmarking (NeMo 24.09)")
"""Sources whose layouts the rank table covers (every row of these but the memory rows, and of
the dgxc-benchmarking NeMo 24.09 recipes the smallest scale of each; the MoE row and the FP8
rows, whose layouts are their bf16 twins', are not ranked)."""


def ranked_rows(rows: list[PublishedRow]) -> list[PublishedRow]:
    """The rows :func:`print_ranks` covers: one per published layout of :data:`RANKED_SOURCES`
    (a throughput row; the dgxc-benchmarking recipes at their smallest scale)."""
    out, seen = [], set()
    for row in rows:
        if (not row.source.startswith(RANKED_SOURCES) or row.metric == "memory_gb_per_gpu"
                or row.workload.traits.fp8_linear):
            continue
        if row.source.startswith("torchtitan docs/performance.md Table 1") and \
                row.stack != "torchtitan-2024":
            continue
        family = row.name.rsplit(" ", 2)[0] if row.source.startswith("NVIDIA") else row.name
        if family in seen:
            continue
        seen.add(family)
        out.append(row)
    return out


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

    cluster = Cluster(PROFILES[row.profile], row.gpus, 8)
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


def layout_words(result: dict) -> str:
    """An estimate's layout in words (``tp 4 × pp 8 × dp 4, SP, interleaved 12 chunks, ...``)."""
    lay = result["layout"]
    schedule = ("" if lay["pp"] == 1 else ", 1F1B" if lay["schedule"] == "1f1b" else
                f", interleaved {lay['virtual_stages']} chunks"
                if lay["schedule"] == "interleaved-1f1b" else f", {lay['schedule']}")
    cp = f" × cp {lay['cp']}" if lay.get("cp", 1) > 1 else ""
    return (f"tp {lay['tp']} × pp {lay['pp']}{cp} × dp {lay['dp']}"
            f"{', ZeRO-' + str(lay['zero']) if lay['zero'] else ''}"
            f"{', SP' if lay['sequence_parallel'] else ''}{schedule}, "
            f"micro-batch {result['micro_batch_size']}")


def _short_source(source: str) -> str:
    return (source.replace("Narayanan 2021", "N21").replace("Korthikanti 2022", "K22")
            .replace(" docs/performance.md", "").replace("NVIDIA dgxc-benchmarking", "DGXC"))


def print_ranks(rows: list[PublishedRow], rank=rank_among_searched) -> None:
    """Print the docs/planner.md table of :func:`rank_among_searched` for ``rows``."""
    print("| row | source | searched | feasible | rank | best variant | fastest layout | behind |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        r = rank(row)
        variant = r["best_variant"] if row.source == "Narayanan 2021 Table 2" else "—"
        behind = f"{100 * r['behind']:+.1f} %".replace("-", "−")
        print(f"| {row.name} | {_short_source(row.source)} | {r['searched']} | {r['feasible']} | "
              f"**{r['rank']}** | {variant} | {layout_words(r['fastest'])} | {behind} |")
