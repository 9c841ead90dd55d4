"""``plan --explain LAYOUT``: a given layout beside the planner's first choice, term by term.

A published layout the search ranks low is a claim that another layout is faster; this puts
the two side by side so a reader can see what the claimed gain rests on: compute, recompute,
each axis's exposed communication (and what overlap hid), the pipeline bubble, the optimizer,
the MFU cap, and the fullest stage's memory by component.

LAYOUT is comma-separated ``key=value`` pairs (:func:`parse_layout`)::

    dp=8,tp=8,pp=4,cp=1,ep=1,zero=1,sp=true,schedule=interleaved-1f1b,v=2,mbs=1,ckpt=full

Keys not given keep :class:`~meshtrain.config.layout.Layout`'s defaults; ``dp`` defaults to
the GPUs left after ``tp × pp × cp``, and the micro-batches to one sequence each (``mbs=1``).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.fit_advice import COMPONENTS
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.offload import Offload
from meshtrain.planner.cost.workload import (
    Workload,
    check_layout,
    check_stack_offers,
    layout_from_json,
)
from meshtrain.planner.hardware.profile import Cluster

KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero",
        "sp": "sequence_parallel", "sequence_parallel": "sequence_parallel",
        "schedule": "pp_schedule", "pp_schedule": "pp_schedule", "v": "virtual_stages",
        "virtual_stages": "virtual_stages", "microbatches": "microbatches",
        "ckpt": "activation_checkpointing",
        "activation_checkpointing": "activation_checkpointing", "pp_split": "pp_split"}
"""LAYOUT keys (short and :class:`Layout` names) -> the Layout field; ``mbs`` (sequences per
micro-batch) is also accepted and sets ``microbatches``."""

TIME_TERMS = (("compute", "compute_s"), ("recompute", "recompute_s"),
              ("tp communication", "tp_comm_s"), ("cp communication", "cp_comm_s"),
              ("ep communication", "ep_comm_s"), ("pp communication", "pp_comm_s"),
              ("dp communication (exposed)", "dp_comm_exposed_s"),
              ("pipeline bubble", "bubble_s"), ("optimizer", "optimizer_s"),
              ("offload (host AdamW, PCIe, NVMe)", "offload_s"),
              ("per-step syncs", "step_sync_s"), ("MoE balance pre-pass", "balance_prepass_s"),
              ("MFU cap", "mfu_cap_s"))
"""(label, ``breakdown`` key) of each time term, seconds per step (a key an estimate lacks
counts 0)."""


def parse_layout(text: str, workload: Workload, gpus: int) -> Layout:
    """The :class:`Layout` ``text`` describes for ``workload`` on ``gpus`` GPUs, refused with
    a :class:`ConfigError` naming the bad key or value."""
    if not text.strip(" ,"):
        raise ConfigError('--explain needs a layout, e.g. "dp=8,tp=8,pp=4,mbs=1" (keys: '
                          f"{', '.join(sorted(set(KEYS) | {'mbs'}))}).")
    values: dict = {}
    mbs = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep and item.isdigit() and "pp_split" in values:
            values["pp_split"] += f",{item}"  # pp_split's own commas: its layer counts go on
            continue
        if not sep or not value:
            raise ConfigError(f'--explain "{text}": "{item}" is not key=value.')
        if key == "mbs":
            mbs = _int(key, value)
            continue
        if key not in KEYS:
            raise ConfigError(f'--explain: unknown key "{key}"; keys: '
                              f"{', '.join(sorted(set(KEYS) | {'mbs'}))}.")
        field = KEYS[key]
        if field == "sequence_parallel":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"--explain: {key}={value}: expected true or false.")
            values[field] = value.lower() in ("true", "1", "yes")
        elif field == "pp_split":
            values[field] = value.replace(":", ",")  # 7:8:...:7 or 7,8,...,7 (last key)
        elif field in ("pp_schedule", "activation_checkpointing"):
            values[field] = value
        else:
            values[field] = _int(key, value)
    layout = Layout(**values)
    if "dp" not in values or layout.dp == 0:
        rest = layout.tp * layout.pp * layout.cp
        if gpus % rest:
            raise ConfigError(f"--explain: tp × pp × cp = {rest} does not divide --gpus {gpus}.")
        layout = dataclasses.replace(layout, dp=gpus // rest)
    if layout.world_size != gpus:
        raise ConfigError(f"--explain: dp × tp × pp × cp = {layout.world_size} is not --gpus "
                          f"{gpus}.")
    if mbs is not None or "microbatches" not in values:
        size = mbs or 1
        if workload.global_batch % (layout.dp * size):
            raise ConfigError(f"--explain: a micro-batch of {size} does not divide the "
                              f"{workload.global_batch} sequences over dp = {layout.dp}.")
        layout = dataclasses.replace(layout, microbatches=workload.global_batch
                                     // (layout.dp * size))
    return layout


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--explain: {key}={value}: expected an integer.") from None


def terms(result: dict) -> dict:
    """One estimate's terms: seconds per step by term (``time``), what overlap hid per axis
    (``hidden``), the fullest stage's memory by component in GB (``memory``), and totals."""
    fullest = max(result["per_rank"], key=lambda rank: rank["total_bytes"])
    return {
        "layout": result["layout"], "micro_batch_size": result["micro_batch_size"],
        "time": {key: result["breakdown"].get(key, 0.0) for _, key in TIME_TERMS},
        "hidden": {axis: entry["overlapped_s"] for axis, entry in result["overlap"].items()},
        "memory": {name: fullest.get(key, 0) / GB for name, key in COMPONENTS.items()},
        "step_time_s": result["step_time_s"], "tokens_per_s": result["tokens_per_s"],
        "mfu": result["mfu"], "memory_gb_per_gpu": result["memory_gb_per_gpu"],
        "memory_limit_gb": result["memory_limit_gb"], "fits": result["fits"],
        "stage": fullest["stage"]}


