"""``meshtrain eval``: score saved weights on lm-evaluation-harness tasks.

``meshtrain eval RUN_OR_CHECKPOINT --tasks T1,T2 [--num-fewshot K] [--limit N]
[--include-path DIR] [--output FILE] [--batch-size B] [--device D]`` loads a run's final weights,
a weights directory or a training checkpoint of any layout as one model on one device
(:func:`~meshtrain.checkpoint.one_device.load_model`), with the run's own tokenizer, and runs the
harness with it (:class:`~meshtrain.training.harness.lm.MeshtrainLM`). It prints the harness's
table; ``--output`` writes the harness's results JSON. Nothing is downloaded: a task whose data
is not on this machine is refused by name (exit 2) before the model runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshtrain.config import ConfigError


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain eval``."""
    parser.add_argument("path", metavar="RUN_OR_CHECKPOINT",
                        help="run directory (its final/, else its newest checkpoint), weights "
                             "directory, or training checkpoint (step_N or checkpoint dir)")
    parser.add_argument("--tasks", required=True, action="append", metavar="T1,T2",
                        help="harness task names (comma-separated or repeated)")
    parser.add_argument("--num-fewshot", type=int, metavar="K",
                        help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="score at most N documents of each task")
    parser.add_argument("--include-path", default="", metavar="DIR",
                        help="directory of task YAMLs of your own (with local data files)")
    parser.add_argument("--output", metavar="FILE", help="write the harness's results JSON")
    parser.add_argument("--log-samples", action="store_true",
                        help="--output: include every document's requests and answers")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="requests run at once (default 16)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N")


def task_names(values: list[str]) -> list[str]:
    """``--tasks`` values (each comma-separated) as one list of names, in order, each once."""
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    return list(dict.fromkeys(names))


def _device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f'--device "{name}" is not a device; use auto, cpu, cuda or '
                          "cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is visible; use auto or cpu.")
    return device


def _check_args(args: argparse.Namespace) -> list[str]:
    from meshtrain.validation.reporting import installed

    if not installed("lm_eval"):
        raise ConfigError("meshtrain eval needs the lm-evaluation-harness (the lm_eval "
                          'package), which is not installed: pip install "meshtrain[eval]".')
    names = task_names(args.tasks)
    for option, value, least in (("--batch-size", args.batch_size, 1), ("--limit", args.limit, 1),
                                 ("--num-fewshot", args.num_fewshot, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{option} {value} must be at least {least}.")
    if args.output and Path(args.output).is_dir():
        raise ConfigError(f"--output {args.output} is a directory; name the JSON file to write.")
    return names


def run_eval(args: argparse.Namespace) -> int:
    """``meshtrain eval``."""
    names = _check_args(args)
    from meshtrain.training.harness.tasks import check_tasks, evaluate, results_json

    manager = check_tasks(names, args.include_path)  # every task and its data, before weights
    from lm_eval.utils import make_table

    from meshtrain.checkpoint.one_device import load_model
    from meshtrain.data.tokenizer import load_tokenizer
    from meshtrain.training.harness.lm import MeshtrainLM

    device = _device(args.device)
    model, config, context = load_model(args.path, device)
    try:
        tokenizer = load_tokenizer(config.data.tokenizer)
    except ConfigError as error:
        raise ConfigError(f"{args.path}: the run's tokenizer does not load ({error}) A relative "
                          "data.tokenizer is read from the directory meshtrain eval runs in: run "
                          "it where the run was trained.") from None
    lm = MeshtrainLM(model, tokenizer, context, args.batch_size)
    print(f"meshtrain eval: {args.path} ({config.model.n_layers}-layer dim-{config.model.dim}, "
          f"context {context}, tokenizer {tokenizer.name}) on {device}: {', '.join(names)}",
          file=sys.stderr, flush=True)
    results = evaluate(lm, names, args.include_path, args.num_fewshot, args.limit,
                       log_samples=args.log_samples, manager=manager)
    print(make_table(results))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results_json(results) + "\n")
        print(f"meshtrain eval: wrote {out}", file=sys.stderr)
    return 0
