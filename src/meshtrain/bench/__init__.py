"""``meshtrain bench``: meshtrain side by side with PyTorch-native peers on the same work.

Each suite trains one Llama shape for a fixed number of steps with meshtrain and with a peer
(``single``: Hugging Face ``LlamaForCausalLM``; ``dp``: ``DistributedDataParallel``), alternating
fresh runs, and reports median tokens/s, the ratio meshtrain / peer and peak memory per rank.
See :mod:`meshtrain.bench.runner` for the method and :mod:`meshtrain.bench.suites` for how to add
a suite; ``docs/performance.md`` for measurements.
"""

from __future__ import annotations

from meshtrain.bench import suites  # noqa: F401 - registers the built-in suites
from meshtrain.bench.runner import (
    BENCH_DEFAULTS,
    SUITES,
    BenchOptions,
    Suite,
    format_table,
    register_suite,
    run_bench,
)

__all__ = ["BENCH_DEFAULTS", "SUITES", "BenchOptions", "Suite", "format_table", "register_suite",
           "run_bench"]
