"""The ``diloco`` suite's own settings and the worker that runs one side from a warm start.

The suite takes its settings through ``--set`` beside the config keys, under the ``diloco.``
prefix (:data:`SUITE_SETTINGS`); they shape the comparison, not a training run, so they are not
config keys. ``diloco.warm_start_steps = W`` first trains synchronous dp for ``W`` steps from the
fresh initialisation (DiLoCo's published setting starts from a pretrained model); both sides then
start from those weights at step ``W``: the same learning-rate schedule position (the cosine
spans ``W + train.steps``), the same following sequences, a fresh inner AdamW each.
"""

from __future__ import annotations

from meshtrain.config import ConfigError, parse_override

SUITE_SETTINGS: dict[str, int] = {"diloco.warm_start_steps": 200}
"""The suite's settings (``--set diloco.KEY=VALUE``) and their defaults: 200 warm-start steps
before the sides' own 800 (``train.steps``), so the cosine spans 1000 steps."""


def split_settings(overrides: list[str]) -> tuple[dict[str, int], list[str]]:
    """``(suite settings, config overrides)`` from the ``--set`` texts: the ``diloco.`` ones are
    the suite's (checked: a known name, a whole number ≥ 0), the rest go to the config."""
    settings, rest = dict(SUITE_SETTINGS), []
    for text in overrides:
        if not text.strip().startswith("diloco."):
            rest.append(text)
            continue
        key, value = parse_override(text)
        if key not in SUITE_SETTINGS:
            raise ConfigError(f'--set {key}: not a setting of the diloco suite; valid: '
                              f'{", ".join(SUITE_SETTINGS)}.')
        if not value.isdigit():
            raise ConfigError(f"--set {key}={value}: a whole number of steps, 0 or more "
                              "(0 = both sides start from the fresh initialisation).")
        settings[key] = int(value)
    return settings, rest


def side_steps(config_dict: dict, steps: int, start_step: int, init_from: str,
               save_final: bool) -> list[dict]:
    """One rank of one side: build the trainer; with ``init_from``, load those weights and
    start at ``start_step`` (its learning rate and data position); train ``steps`` steps; with
    ``save_final``, write the weights to ``RUN_DIR/final``. Returns the logging rank's metric
    records (an empty list elsewhere). Module-level: workers are spawned."""
    from meshtrain.checkpoint.state import init_from_weights
    from meshtrain.commands.verify import worker_trainer

    trainer = worker_trainer(config_dict)
    if init_from:
        init_from_weights(trainer, init_from)
        trainer.step = start_step
        trainer.data.load_state_dict({**trainer.data.state_dict(), "step": start_step})
    records = [trainer.train_step() for _ in range(steps)]
    if save_final:
        trainer.save_final()
    return records if trainer.mesh.is_logging_rank else []
