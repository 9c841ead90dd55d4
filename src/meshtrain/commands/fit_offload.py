"""What ``parallel.offload`` takes out of a rank's memory estimate (:mod:`.fit_check`).

The planner's per-rank memory (:func:`meshtrain.planner.cost.memory.rank_memory`) prices the
run without offload. Offload keeps this rank's ZeRO shard elsewhere (docs/offload.md), so the
fit check leaves out what no longer lives in the memory it checks:

- on a GPU (``host`` or ``nvme``): the optimizer states (fp32 masters and Adam moments), DiLoCo's
  outer state and, under ``optimizer+params``, the parameter shard; the gradient shard stays on
  the GPU;
- on the CPU with ``nvme``: the same, and the gradient shard at ZeRO 2-3 (it lives in the files
  too);
- on the CPU with ``host``: nothing leaves (the host memory is the memory checked), and fp32
  parameters below ``optimizer+params`` at ZeRO-3 gain a separate fp32 master copy, 4 bytes per
  shard parameter (half the moments' 8).
"""

from __future__ import annotations

from meshtrain.config import Config


def offloaded_parts(parts: dict[str, float], config: Config,
                    device_type: str) -> dict[str, float]:
    """``parts`` (one rank's estimate, by name) as the memory checked holds them under
    ``config``'s ``parallel.offload`` on ``device_type`` (``cpu`` or ``cuda``)."""
    par = config.parallel
    if par.offload == "none":
        return parts
    with_params = par.offload == "optimizer+params" and par.zero == 3
    if device_type == "cpu" and par.offload_device == "host":
        if config.train.precision == "fp32" and not with_params:
            return {**parts, "offloaded fp32 masters": parts.get("optimizer states", 0.0) / 2}
        return parts
    gone = {"optimizer states", "DiLoCo outer state"}
    if device_type == "cpu" and par.zero >= 2:
        gone.add("gradients")
    if with_params:
        gone.add("parameters")
    return {name: value for name, value in parts.items() if name not in gone}
