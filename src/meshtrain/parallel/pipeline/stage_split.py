"""How the layer stack is split into pipeline stages: which layers each stage holds.

Every layer is assigned exactly once, to a contiguous run per stage. The split is either explicit
(``parallel.pp_split = "3,3,2"``) or balanced by a cost estimate: each block costs its matmul
FLOPs, and the last stage also pays for the head (``dim × vocab``
per token, often worth a block or more for small models). Pure arithmetic on the config, shared
by the runtime (:mod:`meshtrain.parallel.pipeline.stage`), the validation and the planner.
"""

from __future__ import annotations

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.config.layout_rules import check_pipeline_stages


def _block_cost(config: ModelConfig, layer: int) -> float:
    d, hd = config.dim, config.head_dim
    attention = d * (config.n_heads + 2 * config.kv_heads) * hd + config.n_heads * hd * d
    if config.is_moe_layer(layer):
        hidden = config.moe_top_k * config.expert_ffn_dim + config.shared_ffn_dim
        mlp = (3 if config.mlp == "swiglu" else 2) * d * hidden
    else:
        mlp = (3 if config.mlp == "swiglu" else 2) * d * config.ffn_dim
    return float(attention + mlp)


def parse_split(text: str, n_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage from ``"3,3,2"``; refuses splits that drop or duplicate layers."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f'parallel.pp_split = "{text}" is not a comma list of integers, '
                          f'e.g. "2,2".') from None
    if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != n_layers:
        raise ConfigError(
            f'parallel.pp_split = "{text}" must list {num_stages} non-negative layer counts '
            f"(pp × virtual_stages) adding up to model.n_layers = {n_layers}; got "
            f"{len(counts)} counts adding up to {sum(counts)}.")
    return counts


def balanced_split(config: ModelConfig, vocab_size: int, num_stages: int) -> list[int]:
    """Layer counts per stage minimising the most expensive stage (each stage >= 1 layer)."""
    n = config.n_layers
    check_pipeline_stages(num_stages, n)
    costs = [_block_cost(config, i) for i in range(n)]
    head = float(config.dim * vocab_size)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: smallest max-stage cost placing the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = prefix[i] - prefix[j] + (head if s == num_stages else 0.0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    counts, i = [], n
    for s in range(num_stages, 0, -1):
        j = choice[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def stage_layers(config: ModelConfig, vocab_size: int, num_stages: int,
                 explicit: str = "") -> list[list[int]]:
    """The layer ids of each stage."""
    counts = (parse_split(explicit, config.n_layers, num_stages) if explicit
              else balanced_split(config, vocab_size, num_stages))
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
