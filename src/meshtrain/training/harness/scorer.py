"""Harness task scores during training: ``train.eval_tasks`` every ``train.eval_tasks_every``
steps and after the last.

At a scoring step every rank writes its pieces of the weights exactly as it writes the final
weights (:func:`~meshtrain.checkpoint.final_weights.save_final_weights`: gathered over ZeRO-3,
ep and tp, each pipeline stage its own tensors) into ``RUN_DIR/task_eval``; the logging rank then
loads them as one-device model on its own device
(:func:`~meshtrain.checkpoint.one_device.load_model`), scores the tasks with the harness, removes
the directory and puts ``{"tasks": {task: {metric: value}}}`` into that step's record. So the
scores are those of the model ``meshtrain eval`` would load at that step, whatever the layout.

What it costs, at each scoring step: one write and one read of the whole model in float32 on
the run directory's disk, a second copy of the whole model in the logging rank's device memory
while it scores, and the harness's time, during which the other ranks wait at their next
collective: one scoring must finish within ``train.collective_timeout_s``. With DiLoCo replica
groups, group 0's weights are scored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SCRATCH = "task_eval"
"""``RUN_DIR/task_eval``: the gathered weights while the logging rank scores them."""

BATCH_SIZE = 16
"""Requests the harness model runs at once during training."""


class TaskScorer:
    """Scores ``train.eval_tasks`` for a :class:`~meshtrain.training.trainer.Trainer`."""

    def __init__(self, trainer):
        self.trainer = trainer
        train = trainer.config.train
        self.tasks = list(train.eval_tasks)
        self.every = train.eval_tasks_every
        self.total_steps = train.steps
        self.include = train.eval_tasks_include
        self.limit = train.eval_tasks_limit or None

    @classmethod
    def build(cls, trainer) -> TaskScorer | None:
        """The scorer ``train.eval_tasks`` asks for, or None."""
        return cls(trainer) if trainer.config.train.eval_tasks else None

    def due(self, step: int) -> bool:
        """Whether the record of ``step`` (1-based) gets task scores."""
        return step == self.total_steps or bool(self.every and step % self.every == 0)

    def score(self) -> dict:
        """``{"tasks": scores}`` on the logging rank, ``{}`` on the others (a collective: every
        rank calls it)."""
        from meshtrain.checkpoint.final_weights import save_final_weights

        trainer = self.trainer
        out = Path(trainer.run_dir) / SCRATCH
        save_final_weights(trainer.model, trainer.engine, trainer.mesh, out,
                           json.dumps(trainer.config.to_dict(), indent=2), trainer.step)
        if not trainer.mesh.is_logging_rank:
            return {}
        from meshtrain.checkpoint.one_device import load_model
        from meshtrain.training.harness.lm import MeshtrainLM
        from meshtrain.training.harness.tasks import evaluate, task_scores

        try:
            model, _, context = load_model(out, trainer.device)
            lm = MeshtrainLM(model, trainer.tokenizer, context, BATCH_SIZE)
            results = evaluate(lm, self.tasks, self.include, limit=self.limit, bootstrap_iters=0,
                               include_key="train.eval_tasks_include")
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return {"tasks": task_scores(results)}
