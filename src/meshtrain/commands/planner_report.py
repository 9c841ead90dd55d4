"""Human-readable output of ``meshtrain estimate`` and ``meshtrain plan``."""

from __future__ import annotations

from meshtrain.planner.cost.fit_advice import format_why_not_fits
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.offload import format_offload


def format_estimate(result: dict, profile_name: str) -> str:
    """A few lines: layout, memory per stage, step time and its breakdown, throughput."""
    lay = result["layout"]
    lines = [
        f"{result['params'] / 1e9:.2f}B parameters on {result['gpus']} x {profile_name}: "
        f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} ep={lay['ep']} "
        f"zero={lay['zero']} "
        f"sp={lay['sequence_parallel']} schedule={lay['schedule']} "
        f"(v={lay['virtual_stages']}) microbatches={lay['microbatches']} x "
        f"{result['micro_batch_size']} seq, checkpointing={lay['activation_checkpointing']}",
        "memory per GPU (GB):   stage  params   grads   optim    acts  buffers  reserve   total",
    ]
    for rank in result["per_rank"]:
        lines.append("                      " + f"{rank['stage']:>5}" + "".join(
            f"{rank.get(k, 0) / GB:>{9 if k == 'reserve_bytes' else 8}.1f}"
            for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes",
                      "buffer_bytes", "reserve_bytes", "total_bytes")))
    verdict = "fits" if result["fits"] else "DOES NOT FIT"
    lines.append(f"peak {result['memory_gb_per_gpu']:.1f} GB of {result['memory_limit_gb']:.1f} "
                 f"GB usable: {verdict}")
    if result.get("offload"):
        lines += format_offload(result["offload"])
    if result.get("why_not_fits"):
        lines += format_why_not_fits(result["why_not_fits"])
    step = result["step_time_s"]
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.3g}s ({v / step:.0%})"
                      for k, v in result["breakdown"].items() if v > 0)
    label = "" if result["fits"] else " (does not fit: not runnable)"
    lines += [
        f"step {step:.3f}s{label}: {parts}",
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['model_tflops_per_gpu']:.0f} model / "
        f"{result['hardware_tflops_per_gpu']:.0f} hardware TFLOP/s per GPU, MFU "
        f"{result['mfu']:.1%}, bubble {result['bubble_fraction']:.1%}, bound: {result['bound']}"
        + label,
        _kernels_line(result),
        f"energy per 1B tokens: {result['kwh_per_1b_tokens']:,.0f} kWh, "
        f"${result['cost_per_1b_tokens']:,.0f}, {result['co2_kg_per_1b_tokens']:,.0f} kg CO2",
    ]
    return "\n".join(lines)


def _kernels_line(result: dict) -> str:
    """The kernel efficiency the estimate used and whose it is (stack entry or profile)."""
    kernels = result["kernel_efficiency"]
    attention = "" if kernels["attention"] is None else f", attention {kernels['attention']:.2f}"
    fp8 = (f"; linear layers in FP8 at {kernels['fp8_gemm']:.0%} of the FP8 peak (MFU is "
           "against the bf16 peak)" if result.get("fp8_linear") else "")
    experts = (f"; MoE layers {kernels['expert_overhead_ns']:.0f} ns a routed token per local "
               "expert beyond their GEMMs" if kernels.get("expert_overhead_ns")
               and result["active_params"] < result["params"] else "")
    return (f"kernels: GEMM at {kernels['gemm']:.0%} of peak{attention} ({kernels['from']})"
            + fp8 + experts)


def format_plan(plan: dict, title: str) -> str:
    """A ranked table of candidates with one line each on what bounds them."""
    listed = len(plan["candidates"])
    dropped = plan.get("resimulated_not_fitting", 0)
    lines = [title, f"{plan['searched']} layouts searched, {plan['feasible']} fit in memory"
             + (f" ({dropped} of the front runners do not once re-priced with the schedule "
                "simulator, and are not listed)" if dropped else "")
             + (f"; the best {listed} are listed." if listed else ".")]
    if plan.get("offload"):
        lines.append(plan["offload"])
    if plan["nothing_fits"]:
        return "\n".join(lines + [plan["nothing_fits"]])
    header = (f"{'#':>2} {'dp':>4} {'tp':>3} {'sp':>2} {'pp':>3} {'cp':>3} {'ep':>3} {'zero':>4} "
              f"{'schedule':<18} "
              f"{'mb':>4} {'mbs':>3} {'ckpt':<9} {'GB':>5} {'step s':>7} {'tok/s':>10} "
              f"{'MFU':>5} {'kWh/1B':>7}")
    lines.append(header)
    for i, c in enumerate(plan["candidates"], 1):
        schedule = c["schedule"] + (f" v{c['virtual_stages']}" if c["virtual_stages"] > 1
                                    else "")
        lines.append(
            f"{i:>2} {c['dp']:>4} {c['tp']:>3} {'y' if c['sequence_parallel'] else '-':>2} "
            f"{c['pp']:>3} {c['cp']:>3} {c['ep']:>3} "
            f"{c['zero']:>4} "
            f"{schedule:<18} {c['microbatches']:>4} {c['micro_batch_size']:>3} "
            f"{c['activation_checkpointing']:<9} {c['memory_gb_per_gpu']:>5.1f} "
            f"{c['step_time_s']:>7.2f} {c['tokens_per_s']:>10,.0f} {c['mfu']:>5.1%} "
            f"{c['kwh_per_1b_tokens']:>7,.0f}")
        lines.append(f"   {c['why']}")
    return "\n".join(lines)
