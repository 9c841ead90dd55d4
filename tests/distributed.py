"""The multi-process test harness: see :mod:`meshtrain.distributed_run`."""

from meshtrain.distributed_run import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
