"""Checks of what a run reports beyond ``metrics.jsonl``: its experiment trackers
(``train.loggers``, ``train.tensorboard``) and the harness tasks it scores during training
(``train.eval_tasks`` and its keys).

Each tracker and the harness are optional dependencies (extras ``tensorboard``, ``wandb``,
``mlflow``, ``eval``): a run that asks for one that is not installed is refused here, before any
worker starts, with the ``pip install`` line that brings it. Whether each task and its data are
on this machine is checked later, still before launch, by
:func:`meshtrain.training.harness.tasks.check_tasks` (it loads the tasks, which takes seconds).
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError

TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
"""Each ``train.loggers`` name: the module it imports and the meshtrain extra that installs it."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a module set to None in ``sys.modules`` cannot)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def chosen_loggers(config: Config) -> list[str]:
    """The trackers a run writes to: ``train.loggers`` in order, plus ``"tensorboard"`` when
    ``train.tensorboard = true`` (its older spelling), each once."""
    names = list(dict.fromkeys(config.train.loggers))
    if config.train.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def validate_reporting(config: Config) -> None:
    """Refuse unknown or uninstalled trackers and bad ``train.eval_tasks*`` values."""
    for name in config.train.loggers:
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, list(TRACKERS), n=1)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f'train.loggers: "{name}" is not a tracker meshtrain writes to.'
                              f"{hint} Choose any of: {', '.join(TRACKERS)} (e.g. --set "
                              "train.loggers=tensorboard,wandb,mlflow).")
    for name in chosen_loggers(config):
        module, extra = TRACKERS[name]
        if not installed(module):
            key = ("train.tensorboard = true" if name == "tensorboard"
                   and name not in config.train.loggers else f'train.loggers = ["{name}"]')
            raise ConfigError(f"{key} needs the {module} package, which is not installed: "
                              f'pip install "meshtrain[{extra}]" (or pip install {module}), or '
                              f"leave {name} out of train.loggers.")
    _validate_eval_tasks(config)


def _validate_eval_tasks(config: Config) -> None:
    train = config.train
    if train.eval_tasks_every < 0:
        raise ConfigError(f"train.eval_tasks_every = {train.eval_tasks_every} must be 0 (score "
                          "train.eval_tasks after the last step only) or a number of steps.")
    if train.eval_tasks_limit < 0:
        raise ConfigError(f"train.eval_tasks_limit = {train.eval_tasks_limit} must be 0 (every "
                          "document of each task) or a number of documents.")
    if not train.eval_tasks:
        if train.eval_tasks_every or train.eval_tasks_include or train.eval_tasks_limit:
            raise ConfigError("train.eval_tasks_every, eval_tasks_include and eval_tasks_limit "
                              "take effect only with train.eval_tasks: name the harness tasks "
                              '(e.g. train.eval_tasks = ["my_task"]) or leave them unset.')
        return
    if not installed("lm_eval"):
        raise ConfigError("train.eval_tasks needs the lm-evaluation-harness (the lm_eval "
                          'package), which is not installed: pip install "meshtrain[eval]", '
                          "or set train.eval_tasks = [].")
    include = train.eval_tasks_include
    if include and not Path(include).expanduser().is_dir():
        raise ConfigError(f'train.eval_tasks_include = "{include}" is not a directory; name the '
                          "directory that holds your task YAML files.")
