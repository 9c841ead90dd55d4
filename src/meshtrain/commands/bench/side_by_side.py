"""Each side's step phase by phase, with meshtrain's trainer and its peer in the same processes.

``python benchmarks/side_by_side.py [--suite dp] [--suite pp] [--rounds 10] [--warmup 2]
[--set SECTION.KEY=VALUE ...]``

:mod:`.layout_profile` runs each side in fresh processes one after the other, so a virtual
machine's drift between the two runs lands in the comparison. Here both sides are built in the
same processes (meshtrain's :class:`~meshtrain.training.trainer.Trainer` and the suite's peer:
DDP around the same model for ``dp``, ``Schedule1F1B`` for ``pp``) and take turns, ``A B B A``
in every round, after a barrier each, so drift falls on both alike.

Each phase is timed with ``time.perf_counter`` around the function that does it: for meshtrain
its trainer's, engine's and optimizer's own methods, wrapped on the instances (and
:func:`meshtrain.training.straggler.exchange`, restored afterwards); for the peer the parts of
its plain loop (the ``phase`` argument of :func:`.peers.make_step` and
:func:`.parallel_peers.pipelining_step`) and, for ``pp``, its ``PipelineStage``'s forward and
backward of each micro-batch. What no phase covers is ``rest``.

Printed: one JSON line per suite, rank and side with the median per step of every phase in
milliseconds, ``step`` (the whole step) and ``cpu`` (the step's ``process_time``), and for
``pp`` ``actions``: the median time of one micro-batch's ``F``, ``B``, ``I`` or ``W``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from collections import defaultdict

SIDE_BY_SIDE_SUITES = ("dp", "pp")
"""The suites whose peer can share meshtrain's processes (and train the same model)."""

MESHTRAIN_PHASES = (  # (owner attribute path, method, phase name)
    ("trainer", "_global_token_count", "token count"),
    ("trainer", "_forward_backward", "forward and backward"),
    ("pipeline", "run", "pipeline schedule"),
    ("engine", "end_microbatch", "gradient reduction"),
    ("engine", "sync_all", "gradient reduction"),
    ("optimizer", "clip_grad_norm", "clipping"),
    ("optimizer", "step", "AdamW"),
    ("optimizer", "zero_grad", "zero_grad"),
)
"""meshtrain's timed methods. ``sync_all`` (pipelines) calls ``end_microbatch``; the clock counts
only the outermost of nested phases, so the reduction is not counted twice."""


class PhaseClock:
    """Per-step durations of named phases, and of single actions, for one side."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.actions: dict[str, list[float]] = defaultdict(list)
        self._current: dict[str, float] = defaultdict(float)
        self._depth = 0
        self._undo: list[tuple[object, str, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as part of phase ``name`` of the running step (outermost only)."""
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._current[name] += time.perf_counter() - start

    def wrap(self, owner, attr: str, name: str, action: bool = False) -> None:
        """Replace ``owner.attr`` by a timed call of it (phase ``name``, or with ``action`` one
        action of kind ``name``); :meth:`restore` puts it back."""
        original = getattr(owner, attr)
        own = attr in vars(owner)

        def timed(*args, **kwargs):
            if action:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.actions[name].append(time.perf_counter() - start)
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original if own else None))

    def restore(self) -> None:
        """Undo every :meth:`wrap`."""
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()

    def run_step(self, step) -> None:
        """Run ``step()`` and record its phases, wall time and CPU time."""
        self._current = defaultdict(float)
        start, cpu = time.perf_counter(), time.process_time()
        step()
        record = dict(self._current)
        record["step"] = time.perf_counter() - start
        record["cpu"] = time.process_time() - cpu
        record["rest"] = record["step"] - sum(self._current.values())
        self.steps.append(record)

    def summary(self) -> dict:
        """Medians in milliseconds: ``phases`` per step, ``actions`` per action."""
        names = {name for record in self.steps for name in record}
        phases = {name: _ms(statistics.median(r.get(name, 0.0) for r in self.steps))
                  for name in sorted(names)}
        actions = {kind: _ms(statistics.median(times)) for kind, times in self.actions.items()}
        return {"phases": phases, "actions": actions}

    def clear(self) -> None:
        """Forget what was recorded (after the warm-up)."""
        self.steps.clear()
        self.actions.clear()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


