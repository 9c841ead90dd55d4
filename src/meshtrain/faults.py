"""Test-only fault injection, so the failure paths can be exercised on purpose.

Set ``MESHTRAIN_FAULT`` in the environment of a run (it reaches every worker) to a comma-separated
list of faults, each ``KIND:key=value:key=value``. **Never set it in a real run.**

================  ===========================================================================
kind              effect
================  ===========================================================================
skip_collective   at ``step`` on ``rank``, the first collective (on ``axis``, if given) is not
                  issued. ``then=stall`` (default): the rank then stops there (sleeps), like a
                  rank stuck before a collective, so the others wait in it until
                  ``train.collective_timeout_s``. ``then=continue``: it carries on with its next
                  collective, which is out of step with the others' (what
                  ``train.debug_collectives`` catches).
nan_loss          at ``step`` (on ``rank``, or every rank when omitted) the loss becomes NaN, so
                  its gradients do too (exercises ``train.on_nonfinite``).
kill              at the start of ``step`` on ``rank`` the worker sends itself SIGKILL.
slow              from ``step`` on (default 1), ``rank``'s compute takes ``factor`` times as
                  long: after computing its gradients it sleeps ``factor - 1`` times the time
                  that took outside collectives (a straggler, for ``train.straggler_factor``).
hold              at the start of ``step`` (on ``rank``, or every rank when omitted) the worker
                  waits until the file ``file`` exists (a test holds a running replica group
                  back until a restarted one is joining).
slow_axis         from ``step`` on (default 1), every collective of ``axis`` (on ``rank``, or
                  every rank when omitted) waits ``ms`` milliseconds before it is issued, inside
                  the collective's timing: a slow link on that axis (for
                  ``parallel.replan_every``).
poison_outer      from inner step ``step`` on, every DiLoCo pseudo-gradient replica group
                  ``replica`` sends (on ``rank``, or every rank of the group when omitted) is
                  corrupted before the outer update screens it: ``mode=nan`` all NaN,
                  ``mode=scale`` times ``factor``, ``mode=noise`` random values with ``factor``
                  times its norm (docs/diloco.md, "Robust outer updates").
================  ===========================================================================

Every fault fires only in restart ``attempt`` (default 0, the first run; torch elastic counts
restarts in ``TORCHELASTIC_RESTART_COUNT``), so a restarted job runs clean. Steps are 1-based, as
in ``metrics.jsonl``. Examples: ``MESHTRAIN_FAULT=skip_collective:rank=1:step=2``,
``MESHTRAIN_FAULT=slow:rank=3:factor=3``, ``MESHTRAIN_FAULT=slow_axis:axis=tp:ms=40``,
``MESHTRAIN_FAULT=poison_outer:replica=1:step=8:mode=scale:factor=1000``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time

ENV_VAR = "MESHTRAIN_FAULT"
KINDS = ("skip_collective", "nan_loss", "kill", "slow", "hold", "slow_axis", "poison_outer")
_INT_KEYS = ("rank", "step", "attempt", "replica")
POISON_MODES = ("nan", "scale", "noise")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring for the kinds)."""

    kind: str
    step: int
    rank: int | None = None
    axis: str | None = None
    then: str = "stall"
    attempt: int = 0
    factor: float = 1.0
    file: str = ""
    ms: float = 0.0
    replica: int | None = None
    mode: str = ""


def parse(spec: str) -> tuple[Fault, ...]:
    """Parse a ``MESHTRAIN_FAULT`` value; raises ``ValueError`` naming what is malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV_VAR}: unknown fault {kind!r}; kinds: {', '.join(KINDS)}")
        fields: dict[str, object] = {"kind": kind}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in ("rank", "step", "axis", "then", "attempt", "factor",
                                      "file", "ms", "replica", "mode"):
                raise ValueError(f"{ENV_VAR}: bad field {pair!r} in {item!r}")
            fields[key] = (int(value) if key in _INT_KEYS
                           else float(value) if key in ("factor", "ms") else value)
        if kind == "slow":
            fields.setdefault("step", 1)
            if "rank" not in fields or float(fields.get("factor", 0)) < 1:
                raise ValueError(f"{ENV_VAR}: {item!r} needs rank=N and factor=X (X >= 1)")
        if kind == "slow_axis":
            fields.setdefault("step", 1)
            if "axis" not in fields or float(fields.get("ms", 0)) <= 0:
                raise ValueError(f"{ENV_VAR}: {item!r} needs axis=NAME and ms=X (X > 0)")
        if kind == "poison_outer" and ("replica" not in fields
                                       or fields.get("mode") not in POISON_MODES
                                       or (fields["mode"] != "nan" and "factor" not in fields)):
            raise ValueError(f"{ENV_VAR}: {item!r} needs replica=R, step=S and mode=nan, or "
                             "mode=scale or noise with factor=F")
        if "step" not in fields:
            raise ValueError(f"{ENV_VAR}: {item!r} needs step=N")
        if fields.get("then", "stall") not in ("stall", "continue"):
            raise ValueError(f"{ENV_VAR}: then= must be stall or continue in {item!r}")
        if kind == "hold" and not fields.get("file"):
            raise ValueError(f"{ENV_VAR}: {item!r} needs file=PATH")
        if kind in ("skip_collective", "kill") and "rank" not in fields:
            raise ValueError(f"{ENV_VAR}: {item!r} needs rank=N")
        faults.append(Fault(**fields))  # type: ignore[arg-type]
    return tuple(faults)


@functools.cache
def active() -> tuple[Fault, ...]:
    """The faults of this process's environment (parsed once; empty in a normal run)."""
    return parse(os.environ.get(ENV_VAR, ""))


