"""``meshtrain verify``: train a layout and a one-process reference on the same data and initial
weights, and compare their loss and gradient-norm curves and, at the first step, every
parameter's full gradient (:mod:`meshtrain.commands.verify_grads`: 1e-5 relative per tensor in
fp32, each failure naming the parameter).

The reference runs the same model, data, seed and optimizer with every parallel degree at 1 and
ZeRO off, in this process. It uses ``dp × microbatches`` micro-batches, which groups the global
batch's sequences exactly as the layout's ranks do (rank r's micro-batch j is the reference's
micro-batch r·microbatches + j), so even per-micro-batch quantities (the MoE aux loss) agree.

Default tolerance (fp32): 2e-4 absolute on the loss and 1e-3 relative on the gradient norm.
Summing the same terms in another order and across ranks changes fp32 results by ~1e-6 per step,
and AdamW amplifies tiny gradient differences for parameters whose second moment is near zero, so
a few steps drift by up to ~1e-5; 2e-4 leaves margin while any real bug (a missed reduction, a
wrong normalisation, a stale shard) shows up as differences of 1e-2 or more. The curves are
the coarse check; the strict one is the first step's per-parameter gradients (1e-5 relative per
tensor in fp32, :mod:`meshtrain.commands.verify_grads`), taken before any optimizer step can
amplify a difference.

bf16 (``train.precision = "bf16"``): the layout runs in bf16 as a GPU user runs it (bf16
parameters and activations, fp32 master weights, and gradients accumulated and reduced in fp32
unless ``parallel.grad_reduce_dtype = bf16``) and is compared with the *fp32* one-process
reference, so the report says how far bf16 training is from the exact answer, not from another
bf16 run. bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation), which
moves a loss of ~6 by up to ~1.5e-2 and the gradient norm by up to ~3 % over five steps on the
tiny models of the tests. The default bf16 tolerances are 5e-2 on the loss and 5e-2 relative on
the gradient norm (measured differences are in ``docs/parallelism.md``); a dropped reduction or a
wrong scale moves the gradient norm by a factor (sqrt 2 or 2 at dp 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

from meshtrain.commands.verify_grads import (
    GRAD_ATOL_BF16,
    GRAD_ATOL_FP32,
    GRAD_RTOL_BF16,
    GRAD_RTOL_FP32,
    Gradients,
    capture_first_gradients,
    compare_gradients,
    describe_failures,
    merge_gradients,
)
from meshtrain.config import Config, ConfigError, config_from_dict

LOSS_TOLERANCE_FP32 = 2e-4
GRAD_NORM_RTOL_FP32 = 1e-3
LOSS_TOLERANCE_BF16 = 5e-2
GRAD_NORM_RTOL_BF16 = 5e-2


def reference_config(config: Config) -> Config:
    """The one-process configuration that ``config``'s layout must reproduce: every degree 1,
    and fp32 (a bf16 layout is measured against the exact answer)."""
    ref = copy.deepcopy(config)
    ref.train.precision = "fp32"
    ref.train.compile = False
    par = ref.parallel
    par.grad_reduce_dtype = "fp32"
    par.microbatches = max(config.parallel.dp, 1) * config.parallel.microbatches
    par.dp = par.tp = par.pp = par.ep = par.cp = 1
    par.ep_rebalance_every = 0  # placement moves experts between ep ranks: none here
    par.zero = 0
    par.sequence_parallel = False
    par.virtual_stages = 1
    return ref


def worker_trainer(config_dict: dict):
    """This worker's :class:`~meshtrain.training.trainer.Trainer` for ``config_dict``, on the
    thread count ``MESHTRAIN_THREADS`` asks for (when set)."""
    import torch

    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    threads = os.environ.get("MESHTRAIN_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return Trainer(config, build_mesh(config))


def train_steps(config_dict: dict, steps: int) -> list[dict]:
    """Run ``steps`` training steps in this process (a worker of the job); return the metric
    records on the logging rank, an empty list elsewhere."""
    trainer = worker_trainer(config_dict)
    records = [trainer.train_step() for _ in range(steps)]
    return records if trainer.mesh.is_logging_rank else []


def train_steps_and_gradients(config_dict: dict, steps: int) -> tuple[list[dict], Gradients]:
    """:func:`train_steps`, also gathering the first step's full gradients (before clipping):
    ``(records on the logging rank or [], the gradients this rank gathered)``."""
    trainer = worker_trainer(config_dict)
    gradients = capture_first_gradients(trainer)
    records = [trainer.train_step() for _ in range(steps)]
    return (records if trainer.mesh.is_logging_rank else []), gradients


def run_layout_with_gradients(config: Config, world_size: int, steps: int,
                              timeout: float = 900) -> tuple[list[dict], Gradients]:
    """:func:`run_layout` that also returns the first step's gradients gathered on every rank
    (:func:`~meshtrain.commands.verify_grads.merge_gradients`); a world of 1 runs in-process."""
    if world_size == 1:
        return train_steps_and_gradients(config.to_dict(), steps)
    from meshtrain.host.local_processes import run_distributed

    results = run_distributed(world_size, train_steps_and_gradients, config.to_dict(), steps,
                              timeout=timeout, threads=max(config.train.threads_per_worker, 1))
    return results[0][0], merge_gradients([gradients for _, gradients in results])


def run_layout(config: Config, world_size: int, steps: int, timeout: float = 900,
               spawn_single: bool = False) -> list[dict]:
    """Train ``config`` for ``steps`` steps on ``world_size`` local processes (one in-process
    when the world is 1, unless ``spawn_single``); return rank 0's metric records."""
    if world_size == 1 and not spawn_single:
        return train_steps(config.to_dict(), steps)
    from meshtrain.host.local_processes import run_distributed

    results = run_distributed(world_size, train_steps, config.to_dict(), steps, timeout=timeout,
                              threads=max(config.train.threads_per_worker, 1))
    return results[0]


