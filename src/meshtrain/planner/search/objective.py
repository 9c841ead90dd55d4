"""Plan for an objective (time, energy, cost or carbon) and, for a training budget, a GPU count.

Per candidate the objective is, per 10^9 tokens: ``time`` the seconds (1 / tokens/s),
``energy`` the kWh, ``carbon`` the kg CO2 (kWh × grid intensity) and ``cost`` the electricity
(kWh × price) plus the GPU hours at ``gpu_hour_price``. At one GPU count energy, carbon and the
electricity cost rank layouts as time does (the power per GPU is the profile's, whatever the
layout); the objectives part ways once the GPU count varies: more GPUs finish sooner but
usually at a lower efficiency (more communication, bubble), so more energy per token.

:func:`budget_plan` trains ``tokens`` tokens by ``deadline_hours``: every power-of-two GPU count
up to ``max_gpus`` (and ``max_gpus`` itself) is searched
(:func:`meshtrain.planner.search.layouts.plan`),
each count's best layout for the objective priced for the whole run, and the best that meets the
deadline chosen; it is compared with the time-optimal plan (the fastest that meets it). When none
meets the deadline, the answer says what would: the deadline the fastest layout needs, and the
GPU count that linear scaling from it suggests.
"""

from __future__ import annotations

import math

from meshtrain.config import ConfigError
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster, HardwareProfile
from meshtrain.planner.search.layouts import plan

OBJECTIVES = ("time", "energy", "cost", "carbon")


def objective_value(row: dict, objective: str, gpu_hour_price: float = 0.0) -> float:
    """The objective per 10^9 tokens of a candidate row (lower is better)."""
    seconds = 1e9 / row["tokens_per_s"]
    if objective == "time":
        return seconds
    if objective == "energy":
        return row["kwh_per_1b_tokens"]
    if objective == "carbon":
        return row["co2_kg_per_1b_tokens"]
    if objective == "cost":
        gpus = row["dp"] * row["tp"] * row["pp"] * row["cp"]
        return row["cost_per_1b_tokens"] + gpus * seconds / 3600 * gpu_hour_price
    raise ConfigError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}.")


def rank_rows(rows: list[dict], objective: str, gpu_hour_price: float = 0.0) -> list[dict]:
    """Candidate rows sorted by the objective (ties: faster first)."""
    return sorted(rows, key=lambda r: (objective_value(r, objective, gpu_hour_price),
                                       -r["tokens_per_s"]))


def run_totals(row: dict, tokens: float, gpus: int, gpu_hour_price: float = 0.0) -> dict:
    """Hours, kWh, cost and tonnes of CO2 of training ``tokens`` tokens with a candidate."""
    hours = tokens / row["tokens_per_s"] / 3600
    scale = tokens / 1e9
    return {"gpus": gpus, "hours": hours, "kwh": row["kwh_per_1b_tokens"] * scale,
            "cost": row["cost_per_1b_tokens"] * scale + gpus * hours * gpu_hour_price,
            "co2_t": row["co2_kg_per_1b_tokens"] * scale / 1000}


def gpu_counts(max_gpus: int, gpus_per_node: int) -> list[int]:
    """Powers of two up to ``max_gpus``, and ``max_gpus``, that make whole nodes."""
    counts = {2 ** k for k in range(int(math.log2(max_gpus)) + 1)} | {max_gpus}
    return sorted(g for g in counts
                  if g <= gpus_per_node or g % gpus_per_node == 0)


