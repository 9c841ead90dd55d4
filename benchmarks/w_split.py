"""Cost of the zero-bubble I/W split against a plain backward, one micro-batch, on CPU.

Usage: ``python benchmarks/w_split.py [--dim 256] [--layers 4] [--moe-experts 0] [--reps 10]``.
Builds the model, runs forward + plain backward (B) and forward + I (weight grads deferred) +
W (the deferred queue) ``--reps`` times each, interleaved, and prints the median times and
``(I + W) / B``. Forward time is excluded. One thread, so the numbers are the arithmetic alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain.config import load_config
from meshtrain.model import build_model
from meshtrain.model.weight_grad import WeightGradQueue, deferring, make_deferrable


def main() -> None:
    """Measure and print B, I, W and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--moe-experts", type=int, default=0)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = load_config(None, [f"model.dim={args.dim}", f"model.n_layers={args.layers}",
                                "model.n_heads=4", f"model.ffn_dim={4 * args.dim}",
                                "model.vocab_size=1024", f"model.moe_experts={args.moe_experts}"])
    model = build_model(config.model)
    make_deferrable(model)
    tokens = torch.randint(0, 1024, (args.batch, args.seq))
    b, i, w = [], [], []
    for _ in range(args.reps + 1):
        loss = model(tokens).float().logsumexp(-1).mean()
        t0 = time.perf_counter()
        loss.backward()
        b.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        loss = model(tokens).float().logsumexp(-1).mean()
        queue = WeightGradQueue()
        t0 = time.perf_counter()
        with deferring(queue):
            loss.backward()
        t1 = time.perf_counter()
        queue.run()
        t2 = time.perf_counter()
        i.append(t1 - t0)
        w.append(t2 - t1)
        model.zero_grad(set_to_none=True)
    mb, mi, mw = (statistics.median(x[1:]) for x in (b, i, w))
    print(f"B {mb * 1e3:.1f} ms  I {mi * 1e3:.1f} ms  W {mw * 1e3:.1f} ms  "
          f"(I+W)/B {(mi + mw) / mb:.3f}")


if __name__ == "__main__":
    main()
