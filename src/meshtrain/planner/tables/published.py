"""Published training runs the cost model is checked against, split into the rows its constants
were fitted on (**train**) and the rows that only measure its accuracy (**test**).

The rows live in :mod:`meshtrain.planner.tables.runs_megatron` (Megatron-LM 2021/2022,
Megatron-DeepSpeed, Megatron-Core), :mod:`meshtrain.planner.tables.runs_llama3` (Meta's Llama 3
405B runs), :mod:`meshtrain.planner.tables.runs_moe` (Qwen3-235B-A22B),
:mod:`meshtrain.planner.tables.runs_bridge` (Megatron-Bridge's H100 FP8 rows),
:mod:`meshtrain.planner.tables.runs_nemo` (NeMo 24.12's H100 FP8 rows),
:mod:`meshtrain.planner.tables.runs_torchtitan`, :mod:`meshtrain.planner.tables.runs_olmo`
(OLMo-core's H100 rows) and :mod:`meshtrain.planner.tables.runs_automodel` (NeMo AutoModel's
H100 rows); each
names its source, layout and which figure it is, and every train row names the constant it
feeds (:mod:`meshtrain.planner.tables.fitting`, whose routines take train rows only).

``python -m meshtrain.planner.tables.published`` prints every row with its error and the
accuracy over train and test rows; ``--table`` the per-row table docs/planner.md shows;
``--fit`` the constants the train rows give; ``--ranks`` where published layouts rank among the
layouts ``plan`` searches (:mod:`meshtrain.planner.tables.ranks`); ``--commands`` the
``meshtrain estimate`` command that prices each row (:mod:`meshtrain.planner.tables.row_commands`).
"""

from __future__ import annotations

from meshtrain.planner.cost.fit_advice import COMPONENTS
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.tables.fitting import fit_groups, priced, refit, speed_error
from meshtrain.planner.tables.runs_automodel import automodel_rows
from meshtrain.planner.tables.runs_bridge import bridge_rows
from meshtrain.planner.tables.runs_llama3 import llama3_rows
from meshtrain.planner.tables.runs_megatron import megatron_rows
from meshtrain.planner.tables.runs_moe import moe_rows
from meshtrain.planner.tables.runs_nemo import nemo_rows
from meshtrain.planner.tables.runs_olmo import olmo_rows
from meshtrain.planner.tables.runs_row import PublishedRow
from meshtrain.planner.tables.runs_torchtitan import torchtitan_rows


def published_rows() -> list[PublishedRow]:
    """Every row of the validation set, train and test."""
    return (megatron_rows() + nemo_rows() + llama3_rows() + moe_rows() + bridge_rows()
            + torchtitan_rows() + olmo_rows() + automodel_rows())


def evaluate(row: PublishedRow) -> dict:
    """The row priced: ``predicted``, ``error`` (predicted / published - 1), ``speed_error``
    (positive: predicted faster than published; memory rows: the error), ``fits`` and the
    fullest rank's memory by component (GB)."""
    result = priced(row)
    predicted = result[row.metric]
    fullest = max(result["per_rank"], key=lambda rank: rank["total_bytes"])
    memory = {name: fullest[key] / GB for name, key in COMPONENTS.items()}
    error = predicted / row.published - 1
    return {"name": row.name, "source": row.source, "split": row.split, "metric": row.metric,
            "stack": row.stack, "gpus": row.gpus, "published": row.published,
            "predicted": predicted, "error": error,
            "speed_error": error if row.metric == "memory_gb_per_gpu"
            else speed_error(row, result),
            "fits": result["fits"], "memory_gb_per_gpu": result["memory_gb_per_gpu"],
            "memory_limit_gb": result["memory_limit_gb"], "memory": memory}


