"""How much of each side's training step is matrix-product and attention kernels.

``python benchmarks/kernel_floor.py [--suite moe] [--steps 6] [--warmup 1] [--set KEY=VALUE]``
builds a one-process suite's two sides in this process (meshtrain's ``Trainer`` and the peer's
plain loop of :func:`meshtrain.commands.bench.peers.make_step`, with the suite's shape and
``--set``), times ``--steps`` steps of each, alternating, after ``--warmup`` untimed ones, then
records one more step of each under a dispatch mode that keeps every matrix-product and attention
kernel call (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, and the fused attention
forward and backward) with copies of its inputs, and replays those calls alone, the two sides in
turn (best of three). It prints one JSON line per side and one for the pair:

- ``step_s``: the median step; ``kernels_s``: the replayed kernels; ``kernel_share``: their
  share of the step; ``calls``: how many there were;
- ``ceiling``: the peer's step over meshtrain's kernel time, the speed-up over the peer meshtrain
  would reach if everything in its step but these kernels took no time at all. Where it is
  close to 1, the two sides run the same products at the same rate and no framework work
  could open a larger gap.

Both sides run in one process, one intra-op thread (as the bench's workers do), under the
allocator settings the process started with (``meshtrain bench`` starts its workers with
:data:`meshtrain.host.allocator.ALLOCATOR_ENV`; set those variables to compare like with like).
The replayed kernels run on warm caches, so ``kernels_s`` is a floor, not a share of the step
that a profiler would attribute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KERNELS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
})
"""The kernels replayed: dense and grouped matrix products and fused attention (CPU: the
replays are timed on the host, with nothing to synchronise)."""

PEERS = {"moe": "meshtrain.commands.bench.moe_peers:build_hf_mixtral",
         "single": "meshtrain.commands.bench.peers:build_hf_llama"}
"""The one-process suites this measures, and the builder of each one's peer model."""


class KernelRecorder(TorchDispatchMode):
    """Keeps every call of a :data:`KERNELS` op made under it, with copies of its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func.overloadpacket) in KERNELS:
            copies = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            self.calls.append((func, copies, dict(kwargs)))
        return func(*args, **kwargs)


def replay_seconds(calls: list[tuple]) -> float:
    """Wall time of running ``calls`` back to back."""
    start = time.perf_counter()
    for func, args, kwargs in calls:
        func(*args, **kwargs)
    return time.perf_counter() - start


def measure_sides(sides: dict[str, Callable[[int], object]], steps: int, replays: int = 3,
                  warmup: int = 1) -> dict[str, dict]:
    """Time ``steps`` alternating steps of each side (after ``warmup`` untimed ones), record
    one step's kernels per side, then replay them, alternating sides, ``replays`` times after
    one warm round (the best of each side's replays is its ``kernels_s``)."""
    for i in range(warmup):
        for step in sides.values():
            step(i)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup, warmup + steps):
        for name, step in sides.items():
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
    calls = {}
    for name, step in sides.items():
        recorder = KernelRecorder()
        with recorder:
            step(warmup + steps)
        calls[name] = recorder.calls
    replayed: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(replays + 1):
        for name in sides:
            seconds = replay_seconds(calls[name])
            if i:
                replayed[name].append(seconds)
    out = {}
    for name in sides:
        median, kernels = statistics.median(times[name]), min(replayed[name])
        out[name] = {"side": name, "step_s": median, "kernels_s": kernels,
                     "kernel_share": kernels / median, "calls": len(calls[name]),
                     "step_times_s": times[name], "replay_times_s": replayed[name]}
    return out


def build_sides(suite_name: str, overrides: list[str], steps: int) -> dict[str, Callable]:
    """meshtrain's and the peer's step functions for the one-process suite ``suite_name``,
    configured for ``steps`` steps (and the recorded one)."""
    import importlib

    import meshtrain.commands.bench.suites  # noqa: F401 - registers the suites
    from meshtrain.commands.bench.base import SUITES, bench_config
    from meshtrain.commands.bench.peers import hf_logits, make_step, train_data
    from meshtrain.commands.bench.workers import preload_tokens
    from meshtrain.config import ConfigError, parse_override
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    if suite_name not in PEERS:
        raise ConfigError(f'--suite "{suite_name}": kernel_floor measures one-process suites '
                          f"against a Hugging Face peer; valid: {', '.join(sorted(PEERS))}.")
    devices = [value.strip("\"'") for key, value in map(parse_override, overrides)
               if key == "train.device"]
    if any(device != "cpu" for device in devices):
        raise ConfigError("kernel_floor times its replays on the host, so it runs on the CPU "
                          'only; valid: train.device = "cpu" (the default).')
    config, _ = bench_config(SUITES[suite_name], overrides, steps + 2)
    preload_tokens(config)
    trainer = Trainer(config, build_mesh(config))
    module, name = PEERS[suite_name].split(":")
    peer = getattr(importlib.import_module(module), name)(config)
    peer_step = make_step(peer, hf_logits, train_data(config), config.train)
    return {"meshtrain": lambda i: trainer.train_step(), "peer": peer_step}


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per side and one with the ceiling."""
    from meshtrain.commands.bench.base import THREADS_PER_PROCESS

    parser = argparse.ArgumentParser(prog="python benchmarks/kernel_floor.py")
    parser.add_argument("--suite", default="moe", help=f"one of {', '.join(sorted(PEERS))}")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per side")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override the benchmarked shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS_PER_PROCESS)
    sides = build_sides(args.suite, args.overrides, args.warmup + args.steps)
    results = measure_sides(sides, args.steps, warmup=args.warmup)
    for result in results.values():
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v
                          for k, v in result.items() if not k.endswith("times_s")}),
              flush=True)
    mt, peer = results["meshtrain"], results["peer"]
    print(json.dumps({"suite": args.suite, "ratio": round(peer["step_s"] / mt["step_s"], 3),
                      "ceiling": round(peer["step_s"] / mt["kernels_s"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
