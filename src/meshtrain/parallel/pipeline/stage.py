"""Splitting the layer stack into pipeline stages, and the per-stage forward.

Stage ``s`` of ``pp × virtual_stages`` holds a contiguous run of blocks; the first stage also
holds the embedding, the last the final norm, the head (and computes the loss). Every layer is
assigned exactly once. The split is either explicit (``parallel.pp_split = "3,3,2"``) or balanced
by a cost estimate: each block costs its matmul FLOPs, the last stage also pays for the head
(``dim × vocab`` per token, often worth a block or more for small models).

A rank keeps only the modules of its own stages: the others are deleted from the model (or set to
``None``), so parameter names stay those of the unsplit model and everything downstream (the
name-seeded init, data parallelism, checkpoints) works unchanged.

Tied embeddings (``model.tie_embeddings``): the head of the last stage is the embedding matrix,
so the last stage keeps ``tok_embeddings`` too (for its weight only; it reads hidden states). The
first and the last stage then each hold the matrix under its one name, get the same name-seeded
initial value, and sum their gradients over the mesh's ``tied`` group
(:meth:`~meshtrain.parallel.data.engine.DataParallelEngine.reduce_partial_grads`), so the copies
stay equal after every step.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.model.weight_grad import make_deferrable


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
    if n < num_stages:
        raise ConfigError(f"model.n_layers = {n} is fewer than the {num_stages} pipeline stages "
                          f"(pp × virtual_stages); use pp × virtual_stages <= {n}.")
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


class StageChunk:
    """The forward of one pipeline stage over the (shared) model's modules.

    Not an ``nn.Module``: the modules stay registered in the model under their usual names.
    """

    def __init__(self, model: nn.Module, stage: int, layers: list[int], is_first: bool,
                 is_last: bool):
        self.model, self.stage, self.layers = model, stage, layers
        self.is_first, self.is_last = is_first, is_last

    def __call__(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """Tokens (first stage) or hidden states in; hidden states or logits (last stage) out.
        ``layout``: the micro-batch's document layout (document masking), or None."""
        model = self.model
        h = model.tok_embeddings(x) if self.is_first else x
        for layer in self.layers:
            h = model.layers[str(layer)](h, layout)
        if self.is_last:
            h = model.head(model.norm(h))
        return h

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this stage's forward uses."""
        model = self.model
        modules = [model.layers[str(i)] for i in self.layers]
        if self.is_first:
            modules.append(model.tok_embeddings)
        if self.is_last:
            modules += [model.norm] + ([model.output] if model.output is not None else [])
            if model.tie_embeddings and not self.is_first:
                modules.append(model.tok_embeddings)  # the tied head's weight
        return [p for m in modules for p in m.parameters()]


def split_model(model: nn.Module, stages_here: list[int], layers_per_stage: list[list[int]],
                ) -> dict[int, StageChunk]:
    """Keep only this rank's stages in ``model`` (in place); return its chunks by stage."""
    last = len(layers_per_stage) - 1
    owned = {layer for s in stages_here for layer in layers_per_stage[s]}
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if 0 not in stages_here and not (model.tie_embeddings and last in stages_here):
        model.tok_embeddings = None
    if last not in stages_here:
        model.norm = None
        model.output = None
    make_deferrable(model)  # linear weight grads can wait for the W pass (zero-bubble)
    return {s: StageChunk(model, s, layers_per_stage[s], s == 0, s == last) for s in stages_here}
