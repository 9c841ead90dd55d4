"""bf16 model-FLOPs utilisation of meshtrain's training step on one CUDA GPU; prints JSON.

    python benchmarks/gpu.py                         # ~1B Llama shape on cuda:0
    python benchmarks/gpu.py --micro-batch 4 --peak-tflops 989
    python benchmarks/gpu.py --device cpu --tiny     # shape-only check, no GPU needed

What is timed: ``meshtrain.training.trainer.Trainer.train_step()`` of a one-process run in
``train.precision = "bf16"`` (bf16 parameters and activations, fp32 master weights and AdamW
state, fp32 gradient reduction buffers), on the built-in text corpus: forward, loss, backward,
global-norm clipping and the optimizer step, with ``torch.cuda.synchronize`` at the end of every
step. The first ``--warmup`` steps (allocator growth, kernel selection) are discarded; the step
time is the **median** of the measured steps.

The honest formula: ``mfu = flops_per_token × tokens_per_step / step_time / peak``, where
``flops_per_token`` is :func:`meshtrain.model.flops_per_token` (6 × matmul parameters, the LM head
included, plus 12 × layers × dim × seq_len for attention scores; no credit for the causal mask;
no recomputation counted) and ``peak`` is the device's dense bf16 peak without sparsity: from
``meshtrain.training.metrics.BF16_PEAK_FLOPS`` by device name, or ``--peak-tflops``. Where
neither knows the peak (e.g. ``--device cpu``) ``mfu`` is null, never guessed.

The default shape: dim 2048, 18 layers, 16 query / 8 key-value heads, SwiGLU FFN 5632,
vocabulary 32000, seq_len 2048 (~0.98 B parameters), 8 sequences per step (16,384 tokens):
about 70 GB of a 141 GB H200 by estimate; ``--micro-batch`` and ``--microbatches`` (gradient
accumulation) change it. Nothing here is specific to one GPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

SHAPE_1B = {"model.dim": 2048, "model.n_layers": 18, "model.n_heads": 16, "model.n_kv_heads": 8,
            "model.ffn_dim": 5632, "model.vocab_size": 32000, "train.seq_len": 2048}
"""The ~1B-parameter Llama shape measured by default."""

SHAPE_TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
              "model.ffn_dim": 128, "model.vocab_size": 512, "train.seq_len": 64,
              "data.max_bytes": 100_000}
"""``--tiny``: a shape that runs in seconds on a CPU, to check the script and its output."""

COMMON = {"model.mlp": "swiglu", "model.tie_embeddings": False, "train.precision": "bf16",
          "data.source": "builtin", "data.tokenizer": "bytes", "train.lr_schedule": "constant",
          "train.warmup_steps": 0, "train.log_every": 1_000_000}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (shape-only checks)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps (default 3)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per micro-batch (default 8; --tiny: 2)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step, gradients accumulated (default 1)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="the device's dense bf16 peak in TFLOP/s (default: looked up)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="any other meshtrain config change")
    args = parser.parse_args(argv)
    if args.micro_batch is None:
        args.micro_batch = 2 if args.tiny else 8
    for key in ("steps", "micro_batch", "microbatches"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def build_config(args: argparse.Namespace, run_dir: str):
    """The validated one-process meshtrain :class:`~meshtrain.config.Config` of the run."""
    from meshtrain.config import Config, parse_override, set_key
    from meshtrain.validation.run_config import validate_config

    config = Config()
    values = {**COMMON, **(SHAPE_TINY if args.tiny else SHAPE_1B),
              "train.device": "cpu" if args.device == "cpu" else "cuda",
              "train.global_batch": args.micro_batch * args.microbatches,
              "parallel.microbatches": args.microbatches,
              "train.steps": args.warmup + args.steps, "train.run_dir": run_dir,
              "train.peak_tflops": args.peak_tflops}
    for key, value in values.items():
        set_key(config, key, value, origin="benchmarks/gpu.py")
    for text in args.overrides:
        set_key(config, *parse_override(text))
    validate_config(config, 1)
    return config


def peak_flops(device, override_tflops: float) -> tuple[float | None, str]:
    """``(dense bf16 peak FLOP/s or None, where it came from)`` for ``device``."""
    import torch

    from meshtrain.training.metrics import BF16_PEAK_FLOPS

    if override_tflops > 0:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "unknown (not a CUDA device; give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for key, peak in BF16_PEAK_FLOPS:
        if key in name:
            return peak, f"meshtrain.training.metrics.BF16_PEAK_FLOPS[{key!r}]"
    return None, f"unknown for {name!r} (give --peak-tflops)"


def measure(args: argparse.Namespace) -> dict:
    """Train ``warmup + steps`` steps and return the JSON document."""
    import torch

    from meshtrain.model import count_parameters, flops_per_token
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.metrics import peak_memory_bytes
    from meshtrain.training.trainer import Trainer

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu.py: no CUDA device here; use --device cpu --tiny "
                             "for a shape-only run.")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="meshtrain-gpu-bench-") as run_dir:
        config = build_config(args, run_dir)
        setup_start = time.perf_counter()
        trainer = Trainer(config, ParallelMesh(device=device, seed=config.train.seed))
        setup_s = time.perf_counter() - setup_start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        records = [trainer.train_step() for _ in range(args.warmup + args.steps)]
        peak_bytes = peak_memory_bytes(device)  # after the last optimizer step too
    measured = records[args.warmup:]
    step_time = statistics.median(r["step_time_s"] for r in measured)
    m, t = config.model, config.train
    tokens = t.global_batch * t.seq_len
    fpt = flops_per_token(m, t.seq_len)
    peak, peak_source = peak_flops(device, args.peak_tflops)
    achieved = fpt * tokens / step_time
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": t.precision,
        "params": count_parameters(m)["total"],
        "shape": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads,
                  "n_kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size,
                  "seq_len": t.seq_len, "micro_batch": args.micro_batch,
                  "microbatches": args.microbatches},
        "tokens_per_step": tokens,
        "flops_per_token": fpt,
        "steps": args.steps, "warmup": args.warmup,
        "step_time_s": step_time,
        "step_times_s": [r["step_time_s"] for r in measured],
        "tokens_per_s": tokens / step_time,
        "model_tflops_per_s": achieved / 1e12,
        "peak_tflops": None if peak is None else peak / 1e12,
        "peak_source": peak_source,
        "mfu": None if peak is None else achieved / peak,
        "formula": "mfu = flops_per_token * tokens_per_step / step_time_s / peak",
        "peak_memory_bytes": peak_bytes,
        "model_state_bytes": {k: v for k, v in measured[-1]["mem"].items() if k != "peak_bytes"},
        "losses": [r["loss"] for r in records],
        "setup_s": setup_s,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }
    if device.type == "cuda":
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        result["device_total_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON document on stdout."""
    args = parse_args(argv)
    try:
        result = measure(args)
    except Exception as error:  # noqa: BLE001 - one clear line, e.g. out of memory
        if type(error).__name__ == "OutOfMemoryError":
            print(f"benchmarks/gpu.py: out of memory at --micro-batch {args.micro_batch}; try a "
                  f"smaller one (and --microbatches to keep the step's tokens).", file=sys.stderr)
            return 1
        raise
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
