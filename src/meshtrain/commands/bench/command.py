"""``meshtrain bench``: parse its options into :class:`BenchOptions`, run, print."""

from __future__ import annotations

import argparse

from meshtrain.config import ConfigError


def run_command(args: argparse.Namespace) -> int:
    """``meshtrain bench``."""
    import json

    from meshtrain.commands.bench import BenchOptions, format_table, run_bench

    try:
        procs = tuple(int(n) for n in args.procs.split(",") if n.strip())
    except ValueError:
        raise ConfigError(f'--procs "{args.procs}" is not a comma list of process counts, '
                          'e.g. 1,2,4.') from None
    options = BenchOptions(suites=args.suites, steps=args.steps, warmup=args.warmup,
                           repeats=args.repeats, overrides=args.overrides, procs=procs,
                           plot=args.plot, same_allocator=args.same_allocator)
    results = run_bench(options)  # a failing worker: WorkerError, exit status 1
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0
