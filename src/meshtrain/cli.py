"""The ``meshtrain`` command: parse arguments, dispatch to :mod:`meshtrain.commands`, map errors
to exit statuses.

Exit statuses: 0 done; 2 a config or usage error (one paragraph on stderr, no traceback);
1 a failure during the run; 75 ``meshtrain train`` stopped by SIGTERM/SIGUSR1 after saving a
checkpoint (:mod:`meshtrain.training.preemption`), 128 + signal when a second signal stopped it at
once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Callable

from meshtrain.config import ConfigError


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run config, or a run's config.json "
                        "(default: the built-in demo)")
    parser.add_argument("--nproc", type=int,
                        help="processes to launch (default: replicas × dp × tp × pp)")
    parser.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    parser.add_argument("--run-dir", help="where metrics.jsonl and final weights go")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Train transformer language models with data, tensor, pipeline and expert "
                    "parallelism that give the same numbers as one process.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (no --config: the built-in demo)")
    _add_run_options(train)
    train.add_argument("--max-restarts", type=int, metavar="N",
                       help="restart the workers up to N times after a failure, resuming from "
                            "the newest checkpoint (train.max_restarts)")
    train.add_argument("--overwrite", action="store_true",
                       help="remove the earlier run's files in the run dir (metrics, "
                            "checkpoints, final weights, ...) and start over")
    train.add_argument("--dry-run", action="store_true",
                       help="build one rank's real objects on the meta device over a fake "
                            "process group and print its bytes and collectives; trains nothing "
                            "(docs/dry_run.md)")
    train.add_argument("--world", type=int, metavar="N", help="--dry-run: ranks in the layout")
    train.add_argument("--rank", type=int, metavar="R", help="--dry-run: the rank (default 0)")
    train.add_argument("--json", action="store_true", help="--dry-run: one JSON document")
    ver = sub.add_parser("verify", help="check a layout against a one-process reference")
    _add_run_options(ver)
    ver.add_argument("--tolerance", type=float,
                     help="max |loss difference| (default 2e-4 for fp32, 5e-2 for bf16)")
    ver.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    gen = sub.add_parser("generate", help="generate text from a finished run's final weights")
    gen.add_argument("--checkpoint", required=True, help="run directory (or its final/ folder)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    from meshtrain.commands.eval_tasks import add_eval_options

    add_eval_options(sub.add_parser(
        "eval", help="score saved weights on lm-evaluation-harness tasks (docs/evaluation.md)"))
    bench = sub.add_parser("bench", help="meshtrain vs PyTorch-native peers, side by side")
    bench.add_argument("--suite", dest="suites", action="append", default=[], metavar="NAME",
                       help="suite to run (repeatable or comma-separated; default: all); "
                            "'peers' = single, dp, zero3, tp and pp, each against its "
                            "PyTorch-native peer")
    bench.add_argument("--steps", type=int, default=10, help="measured steps per run")
    bench.add_argument("--warmup", type=int, default=2, help="discarded steps per run")
    bench.add_argument("--repeats", type=int, default=5,
                       help="alternating runs per side (the medians are over these)")
    bench.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    bench.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override the benchmarked shape")
    bench.add_argument("--procs", default="1,2,4", metavar="N,N,...",
                       help="process counts of the scaling suite (default 1,2,4)")
    bench.add_argument("--plot", default="", metavar="PNG",
                       help="write the scaling suite's tokens/s against processes as a PNG")
    bench.add_argument("--same-allocator", action=argparse.BooleanOptionalAction, default=True,
                       help="start the peer's processes with meshtrain's malloc settings too, "
                            "so the ratios compare the frameworks' work alone (the default; "
                            "--no-same-allocator: the peers get glibc's defaults); the "
                            "allocator suite measures what the settings gain")
    _add_planner_parsers(sub)
    sim = sub.add_parser("simulate", help="time a pipeline schedule (bubble, memory, timeline)")
    sim.add_argument("--schedule", required=True,
                     help="gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v")
    sim.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    sim.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    sim.add_argument("--virtual-stages", type=int,
                     help="chunks per rank (default 2 for interleaved-1f1b and zb-v, else 1)")
    sim.add_argument("--times", default="1,1,1", metavar="F,B,W",
                     help="forward, backward-input, backward-weight time of one micro-batch "
                          "through one rank's layers (default 1,1,1)")
    sim.add_argument("--comm", type=float, default=0.0, help="latency of each p2p transfer")
    sim.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sim.add_argument("--plot", metavar="PNG", help="write the timeline as a PNG")
    sim.add_argument("--trace", metavar="JSON", help="write a Chrome trace-event JSON")
    sim.add_argument("--slow-stage", metavar="S:FACTOR",
                     help="stage S takes FACTOR times as long (e.g. 3:1.2)")
    sim.add_argument("--energy-schedule", action="store_true",
                     help="lower the clocks of actions off the critical path; report the "
                          "saving and draw the scheduled step (docs/energy.md)")
    sim.add_argument("--hardware", default="h100-80g",
                     help="--energy-schedule: the GPU profile's clock-power curve")
    sim.add_argument("--max-slowdown", type=float, default=0.01,
                     help="--energy-schedule: longest step allowed, as a fraction (0.01)")
    sim.add_argument("--steady-state", action="store_true",
                     help="--energy-schedule: steps overlap without a flush (the next step's "
                          "warm-up fills this one's drain), so only idle inside each rank's "
                          "busy span is slack")
    _add_convert_parser(sub)
    from meshtrain.commands.lighthouse import add_lighthouse_options

    add_lighthouse_options(sub.add_parser(
        "lighthouse", help="serve the torchft lighthouse that fault-tolerant replica groups "
                           "join (docs/diloco.md)"))
    from meshtrain.commands.keys import add_keys_options

    add_keys_options(sub.add_parser(
        "keys", help="make the TLS credentials of a run across sites (meshtrain keys new)"))
    return parser


def _add_convert_parser(sub) -> None:
    """``convert``: Hugging Face Llama/Qwen/Mixtral <-> meshtrain weights directories."""
    conv = sub.add_parser("convert", help="convert weights to or from Hugging Face format")
    source = conv.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="HF_DIR",
                        help="Hugging Face Llama/Qwen/Mixtral directory -> meshtrain weights dir")
    source.add_argument("--to-hf", metavar="DIR",
                        help="meshtrain weights dir, run dir (with final/) or training "
                             "checkpoint -> Hugging Face directory")
    conv.add_argument("--out", required=True, help="directory to write")
    conv.add_argument("--dtype", help="dtype of the written weights (default: float32 for "
                                      "--from-hf; for --to-hf the dtype it came from HF in)")
    conv.add_argument("--max-shard-gb", type=float, default=5.0,
                      help="--to-hf: largest safetensors shard, in GiB (default 5)")


def _add_planner_parsers(sub) -> None:
    """``estimate``, ``plan`` and ``calibrate`` (options in :mod:`meshtrain.commands.planner`)."""
    from meshtrain.commands.planner import (
        add_calibrate_options,
        add_estimate_options,
        add_hardware_options,
        add_plan_options,
    )

    est = sub.add_parser("estimate", help="predict memory, step time and MFU of a run config")
    _add_run_options(est)
    est.add_argument("--model", metavar="PRESET",
                     help="price a preset's model, sequence length and batch (llama3.1-8b, "
                          "qwen2.5-7b, qwen3-32b, ...; see meshtrain plan) instead of --config")
    add_hardware_options(est, gpus_required=False)
    add_estimate_options(est)
    add_plan_options(sub.add_parser("plan", help="rank parallel layouts for a model and cluster"))
    prep = sub.add_parser("prepare", help="tokenize text sources once into memory-mapped shards")
    prep.add_argument("sources", nargs="+", help=".txt/.jsonl/.parquet files, directories, globs")
    prep.add_argument("--out", required=True, help="directory to write the prepared corpus to")
    prep.add_argument("--tokenizer", default="bytes", help='"bytes" or a tokenizer.json path')
    prep.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    prep.add_argument("--format", default="text", dest="data_format",
                      help="text, chat or prompt_completion (.jsonl rows; stores a loss mask)")
    prep.add_argument("--chat-template", default="",
                      help="--format chat: a Jinja template or its file (default: the one "
                           "beside the tokenizer)")
    prep.add_argument("--workers", type=int, default=1,
                      help="tokenizer processes (large files are shared between them)")
    add_calibrate_options(sub.add_parser("calibrate",
                                         help="measure this machine into a profile JSON"))


COMMANDS = {
    "train": "meshtrain.commands.train:run_train",
    "verify": "meshtrain.commands.verify:run_verify",
    "generate": "meshtrain.commands.generate:run_generate",
    "eval": "meshtrain.commands.eval_tasks:run_eval",
    "bench": "meshtrain.commands.bench.command:run_command",
    "estimate": "meshtrain.commands.planner:run_estimate",
    "plan": "meshtrain.commands.planner:run_plan",
    "calibrate": "meshtrain.commands.planner:run_calibrate",
    "simulate": "meshtrain.commands.simulate:run_simulate",
    "convert": "meshtrain.commands.convert:run_convert",
    "prepare": "meshtrain.commands.prepare:run_prepare",
    "lighthouse": "meshtrain.commands.lighthouse:serve",
    "keys": "meshtrain.commands.keys:run_keys",
}
"""Each subcommand's body, ``module:function`` taking the parsed arguments and returning the exit
status; imported only when that command runs, so ``meshtrain estimate`` never loads torch."""


def command_body(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs subcommand ``name``."""
    module, function = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    from meshtrain.errors import RunFailure
    from meshtrain.run.launch import LaunchError

    args = build_parser().parse_args(argv)
    try:
        if argv is None and args.command == "train":  # the real command line, not a test's call
            from meshtrain.commands.train import requested_allocator_job
            from meshtrain.host.allocator import reexec_with_allocator_env

            reexec_with_allocator_env(*requested_allocator_job(args))
        status = command_body(args.command)(args)
    except ConfigError as error:
        print(textwrap.fill(f"meshtrain {args.command}: {error}", width=100,
                            break_on_hyphens=False), file=sys.stderr)
        return 2
    except (LaunchError, RunFailure) as error:
        print(f"meshtrain {args.command}: {error}", file=sys.stderr)
        return getattr(error, "exit_status", 1)
    except KeyboardInterrupt:
        print(f"meshtrain {args.command}: interrupted", file=sys.stderr)
        return 1
    if argv is None and "torch.distributed" in sys.modules:
        # The real command line, which may have run a process group in this process (an srun
        # or torchrun task, a one-process run): leave as a spawned worker does, past the
        # interpreter's finalisation that can abort a run that finished. A command that never
        # imported torch (help, estimate, plan) ran none and exits normally.
        from meshtrain.run.worker import leave_process

        leave_process(status)
    return status
