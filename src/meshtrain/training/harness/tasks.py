"""Harness tasks on this machine only: find them, load their data without a network, run them.

Nothing is downloaded: :func:`offline` switches the Hugging Face ``datasets`` and hub libraries
to offline mode before any task loads, so a task's data must already be local, either in the
Hugging Face datasets cache or as files a task YAML names (``dataset_path: json`` with
``dataset_kwargs: {data_files: ...}``, in a directory passed as ``--include-path``).
:func:`check_tasks` loads each task by itself, so a task whose data is missing is refused by
name (:class:`~meshtrain.config.ConfigError`, exit 2) before any model runs.
"""

from __future__ import annotations

import difflib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError

OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def offline() -> None:
    """Make ``datasets`` and ``huggingface_hub`` read only local files, also when they were
    imported before (their flags are read at import)."""
    for name in OFFLINE_ENV:
        os.environ[name] = "1"
    for module, flags in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                          ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        loaded = sys.modules.get(module)
        for flag in flags:
            if loaded is not None and hasattr(loaded, flag):
                setattr(loaded, flag, True)


def _manager(names: list[str], include_path: str, include_key: str):
    """A ``TaskManager`` that knows every name: the include directory's tasks alone when they
    suffice (quick), else the harness's built-in tasks too."""
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).expanduser().is_dir():
            raise ConfigError(f"{include_key} {include_path} is not a directory of task YAMLs.")
        try:
            local = TaskManager(include_path=str(Path(include_path).expanduser()),
                                include_defaults=False)
        except TypeError:  # a harness without include_defaults
            local = None
        if local is not None and all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=str(Path(include_path).expanduser()) if include_path
                          else None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        raise ConfigError(f'no harness task is named "{unknown[0]}".{hint} A task of your own '
                          f"is a YAML file in a directory passed as {include_key} (its task: "
                          "key is the name).")
    return manager


def check_tasks(names: list[str], include_path: str = "", include_key: str = "--include-path"):
    """Find every task and load its data, one task at a time, offline; returns the
    ``TaskManager``. Raises :class:`ConfigError` naming the first task that is unknown or whose
    data is not on this machine, and what to do about it."""
    offline()
    if not names:
        raise ConfigError("no task to score: name at least one (e.g. --tasks my_task).")
    manager = _manager(names, include_path, include_key)
    for name in names:
        try:
            manager.load([name])
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - datasets, hub and YAML errors alike
            cause = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            raise ConfigError(
                f'task "{name}" could not be loaded on this machine ({cause}). Nothing is '
                "downloaded: its data must be local, either in the Hugging Face datasets cache "
                "(HF_DATASETS_CACHE) or as files named by a task YAML of your own "
                "(dataset_path: json with dataset_kwargs: {data_files: {test: /path/data.jsonl}}"
                f") in a directory passed as {include_key}.") from None
    return manager


def evaluate(lm, names: list[str], include_path: str = "", num_fewshot: int | None = None,
             limit: int | None = None, log_samples: bool = False, bootstrap_iters: int = 100000,
             include_key: str = "--include-path", manager=None) -> dict[str, Any]:
    """The harness's results (``simple_evaluate``) of ``lm`` on ``names``, after
    :func:`check_tasks` (unless its ``manager`` is given). The harness seeds Python's, NumPy's
    and torch's generators; their states are restored afterwards, so that a training process
    is not disturbed."""
    import numpy as np
    import torch
    from lm_eval import evaluator

    if manager is None:
        manager = check_tasks(names, include_path, include_key)
    states = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            results = evaluator.simple_evaluate(
                model=lm, tasks=list(names), task_manager=manager, num_fewshot=num_fewshot,
                limit=limit or None, log_samples=log_samples, bootstrap_iters=bootstrap_iters)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return results


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of the harness's results: every number but standard errors;
    a metric under a filter other than ``none`` is named ``metric/filter``."""
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if (not kind or metric.endswith("_stderr") or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                continue
            name = metric if kind == "none" else f"{metric}/{kind}"
            scores.setdefault(task, {})[name] = float(value)
    return scores


def results_json(results: dict[str, Any]) -> str:
    """The harness's results as the JSON text ``lm_eval --output_path`` would hold."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