def summary(results: list[dict], split: str, kind: str = "throughput") -> tuple[float, float]:
    """(mean absolute error, worst absolute error) of predicted / published - 1 over the
    ``split`` rows of ``kind``: ``throughput`` (rates and step times) or ``memory``."""
    memory = kind == "memory"
    errors = [abs(r["error"]) for r in results
              if r["split"] == split and (r["metric"] == "memory_gb_per_gpu") == memory]
    return sum(errors) / len(errors), max(errors)


def _percent(value: float) -> str:
    return f"{100 * value:+.1f} %".replace("-", "−")


def _figure(metric: str, value: float, gpus: int) -> str:
    if metric in ("hardware_tflops_per_gpu", "model_tflops_per_gpu"):
        return f"{value:.1f} TFLOP/s"
    if metric == "step_time_s":
        return f"{value:.2f} s"
    if metric == "memory_gb_per_gpu":
        return f"{value:.1f} GB"
    return f"{value / gpus:,.0f} tok/s"


def table_lines(results: list[dict]) -> list[str]:
    """The per-row markdown table of docs/planner.md: every row, its source and split, the
    published and predicted figures, the error and the memory verdict."""
    lines = ["| row | source | stack | split | published | predicted | error | memory |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for r in results:
        verdict = (f"{r['memory_gb_per_gpu']:.1f} of {r['memory_limit_gb']:.1f} GB"
                   + ("" if r["fits"] else ", **does not fit**"))
        lines.append(f"| {r['name']} | {r['source']} | {r['stack']} | {r['split']} | "
                     f"{_figure(r['metric'], r['published'], r['gpus'])} | "
                     f"{_figure(r['metric'], r['predicted'], r['gpus'])} | "
                     f"{_percent(r['error'])} | {verdict} |")
    return lines


def headline(results: list[dict]) -> str:
    """The accuracy sentence docs/planner.md quotes (test rows first)."""
    test, train = summary(results, "test"), summary(results, "train")
    memory = summary(results, "test", "memory")
    unfit = [r["name"] for r in results if not r["fits"]]
    count = sum(1 for r in results if r["split"] == "test")
    return (f"Test rows ({count}): throughput mean absolute error {100 * test[0]:.1f} %, worst "
            f"{100 * test[1]:.1f} %; memory mean absolute error {100 * memory[0]:.1f} %, worst "
            f"{100 * memory[1]:.1f} %. Train rows: throughput mean absolute error "
            f"{100 * train[0]:.1f} %, worst {100 * train[1]:.1f} %. Layouts judged not to fit: "
            + (", ".join(unfit) if unfit else "none") + ".")


def main(argv: list[str] | None = None) -> None:
    """Print the validation set with errors, train rows apart from test rows; ``--table``: the
    docs table; ``--fit``: the constants the train rows give; ``--ranks``: the rank table;
    ``--commands``: each row's ``meshtrain estimate`` command."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    rows = published_rows()
    if "--fit" in args:
        groups = fit_groups(rows)
        for name, value in refit(rows).items():
            print(f"{name}: {value:.3f} (from {len(groups[name])} train row(s))")
        return
    if "--commands" in args:
        from meshtrain.planner.tables.row_commands import row_command

        for row in rows:
            print(f"# {row.name} ({row.source}, {row.split}): published {row.metric} "
                  f"{row.published:g}")
            print(row_command(row))
        return
    if "--ranks" in args:
        from meshtrain.planner.tables.ranks import print_ranks, ranked_rows

        print_ranks(ranked_rows(rows))
        return
    results = [evaluate(row) for row in rows]
    if "--table" in args:
        print("\n".join(table_lines(results)))
        print()
        print(headline(results))
        return
    for split in ("train", "test"):
        print(f"{split} rows:")
        for r in (r for r in results if r["split"] == split):
            print(f"  {r['name']:<40} {r['stack']:<24} {r['metric']:<24} "
                  f"{r['published']:>10.2f} {r['predicted']:>10.2f} {r['error']:+7.1%}"
                  f"{'' if r['fits'] else '  (does not fit)'}")
    print(headline(results))


if __name__ == "__main__":
    main()
