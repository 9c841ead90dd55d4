"""Refuse an offload setting the runtime cannot run (``parallel.offload*``, docs/offload.md).

Offload moves this rank's ZeRO shard of model states off the compute device, so it needs ZeRO
1-3 (at ZeRO 0 there is no shard: every rank's optimizer updates the whole model), and the
parameter shard exists only at ZeRO-3 (below it every rank holds the full parameters).
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.config import Config, ConfigError
from meshtrain.config.layout_rules import choice
from meshtrain.config.sections import OFFLOAD_DEVICES, OFFLOAD_KINDS


def validate_offload(config: Config) -> None:
    """Check ``parallel.offload``, ``offload_device``, ``offload_dir`` and
    ``offload_chunk_mb`` against each other and the ZeRO stage."""
    par = config.parallel
    choice(par.offload, OFFLOAD_KINDS, "parallel.offload")
    choice(par.offload_device, OFFLOAD_DEVICES, "parallel.offload_device")
    if par.offload_chunk_mb <= 0:
        raise ConfigError(f"parallel.offload_chunk_mb = {par.offload_chunk_mb} must be positive "
                          "(MiB of each state tensor the offloaded step handles at a time).")
    if par.offload_overlap and (par.offload == "none" or par.zero != 3):
        raise ConfigError(
            f"parallel.offload_overlap = true needs parallel.offload and parallel.zero = 3 "
            f'(got offload = "{par.offload}", zero = {par.zero}): below ZeRO-3 the step ends '
            "with an all-gather every rank issues in order, so it cannot run in the background.")
    if par.offload_overlap and par.replicas > 1:
        raise ConfigError(
            f"parallel.offload_overlap = true does not run with DiLoCo replica groups "
            f"(parallel.replicas = {par.replicas}): the outer step reads the masters right "
            "after the inner step. Set parallel.offload_overlap = false.")
    if par.offload == "none":
        return
    if par.zero == 0:
        raise ConfigError(
            f'parallel.offload = "{par.offload}" needs parallel.zero = 1, 2 or 3: what is '
            "offloaded is this rank's ZeRO shard of the optimizer state (at ZeRO-0 every rank "
            "updates the whole model). Set parallel.zero >= 1, or parallel.offload = \"none\".")
    if par.offload == "optimizer+params" and par.zero != 3:
        raise ConfigError(
            f'parallel.offload = "optimizer+params" needs parallel.zero = 3 (got {par.zero}): '
            "only ZeRO-3 shards the parameters, so only there is a parameter shard to offload. "
            'Set parallel.zero = 3, or parallel.offload = "optimizer".')
    if par.offload_device == "nvme" and par.offload_dir:
        where = Path(par.offload_dir)
        if where.exists() and not where.is_dir():
            raise ConfigError(f"parallel.offload_dir = {par.offload_dir} is a file; it must be "
                              "a directory (or a path that can be created).")
