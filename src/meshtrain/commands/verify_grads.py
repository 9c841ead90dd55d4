"""Per-parameter gradient parity: the first step's full gradients of a layout against one process.

The loss and the gradient norm can agree while a gradient is wrong: a missed or extra scale on
one tensor moves the norm by little when the tensor is small, and AdamW normalises a per-tensor
scale away, so the losses barely move either. ``meshtrain verify`` (and the tests' parity
helpers) therefore also compare, after the first step's backward and reduction and before
clipping and the optimizer step, **every parameter's full gradient**, gathered from its shards
(ZeRO shards over dp, expert slices over ep, tp pieces; :class:`~meshtrain.parallel.gather.
StageTensors` with ``grads = True``), against the one-process gradient of the same parameter.

Every copy is checked: a tp-split tensor as gathered on each tp rank of dp rank 0, a tensor
replicated over tp as each tp rank holds it (so replicas that drifted apart show), each pipeline
stage's own tensors. The comparison is per tensor, relative to the reference tensor's norm::

    || g_layout - g_reference ||_2  <=  rtol * || g_reference ||_2  +  atol * max || g_ref ||_2

``rtol`` (fp32) is :data:`GRAD_RTOL_FP32` = 1e-5. What changes between layouts is only the
order in which the same fp32 terms are summed (token sums split over ranks and micro-batches,
reductions over dp, tp, ep, pipeline stages): each reordered sum moves a result by a few units
of fp32 rounding (2^-24 ≈ 6e-8 relative) of the terms' magnitude, and a gradient passes through
a few dozen such sums between the loss and the weight, so measured differences on the tests'
models are 1e-7 to 6e-7 relative (``docs/parallelism.md``). 1e-5 leaves a margin of more than
ten over that while a missing scale, a doubled reduction, a wrongly routed gradient or a stale
shard is 1e-2 or more. ``atol`` (:data:`GRAD_ATOL_FP32` = 1e-9 times the largest reference
tensor norm) only keeps a tensor whose reference gradient is (nearly) zero from failing on
rounding noise; it is far below any real tensor's norm, so a small tensor (a norm weight, a
bias) is held to the same relative tolerance as a large one.

bf16 layouts are compared with the fp32 reference at :data:`GRAD_RTOL_BF16` = 0.1: bf16 keeps 8
significant bits, so a gradient computed from bf16 activations is about 1e-2 off (measured up to
1.7e-2, the router's, on the tests' models); the check still catches gradients off by a factor.

The gathered gradients are copied to host memory (one full fp32 copy of the model's gradients on
the process that compares them), which suits the models ``verify`` is meant for.
"""

from __future__ import annotations

import numpy

GRAD_RTOL_FP32 = 1e-5
GRAD_ATOL_FP32 = 1e-9
GRAD_RTOL_BF16 = 1e-1
GRAD_ATOL_BF16 = 1e-4

Gradients = list[tuple[str, int, numpy.ndarray]]
"""``(parameter name, tp rank of the copy, full fp32 gradient)`` entries of one rank (numpy
arrays: they travel from worker processes by value)."""


def gather_gradients(trainer) -> Gradients:
    """The full gradient of every parameter this rank's copy of which is complete after the
    gather (the pipeline stage's dp-rank-0 ranks; an empty list elsewhere). A collective over
    the stage's ranks; call it after the step's gradients are reduced (``compute_gradients``).
    The bytes it moves are left out of the step's ``comm_bytes``."""
    from meshtrain.parallel.gather import StageTensors

    mesh = trainer.mesh
    log = mesh.comm_log
    saved = dict(log.bytes), dict(log.calls)
    out: Gradients = []
    for spec, value in StageTensors(trainer.model, trainer.engine, mesh, grads=True):
        if value is not None:
            out.append((spec.name, mesh.tp_rank, value.detach().float().cpu().numpy().copy()))
    log.bytes.clear()
    log.bytes.update(saved[0])
    log.calls.clear()
    log.calls.update(saved[1])
    return out


def capture_first_gradients(trainer) -> Gradients:
    """Make ``trainer`` gather its gradients once, on the next step, right after they are
    reduced (before clipping and the optimizer step); returns the list that will hold them."""
    captured: Gradients = []
    compute = trainer.compute_gradients
    done = []

    def compute_and_capture(*args, **kwargs):
        result = compute(*args, **kwargs)
        if not done:
            done.append(True)
            captured.extend(gather_gradients(trainer))
        return result

    trainer.compute_gradients = compute_and_capture
    return captured


def merge_gradients(per_rank: list[Gradients]) -> Gradients:
    """Every rank's entries in one list (a pipeline stage's tensors live on its own ranks)."""
    return [entry for entries in per_rank for entry in entries]


def compare_gradients(layout: Gradients, reference: Gradients, rtol: float,
                      atol: float) -> dict:
    """Compare every gathered copy in ``layout`` with the reference gradient of its name.

    Returns ``{"ok", "grad_rtol", "grad_atol", "max_rel_diff", "worst": [...],
    "failures": [...]}``: ``worst`` holds the ten copies with the largest relative
    difference and ``failures`` every copy over tolerance (and every parameter missing on
    either side), each ``{"name", "tp_rank", "rel_diff", "abs_diff", "ref_norm"}``."""
    expected = {name: numpy.asarray(grad, dtype=numpy.float64) for name, _, grad in reference}
    scale = max((float(numpy.linalg.norm(g)) for g in expected.values()), default=0.0)
    floor = atol * scale
    rows, failures = [], []
    seen = set()
    for name, tp_rank, grad in layout:
        grad = numpy.asarray(grad, dtype=numpy.float64)
        seen.add(name)
        ref = expected.get(name)
        if ref is None or tuple(ref.shape) != tuple(grad.shape):
            failures.append({"name": name, "tp_rank": tp_rank, "rel_diff": float("inf"),
                             "abs_diff": float("inf"), "ref_norm": 0.0,
                             "problem": "not in the reference" if ref is None else
                             f"shape {tuple(grad.shape)} != {tuple(ref.shape)}"})
            continue
        diff = float(numpy.linalg.norm(grad - ref))
        norm = float(numpy.linalg.norm(ref))
        rel = diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))
        row = {"name": name, "tp_rank": tp_rank, "rel_diff": rel, "abs_diff": diff,
               "ref_norm": norm}
        rows.append(row)
        if not diff <= rtol * norm + floor:
            failures.append(row)
    for name in expected:
        if name not in seen:
            failures.append({"name": name, "tp_rank": 0, "rel_diff": float("inf"),
                             "abs_diff": float("inf"),
                             "ref_norm": float(numpy.linalg.norm(expected[name])),
                             "problem": "no gradient gathered from the layout"})
    rows.sort(key=lambda r: -r["rel_diff"])
    return {"ok": not failures, "grad_rtol": rtol, "grad_atol": atol,
            "max_rel_diff": rows[0]["rel_diff"] if rows else 0.0,
            "parameters": len(expected), "worst": rows[:10], "failures": failures}


def describe_failures(report: dict) -> str:
    """One line per failing parameter copy (empty when the gradients match)."""
    lines = []
    for row in report["failures"]:
        problem = row.get("problem") or (f"relative difference {row['rel_diff']:.2e} > "
                                         f"{report['grad_rtol']:.0e}")
        lines.append(f"gradient of {row['name']} (tp rank {row['tp_rank']}): {problem}")
    return "\n".join(lines)
