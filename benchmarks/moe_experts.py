"""Time one MoE layer's experts, forward and backward: grouped GEMM against one matmul per expert.

``python benchmarks/moe_experts.py [--experts 64] [--top-k 8] [--dim 256] [--hidden 128]
[--tokens 2048] [--repeats 5]`` prints one JSON line: the median seconds of a forward +
backward of :class:`~meshtrain.model.moe.GroupedExperts` on tokens routed uniformly at random,
for each path, and their ratio. Both paths compute the same products
(``tests/unit/test_grouped_experts.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import meshtrain.model.grouped_gemm as grouped_gemm
from meshtrain.model.moe import GroupedExperts


def time_experts(experts: int, top_k: int, dim: int, hidden: int, tokens: int, repeats: int,
                 per_expert: bool) -> float:
    """Median seconds of a forward + backward through ``experts`` SwiGLU experts."""
    torch.manual_seed(0)
    module = GroupedExperts(experts, dim, hidden)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rows = tokens * top_k
    chosen = torch.randint(0, experts, (rows,))
    counts = torch.bincount(chosen, minlength=experts)
    x = torch.randn(rows, dim, requires_grad=True)
    grouped_gemm.FORCE_PER_EXPERT = per_expert
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            module(x, counts).sum().backward()
            times.append(time.perf_counter() - start)
            module.zero_grad()
            x.grad = None
    finally:
        grouped_gemm.FORCE_PER_EXPERT = False
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    """Print the two paths' times and their ratio as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("experts", 64), ("top-k", 8), ("dim", 256), ("hidden", 128),
                          ("tokens", 2048), ("repeats", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    shape = dict(experts=args.experts, top_k=args.top_k, dim=args.dim, hidden=args.hidden,
                 tokens=args.tokens, repeats=args.repeats)
    grouped = time_experts(**shape, per_expert=False)
    loop = time_experts(**shape, per_expert=True)
    print(json.dumps({**shape, "threads": torch.get_num_threads(),
                      "grouped_s": round(grouped, 4), "per_expert_s": round(loop, 4),
                      "per_expert_over_grouped": round(loop / grouped, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
