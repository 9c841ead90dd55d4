"""The lm-evaluation-harness on meshtrain's models: ``meshtrain eval`` and ``train.eval_tasks``.

- :mod:`~meshtrain.training.harness.lm`: :class:`MeshtrainLM`, the harness's language-model
  interface over a one-device model and meshtrain's tokenizer;
- :mod:`~meshtrain.training.harness.tasks`: tasks found and loaded offline, run, their scores;
- :mod:`~meshtrain.training.harness.scorer`: :class:`TaskScorer`, the scores during training.

The harness (the ``lm_eval`` package, extra ``eval``) is imported only when tasks are scored.
"""