def _time_meshtrain(trainer, clock: PhaseClock) -> None:
    """Wrap meshtrain's phases (:data:`MESHTRAIN_PHASES`) and, under a pipeline, record each
    action of the executor's own timeline."""
    import meshtrain.training.straggler as straggler

    owners = {"trainer": trainer, "pipeline": trainer.pipeline, "engine": trainer.engine,
              "optimizer": trainer.optimizer}
    for owner, method, name in MESHTRAIN_PHASES:
        if owners[owner] is not None:
            clock.wrap(owners[owner], method, name)
    clock.wrap(straggler, "exchange", "straggler exchange")
    executor = trainer.pipeline
    if executor is None:
        return
    run = executor.run

    def recorded_run(*args, **kwargs):
        executor.record_events = True  # off again before the trainer would write the files
        try:
            return run(*args, **kwargs)
        finally:
            executor.record_events = False
            for _, action, start, end in executor.events:
                if action.kind.is_compute:
                    clock.actions[action.kind.name].append(end - start)

    executor.run = recorded_run


def side_by_side_worker(suite: str, config_dict: dict, warmup: int, rounds: int) -> list[dict]:
    """One rank: build meshtrain's trainer and the ``suite``'s peer, alternate their steps
    ``A B B A`` for ``rounds`` rounds after ``warmup`` steps each; return both sides' summaries."""
    import torch.distributed as dist

    from meshtrain.commands.bench.parallel_peers import pipelining_step
    from meshtrain.commands.bench.peers import ddp_step, meshtrain_model, model_logits
    from meshtrain.commands.bench.workers import load_bench_config, preload_tokens
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = load_bench_config(config_dict)
    preload_tokens(config)
    trainer = Trainer(config, build_mesh(config))
    ours, theirs = PhaseClock(), PhaseClock()
    if suite == "dp":
        peer = ddp_step(config, meshtrain_model, model_logits, phase=theirs.phase)
    else:
        peer, stage = pipelining_step(config, phase=theirs.phase)
        theirs.wrap(stage, "forward_one_chunk", "F", action=True)
        theirs.wrap(stage, "backward_one_chunk", "B", action=True)
    _time_meshtrain(trainer, ours)
    index = itertools.count()  # the peer's step number (its learning-rate schedule)
    sides = {"meshtrain": (ours, trainer.train_step), "peer": (theirs, lambda: peer(next(index)))}
    try:
        for _ in range(warmup):
            for clock, step in sides.values():
                clock.run_step(step)
        ours.clear()
        theirs.clear()
        for _ in range(rounds):
            for side in ("meshtrain", "peer", "peer", "meshtrain"):
                dist.barrier()
                clock, step = sides[side]
                clock.run_step(step)
    finally:
        ours.restore()
        theirs.restore()
    rank = dist.get_rank()
    return [{"suite": suite, "rank": rank, "side": side, **clock.summary()}
            for side, (clock, _) in sides.items()]


def side_by_side(suites: list[str], overrides: list[str], warmup: int, rounds: int):
    """Yield every rank's two summaries (:func:`side_by_side_worker`) for each suite."""
    from meshtrain.commands.bench.base import THREADS_PER_PROCESS, bench_config
    from meshtrain.commands.bench.runner import resolve_suites
    from meshtrain.host.allocator import allocator_environment
    from meshtrain.host.local_processes import run_distributed

    for name in suites:
        if name not in SIDE_BY_SIDE_SUITES:
            raise ValueError(f"suite {name!r} cannot run side by side; valid: "
                             f"{', '.join(SIDE_BY_SIDE_SUITES)}")
    for suite in resolve_suites(suites):
        name = suite.name
        config, world = bench_config(suite, overrides, warmup + 2 * rounds)
        with allocator_environment():
            ranks = run_distributed(world, side_by_side_worker, name, config.to_dict(), warmup,
                                    rounds, timeout=1800, threads=THREADS_PER_PROCESS)
        for summaries in ranks:
            yield from summaries


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per suite, rank and side."""
    parser = argparse.ArgumentParser(prog="python benchmarks/side_by_side.py")
    parser.add_argument("--suite", dest="suites", action="append", default=[],
                        choices=SIDE_BY_SIDE_SUITES, help="dp and/or pp (default: both)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="rounds of A B B A (each side steps twice a round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override the benchmarked shape")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    for summary in side_by_side(args.suites or list(SIDE_BY_SIDE_SUITES), args.overrides,
                                args.warmup, args.rounds):
        print(json.dumps(summary), flush=True)
    return 0