def compare(layout: list[dict], reference: list[dict], loss_tol: float,
            grad_norm_rtol: float) -> dict:
    """The verify report: both curves, the largest differences and the verdict."""
    loss_l = [r["loss"] for r in layout]
    loss_r = [r["loss"] for r in reference]
    gn_l = [r["grad_norm"] for r in layout]
    gn_r = [r["grad_norm"] for r in reference]
    loss_diff = max(abs(a - b) for a, b in zip(loss_l, loss_r, strict=True))
    gn_diff = max(abs(a - b) for a, b in zip(gn_l, gn_r, strict=True))
    gn_ok = all(abs(a - b) <= grad_norm_rtol * max(abs(b), 1e-12)
                for a, b in zip(gn_l, gn_r, strict=True))
    return {
        "max_abs_loss_diff": loss_diff,
        "max_abs_grad_norm_diff": gn_diff,
        "tolerance": loss_tol,
        "grad_norm_rtol": grad_norm_rtol,
        "ok": bool(loss_diff <= loss_tol and gn_ok),
        "layout_losses": loss_l,
        "reference_losses": loss_r,
        "layout_grad_norms": gn_l,
        "reference_grad_norms": gn_r,
    }


def verify(config: Config, world_size: int, steps: int, loss_tol: float | None = None,
           grad_norm_rtol: float | None = None) -> dict:
    """Run the layout and its reference and compare them."""
    if config.parallel.replicas != 1:
        raise ConfigError(f"parallel.replicas = {config.parallel.replicas}: DiLoCo replica groups "
                          "do not reproduce one process (AdamW steps are averaged, not their "
                          "gradients; docs/diloco.md); verify one group's layout with "
                          "parallel.replicas = 1, the valid value here.")
    bf16 = config.train.precision == "bf16"
    loss_tol = loss_tol if loss_tol is not None else (
        LOSS_TOLERANCE_BF16 if bf16 else LOSS_TOLERANCE_FP32)
    grad_norm_rtol = grad_norm_rtol if grad_norm_rtol is not None else (
        GRAD_NORM_RTOL_BF16 if bf16 else GRAD_NORM_RTOL_FP32)
    layout, layout_grads = run_layout_with_gradients(config, world_size, steps)
    reference, reference_grads = run_layout_with_gradients(reference_config(config), 1, steps)
    report = compare(layout, reference, loss_tol, grad_norm_rtol)
    report["gradients"] = compare_gradients(
        layout_grads, reference_grads, GRAD_RTOL_BF16 if bf16 else GRAD_RTOL_FP32,
        GRAD_ATOL_BF16 if bf16 else GRAD_ATOL_FP32)
    report["ok"] = report["ok"] and report["gradients"]["ok"]
    par = config.parallel
    report["layout"] = {"world_size": world_size, "dp": par.dp, "tp": par.tp, "pp": par.pp,
                        "ep": par.ep, "cp": par.cp, "zero": par.zero,
                        "microbatches": par.microbatches,
                        "precision": config.train.precision}
    report["steps"] = steps
    return report


def format_report(report: dict) -> str:
    """A human-readable table of both curves and the verdict."""
    lay = report["layout"]
    lines = [f"layout: world {lay['world_size']} (dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} "
             f"ep={lay['ep']} cp={lay['cp']} zero={lay['zero']} "
             f"microbatches={lay['microbatches']}, "
             f"{lay['precision']}) vs one process",
             f"{'step':>4}  {'loss (layout)':>14}  {'loss (1 proc)':>14}  {'|diff|':>9}  "
             f"{'gnorm (layout)':>14}  {'gnorm (1 proc)':>14}"]
    rows = zip(report["layout_losses"], report["reference_losses"],
               report["layout_grad_norms"], report["reference_grad_norms"], strict=True)
    for step, (a, b, ga, gb) in enumerate(rows, start=1):
        lines.append(f"{step:>4}  {a:>14.6f}  {b:>14.6f}  {abs(a - b):>9.2e}  {ga:>14.6f}  "
                     f"{gb:>14.6f}")
    verdict = "OK" if report["ok"] else "MISMATCH"
    grads = report.get("gradients")
    if grads is not None:
        worst = grads["worst"][0]["name"] if grads["worst"] else "-"
        lines.append(f"step-1 gradients of {grads['parameters']} parameters: largest relative "
                     f"difference {grads['max_rel_diff']:.2e} ({worst}; tolerance "
                     f"{grads['grad_rtol']:.0e} per tensor)")
        failures = describe_failures(grads)
        if failures:
            lines.append(failures)
    lines.append(f"max |loss diff| {report['max_abs_loss_diff']:.3e} (tolerance "
                 f"{report['tolerance']:.1e}); max |grad-norm diff| "
                 f"{report['max_abs_grad_norm_diff']:.3e} (relative tolerance "
                 f"{report['grad_norm_rtol']:.1e}): {verdict}")
    return "\n".join(lines)


def to_json(report: dict) -> str:
    """The ``--json`` document."""
    return json.dumps(report)


def run_verify(args: argparse.Namespace) -> int:
    """``meshtrain verify``: exit 0 when the layout matches one process, 1 when it does not."""
    from meshtrain.commands.train import resolve_run_config

    steps_given = args.steps
    config, world = resolve_run_config(args)
    steps = steps_given if steps_given is not None else 5
    report = verify(config, world, steps, loss_tol=args.tolerance)
    print(to_json(report) if args.json else format_report(report))
    return 0 if report["ok"] else 1
