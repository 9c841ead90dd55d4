"""The trainer's side of ``parallel.replan_every``: time the steps, then act on the decision.

Each rank's comm layer splits the seconds it spends in collectives by axis
(``CommLog.wait_by_axis``: blocking calls, and waits on async ones). The monitor skips the first
step this process runs (warm-up: allocations, first-call costs), then adds up ``K`` steps: their
step time and each axis's seconds. After the ``K``-th it makes one all-reduce over the world, so
every rank holds the mean per rank and step, and rank 0 decides
(:func:`meshtrain.replan.on_measurement.decide`)
and shares the decision with one small all-gather; every rank then acts on the same one. It
measures once per start, and not at all once the run has relaunched ``parallel.replan_max``
times.
"""

from __future__ import annotations

import sys

import torch

RUNTIME_AXES = ("dp", "tp", "pp", "ep", "cp", "edp")
"""The comm names (``comm_bytes`` keys) whose seconds are measured; ``world`` and ``replica``
(the run's own bookkeeping and DiLoCo's rounds) are not part of a layout's price."""


class ReplanMonitor:
    """Measures ``every`` steps after a warm-up step and returns rank 0's decision."""

    def __init__(self, config, mesh, done: int):
        self.config, self.mesh, self.done = config, mesh, done
        self.every = config.parallel.replan_every
        self.seen = 0
        self.totals = torch.zeros(1 + len(RUNTIME_AXES), dtype=torch.float64)
        """Sums over the measured steps: step seconds, then each of :data:`RUNTIME_AXES`."""

    @classmethod
    def build(cls, config, mesh) -> ReplanMonitor | None:
        """A monitor when ``parallel.replan_every`` is on and relaunches are left, else None."""
        if not config.parallel.replan_every:
            return None
        from meshtrain.replan.on_measurement import replans_done

        done = replans_done(config)
        return cls(config, mesh, done) if done < config.parallel.replan_max else None

    def observe(self, record: dict) -> dict | None:
        """Count the step ``record`` describes (its ``step_time_s``, and the comm log's per-axis
        seconds, still those of this step); after the last measured step return the decision
        (the ``replan`` record, the same on every rank), else None. A collective on that step."""
        self.seen += 1
        if self.seen == 1 or self.seen > self.every + 1:
            return None
        waits = self.mesh.comm_log.wait_by_axis
        self.totals += torch.tensor([record["step_time_s"]]
                                    + [waits.get(axis, 0.0) for axis in RUNTIME_AXES],
                                    dtype=torch.float64)
        if self.seen < self.every + 1 or record["step"] >= self.config.train.steps:
            return None
        return self._decide(record["step"])

    def _decide(self, step: int) -> dict:
        world = self.mesh.comm("world")
        totals = self.totals.to(self.mesh.device)
        world.all_reduce(totals)
        means = (totals / (self.mesh.world_size * self.every)).cpu().tolist()
        decision = None
        if self.mesh.rank == 0:
            from meshtrain.replan.on_measurement import decide

            measured = {"steps": self.every, "step_s": means[0],
                        "axes": dict(zip(RUNTIME_AXES, means[1:], strict=True))}
            try:
                decision = decide(self.config, self.mesh.world_size, step, measured, self.done)
            except Exception as error:  # the others wait for this rank's decision: never hang
                why = f"re-planning failed: {type(error).__name__}: {error}"
                decision = {"after_step": step, "measured_step_s": means[0],
                            "decision": "keep", "why": why,
                            "message": f"meshtrain: replan: after step {step}: {why}; "
                                       f"keeping the layout"}
        if world.active:
            decision = world.all_gather_json(decision)[0]  # a JSON record (replan.json)
        if self.mesh.is_logging_rank:
            print(decision["message"], file=sys.stderr, flush=True)
        return {key: value for key, value in decision.items() if key != "message"}

    def relaunch_after(self, trainer, decision: dict, saved) -> bool:
        """When ``decision`` says relaunch: make sure this step's checkpoint exists (``saved``:
        its path when ``checkpoint.every`` just wrote it), keep the decision with its path in
        ``trainer.replanned`` and return True (the run stops here); else False."""
        if decision["decision"] != "relaunch":
            return False
        path = saved if saved is not None else trainer.save_checkpoint_path()
        trainer.replanned = {**decision, "step": trainer.step, "checkpoint": str(path)}
        return True