def budget_plan(workload: Workload, profile: HardwareProfile, max_gpus: int, gpus_per_node: int,
                tokens: float, deadline_hours: float, objective: str,
                energy: dict | None = None, gpu_hour_price: float = 0.0) -> dict:
    """The GPU count and layout that minimise ``objective`` for ``tokens`` tokens within
    ``deadline_hours`` (see the module doc); a JSON-ready dict."""
    if tokens <= 0 or deadline_hours <= 0:
        raise ConfigError("--tokens and --deadline-hours must be positive.")
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}.")
    per_count = []
    for gpus in gpu_counts(max_gpus, gpus_per_node):
        try:
            result = plan(workload, Cluster(profile, gpus, gpus_per_node), 5, energy,
                          explain=False)
        except ConfigError:  # no layout of this many GPUs divides the batch
            continue
        if not result.candidates:
            continue
        totals = [(row, run_totals(row, tokens, gpus, gpu_hour_price))
                  for row in result.candidates]
        meeting = [rt for rt in totals if rt[1]["hours"] <= deadline_hours]
        pool = meeting or totals
        best = min(pool, key=lambda rt: (objective_value(rt[0], objective, gpu_hour_price),
                                         rt[1]["hours"]))
        per_count.append({**best[1], "meets_deadline": bool(meeting), "candidate": best[0]})
    answer: dict = {"objective": objective, "tokens": tokens, "deadline_hours": deadline_hours,
                    "max_gpus": max_gpus, "by_gpu_count": per_count, "chosen": None,
                    "time_optimal": None, "message": None}
    meeting = [c for c in per_count if c["meets_deadline"]]
    if not per_count:
        answer["message"] = (f"nothing fits in memory on any power-of-two count up to "
                             f"{max_gpus} GPUs; run meshtrain plan --gpus {max_gpus} for why.")
        return answer
    if not meeting:
        fastest = min(per_count, key=lambda c: c["hours"])
        needed = 2 ** math.ceil(math.log2(fastest["gpus"] * fastest["hours"] / deadline_hours))
        answer["message"] = (
            f"no layout on up to {max_gpus} GPUs trains {tokens:.3g} tokens within "
            f"{deadline_hours:g} h: the fastest ({fastest['gpus']} GPUs) takes "
            f"{fastest['hours']:,.0f} h. A deadline of at least {math.ceil(fastest['hours']):,} "
            f"h would do, or about {needed:,} GPUs (linear scaling from the fastest; more GPUs "
            "usually scale worse, so check with --gpus).")
        return answer
    key = {"energy": "kwh", "carbon": "co2_t", "cost": "cost", "time": "hours"}[objective]
    answer["chosen"] = min(meeting, key=lambda c: (c[key], c["hours"]))
    answer["time_optimal"] = min(meeting, key=lambda c: (c["hours"], c["kwh"]))
    return answer


def _layout_text(c: dict) -> str:
    row = c["candidate"]
    text = f"dp{row['dp']} tp{row['tp']} pp{row['pp']} cp{row['cp']} z{row['zero']}"
    if row["pp"] > 1:
        text += f" {row['schedule']}" + (f" v{row['virtual_stages']}"
                                         if row["virtual_stages"] > 1 else "")
    return text + f" {row['activation_checkpointing']}"


def format_budget_plan(answer: dict, title: str) -> str:
    """A table of each GPU count's best layout with run totals, and the verdict."""
    lines = [title, f"objective {answer['objective']}: {answer['tokens']:.3g} tokens within "
                    f"{answer['deadline_hours']:g} h, up to {answer['max_gpus']} GPUs",
             f"{'gpus':>5}  {'layout':<38} {'hours':>8} {'MWh':>9} {'cost':>12} "
             f"{'t CO2':>8}  deadline"]
    for c in answer["by_gpu_count"]:
        lines.append(f"{c['gpus']:>5}  {_layout_text(c):<38} {c['hours']:>8,.0f} "
                     f"{c['kwh'] / 1000:>9,.1f} {c['cost']:>12,.0f} {c['co2_t']:>8,.1f}  "
                     + ("meets" if c["meets_deadline"] else "misses"))
    if answer["message"]:
        return "\n".join(lines + [answer["message"]])
    chosen, fastest = answer["chosen"], answer["time_optimal"]
    lines.append(f"chosen: {chosen['gpus']} GPUs, {_layout_text(chosen)}: "
                 f"{chosen['hours']:,.0f} h, {chosen['kwh'] / 1000:,.1f} MWh, "
                 f"{chosen['cost']:,.0f} cost, {chosen['co2_t']:,.1f} t CO2")
    saved = 1 - chosen["kwh"] / fastest["kwh"] if fastest["kwh"] else 0.0
    lines.append(f"time-optimal: {fastest['gpus']} GPUs, {fastest['hours']:,.0f} h, "
                 f"{fastest['kwh'] / 1000:,.1f} MWh; the chosen plan uses {saved:.1%} less "
                 f"energy ({(fastest['kwh'] - chosen['kwh']) / 1000:,.1f} MWh) and takes "
                 f"{chosen['hours'] / fastest['hours'] - 1:+.1%} time")
    return "\n".join(lines)
