"""``meshtrain bench``: meshtrain side by side with PyTorch-native peers on the same work.

Each suite trains one Llama shape for a fixed number of steps with meshtrain and with a peer
(``single``: Hugging Face ``LlamaForCausalLM``; ``dp``: ``DistributedDataParallel``; ``zero3``:
FSDP2 ``fully_shard``; ``tp``: DTensor ``parallelize_module``; ``pp``:
``torch.distributed.pipelining`` 1F1B), alternating fresh runs, and reports median tokens/s, the
ratio meshtrain / peer and peak memory per rank. ``allocator`` measures what meshtrain's
``malloc`` settings gain (meshtrain with them against meshtrain without; the peers of the other
suites get the same settings). ``scaling`` measures meshtrain alone at 1, 2, 4 processes per axis
against ideal linear scaling (:mod:`meshtrain.commands.bench.scaling`). See
:mod:`meshtrain.commands.bench.runner`
for the method and :mod:`meshtrain.commands.bench.suites` for how to add a suite;
``docs/performance.md`` for measurements.
"""

from __future__ import annotations

from meshtrain.commands.bench import suites  # noqa: F401 - registers the built-in suites
from meshtrain.commands.bench.base import (
           BENCH_DEFAULTS,
           SUITES,
           BenchOptions,
           Suite,
           register_suite,
)
from meshtrain.commands.bench.runner import format_table, run_bench

__all__ = ["BENCH_DEFAULTS", "SUITES", "BenchOptions", "Suite", "format_table", "register_suite",
           "run_bench"]