_fired: set[Fault] = set()


def reset() -> None:
    """Forget the parsed environment and which faults fired (for tests that change it)."""
    active.cache_clear()
    _fired.clear()


def current_rank() -> int:
    """This process's global rank as the launcher set it (0 outside a distributed job)."""
    return int(os.environ.get("RANK", "0"))


def restart_attempt() -> int:
    """How many times torch elastic has restarted this job's workers (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def take(kind: str, step: int, axis: str | None = None) -> Fault | None:
    """The fault of ``kind`` due now on this rank, marked as fired (each fires once), or None."""
    if not active():
        return None
    rank, attempt = current_rank(), restart_attempt()
    for fault in active():
        if (fault.kind == kind and fault.step == step and fault not in _fired
                and fault.attempt == attempt and fault.rank in (None, rank)
                and fault.axis in (None, axis)):
            _fired.add(fault)
            return fault
    return None


def skip_collective(step: int, axis: str) -> bool:
    """Called by the comm layer before each collective: True = do not issue this one.

    With ``then=stall`` this never returns: the rank sleeps until it is killed.
    """
    fault = take("skip_collective", step, axis)
    if fault is None:
        return False
    if fault.then == "stall":
        while True:
            time.sleep(3600)
    return True


def corrupt_loss(loss, step: int):
    """``loss`` times NaN when a ``nan_loss`` fault is due at ``step``, else ``loss``."""
    if take("nan_loss", step) is None:
        return loss
    return loss * float("nan")


def at_step_start(step: int) -> None:
    """SIGKILL this process when a ``kill`` fault is due at the start of ``step``; wait for the
    file of a ``hold`` fault due then."""
    if take("kill", step) is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    hold = take("hold", step)
    while hold is not None and not os.path.exists(hold.file):
        time.sleep(0.1)


def slow_factor(step: int) -> float:
    """How many times slower this rank's compute is at ``step`` (``slow`` faults; 1 = normal)."""
    rank, attempt = current_rank(), restart_attempt()
    factor = 1.0
    for fault in active():
        if (fault.kind == "slow" and fault.rank == rank and fault.attempt == attempt
                and step >= fault.step):
            factor *= fault.factor
    return factor


def slow_down(step: int, compute_s: float) -> None:
    """Sleep ``(factor - 1) * compute_s`` when a ``slow`` fault holds for this rank at ``step``."""
    factor = slow_factor(step)
    if factor > 1:
        time.sleep((factor - 1) * compute_s)


def delay_collective(step: int, axis: str) -> float:
    """Called by the comm layer before each collective of ``axis``: sleep as long as the
    ``slow_axis`` faults due for this rank at ``step`` say; returns the seconds slept."""
    rank, attempt = current_rank(), restart_attempt()
    delay = sum(fault.ms for fault in active()
                if fault.kind == "slow_axis" and fault.axis == axis and step >= fault.step
                and fault.attempt == attempt and fault.rank in (None, rank)) / 1000
    if delay > 0:
        time.sleep(delay)
    return delay


def poison_outer(values, step: int, replica: int):
    """``values`` (a DiLoCo pseudo-gradient shard of replica group ``replica`` at the end of
    inner step ``step``) as the ``poison_outer`` faults due there corrupt it (a new tensor), or
    ``values`` itself when none is."""
    import torch

    rank, attempt = current_rank(), restart_attempt()
    for fault in active():
        if (fault.kind != "poison_outer" or fault.replica != replica or step < fault.step
                or fault.attempt != attempt or fault.rank not in (None, rank)):
            continue
        if fault.mode == "nan":
            values = torch.full_like(values, float("nan"))
        elif fault.mode == "scale":
            values = values * fault.factor
        else:
            generator = torch.Generator().manual_seed(step * 100003 + rank)
            noise = torch.randn(values.shape, generator=generator).to(values)
            norm = torch.linalg.vector_norm(values.float())
            values = noise * (fault.factor * norm / torch.linalg.vector_norm(noise).clamp_min(
                1e-30))
    return values