def explain(workload: Workload, cluster: Cluster, layout: Layout, stack: str,
            energy: dict | None = None) -> dict:
    """``layout`` beside the first choice of :func:`~meshtrain.planner.search.layouts.plan`
    (both priced with the schedule simulator, as ``plan`` prices its front runners): their
    :func:`terms`, where ``layout`` ranks among the searched layouts that fit (closed forms, as
    the search ranks them), and the terms that differ most."""
    from meshtrain.planner.search.layouts import _speed, plan

    check_layout(workload, layout)
    check_stack_offers(workload, layout, stack)
    given = estimate(workload, layout, cluster, energy)
    found = plan(workload, cluster, top=1, energy=energy, explain=False)
    quick = estimate(workload, layout, cluster, energy, use_simulator=False)
    feasible = [r for r in found.priced if r["fits"]]
    rank = 1 + sum(_speed(r) < _speed(quick) for r in feasible)
    out = {"given": terms(given), "first": None, "rank": rank, "searched": found.searched,
           "feasible": found.feasible, "given_fits": given["fits"], "differences": []}
    if found.candidates:
        first = estimate(workload, layout_from_json(found.candidates[0]), cluster, energy,
                         offload=Offload.from_json(found.candidates[0]))
        out["first"] = terms(first)
        out["speedup"] = given["step_time_s"] / first["step_time_s"] - 1
        diffs = [(label, out["first"]["time"][key] - out["given"]["time"][key])
                 for label, key in TIME_TERMS]
        out["differences"] = [{"term": label, "seconds": delta} for label, delta in
                              sorted(diffs, key=lambda item: abs(item[1]), reverse=True)
                              if abs(delta) > 1e-4 * given["step_time_s"]]
    return out


def _layout_text(terms_: dict) -> str:
    lay = terms_["layout"]
    schedule = "" if lay["pp"] == 1 else f" {lay['schedule']}" + (
        f" v{lay['virtual_stages']}" if lay["schedule"] == "interleaved-1f1b" else "")
    return (f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} ep={lay['ep']} "
            f"zero={lay['zero']}{' sp' if lay['sequence_parallel'] else ''}{schedule} "
            f"mbs={terms_['micro_batch_size']} ckpt={lay['activation_checkpointing']}")


def format_explain(result: dict) -> str:
    """The side-by-side text of :func:`explain`."""
    given, first = result["given"], result["first"]
    lines = [f"given:        {_layout_text(given)}"]
    if first is None:
        lines.append("first choice: none (no searched layout fits)")
    else:
        lines.append(f"first choice: {_layout_text(first)}")
    fit = "" if result["given_fits"] else " (the given layout does not fit)"
    lines.append(f"the given layout ranks {result['rank']} of {result['feasible']} that fit "
                 f"({result['searched']} searched){fit}")
    width = 30
    lines.append(f"{'seconds per step':<{width}} {'given':>10} {'first':>10} {'first - given':>14}")

    def row(label: str, a: float, b: float | None, fmt: str = "10.3f") -> str:
        second = f"{b:{fmt}}" if b is not None else f"{'—':>10}"
        delta = f"{b - a:+14.3f}" if b is not None else ""
        return f"{label:<{width}} {a:{fmt}} {second} {delta}"

    for label, key in TIME_TERMS:
        lines.append(row(label, given["time"][key], first["time"][key] if first else None))
    lines.append(row("step", given["step_time_s"], first["step_time_s"] if first else None))
    for axis in ("tp", "cp", "pp", "dp"):
        a, b = given["hidden"][axis], first["hidden"][axis] if first else None
        if a or b:
            lines.append(row(f"  {axis} hidden by overlap", a, b))
    lines.append(f"{'memory GB (fullest stage)':<{width}} {'given':>10} {'first':>10}")
    for name in COMPONENTS:
        lines.append(row(f"  {name}", given["memory"][name],
                         first["memory"][name] if first else None, "10.1f"))
    lines.append(row("  total", given["memory_gb_per_gpu"],
                     first["memory_gb_per_gpu"] if first else None, "10.1f")
                 + f"  (limit {given['memory_limit_gb']:.1f})")
    if first is not None:
        lines.append(f"tokens/s: given {given['tokens_per_s']:,.0f}, first "
                     f"{first['tokens_per_s']:,.0f}; MFU {given['mfu']:.1%} vs "
                     f"{first['mfu']:.1%}; the given layout's step is "
                     f"{100 * result['speedup']:+.1f} % against the first choice's")
        top = ", ".join(f"{d['term']} {d['seconds']:+.3f}s" for d in result["differences"][:3])
        if top:
            lines.append(f"the difference rests on: {top}")
    return "\n".join(lines)
