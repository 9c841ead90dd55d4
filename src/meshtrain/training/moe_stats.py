"""Per-step Mixture-of-Experts statistics over the global batch, and the bias-balancing update.

Each :class:`~meshtrain.model.moe.MoE` layer sums its own routing counts over every forward of a
step (:meth:`~meshtrain.model.moe.MoE.pop_step_stats`), whatever order a pipeline schedule runs
the micro-batches in. At the end of the step :class:`MoEStepStats`:

1. lays this rank's layers into one ``[moe layers, 2 experts + 5]`` table (tokens per expert,
   dropped assignments, then the balance numbers: router probabilities summed per expert, tokens,
   the micro-batch balance losses summed over forwards, the sequences' balance losses summed, and
   the number of sequences and forwards), zeros for the MoE layers other pipeline stages hold;
2. all-reduces it over ``dp``: every data-parallel rank (hence every expert-parallel rank, which
   routes its own tokens) and, since each rank summed its micro-batches, the **global batch**.
   Tensor-parallel ranks route identical tokens, so tp is *not* reduced (no double counting);
3. nudges each local layer's ``expert_bias`` from its global load (``moe_balance = "bias"``);
4. all-reduces over ``pp`` so the logging rank sees every stage's layers, and summarises them.
   The ``[moe layers, experts]`` global loads stay in :attr:`MoEStepStats.last_loads` (every rank
   holds all layers), from which dynamic expert placement
   (:class:`~meshtrain.parallel.expert.placement.ExpertPlacer`) adds the per-ep-rank load
   (``ep_max_rank_tokens``, ``ep_mean_rank_tokens``, per layer ``ep_rank_tokens``) and
   ``ep_experts_moved`` to the summary under expert parallelism.

Per layer the summary holds the load (``min_load``, ``max_load``, ``mean_load``,
``max_over_mean``, ``cv``: population standard deviation over mean, ``dropped``) and
``balance_loss``: the balance loss ``E * sum_i f_i * P_i`` without its coefficient at each scope
(:mod:`meshtrain.model.moe_balance`; 1 = balanced): ``micro-batch`` (mean over the step's
forwards), ``sequence`` (mean over its sequences) and ``global-batch`` (the whole step's tokens).
Under context parallelism a rank sees only part of each sequence, so only ``global-batch`` is
reported there. The top level adds ``balance_loss`` averaged over the layers.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.moe import MoE, layer_index


class MoEStepStats:
    """Collects, reduces and summarises one step's expert loads for this rank's MoE layers."""

    def __init__(self, model: nn.Module, mesh, config: ModelConfig):
        self.mesh = mesh
        self.balance = config.moe_balance
        self.num_experts = config.moe_experts
        self.layer_ids = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        row_of = {layer_id: row for row, layer_id in enumerate(self.layer_ids)}
        # (row in the table, module) for the MoE layers this rank holds; names are the plain
        # model's (layers.<i>.moe), whatever pipeline stage or wrapper holds them.
        self.local: list[tuple[int, MoE]] = []
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                layer_id = layer_index(name)
                self.local.append((row_of[layer_id], module))
        self.last_loads: torch.Tensor | None = None
        """The last step's global tokens per expert, ``[moe layers, experts]`` (all stages)."""

    @property
    def active(self) -> bool:
        """True when the model has MoE layers (on any stage)."""
        return bool(self.layer_ids)

    def start_step(self) -> None:
        """Forget statistics of forwards outside the step (e.g. an evaluation)."""
        for _, layer in self.local:
            layer.pop_step_stats()

    @torch.no_grad()
    def finish_step(self) -> dict:
        """Reduce the step's loads over the global batch, update the biases, return a summary."""
        experts = self.num_experts
        device = self.mesh.device
        table = torch.zeros(len(self.layer_ids), 2 * experts + 6, dtype=torch.float64,
                            device=device)
        for row, layer in self.local:
            stats = layer.pop_step_stats()
            values = [stats["tokens_per_expert"], stats["dropped"], stats["balance_prob_sum"],
                      *(stats[key] for key in BALANCE_KEYS), stats["forwards"]]
            table[row] = torch.cat([v.to(device, torch.float64).reshape(-1) for v in values])
        self.mesh.comm("dp_cp").all_reduce(table)  # cp ranks route parts of one batch
        if self.balance == "bias":
            for row, layer in self.local:
                layer.update_bias(table[row, :experts])
        self.mesh.comm("pp").all_reduce(table)
        self.last_loads = table[:, :experts]
        return summarize_loads(table, self.layer_ids, experts, whole_sequences=self.mesh.cp == 1)


BALANCE_KEYS = ("balance_tokens", "balance_micro_batch", "balance_sequence_sum",
                "balance_sequences")
"""The scalar balance numbers of a layer's step statistics, in their table columns' order."""


def summarize_loads(table: torch.Tensor, layer_ids: list[int], experts: int | None = None,
                    whole_sequences: bool = True) -> dict:
    """Per-layer load summary from a ``[layers, columns]`` table: ``experts`` loads, dropped,
    then (when the table has them, see the module docstring) the balance columns.

    ``max_over_mean`` is the busiest expert's load over the mean load (1 = perfectly balanced),
    ``cv`` the coefficient of variation (population std / mean) of the tokens per expert.
    ``whole_sequences``: the forwards saw whole sequences (no context parallelism), so the
    micro-batch and sequence balance losses are reported too.
    """
    experts = table.shape[1] - 1 if experts is None else experts
    layers = {}
    for row, layer_id in enumerate(layer_ids):
        load = table[row, :experts]
        mean = float(load.mean())
        layers[str(layer_id)] = {
            "min_load": int(load.min()),
            "max_load": int(load.max()),
            "mean_load": mean,
            "max_over_mean": float(load.max()) / mean if mean else 0.0,
            "cv": float(load.std(unbiased=False)) / mean if mean else 0.0,
            "dropped": int(table[row, experts]),
        }
        if table.shape[1] > experts + 1:
            layers[str(layer_id)]["balance_loss"] = _balance_losses(table[row], experts,
                                                                    whole_sequences)
    summary = {
        "dropped": int(table[:, experts].sum()),
        "max_over_mean": max((v["max_over_mean"] for v in layers.values()), default=0.0),
        "layers": layers,
    }
    scopes = [v["balance_loss"] for v in layers.values() if "balance_loss" in v]
    if scopes:
        summary["balance_loss"] = {scope: sum(s[scope] for s in scopes) / len(scopes)
                                   for scope in scopes[0]}
    return summary


def _balance_losses(row: torch.Tensor, experts: int, whole_sequences: bool) -> dict:
    """The balance loss per scope from one layer's reduced table row."""
    load, prob_sum = row[:experts], row[experts + 1:2 * experts + 1]
    tokens, micro_sum, sequence_sum, sequences, forwards = row[2 * experts + 1:].tolist()
    fraction = load / load.sum().clamp_min(1)
    losses = {"global-batch": float(experts * (fraction * prob_sum).sum() / max(tokens, 1.0))}
    if whole_sequences:
        losses["micro-batch"] = micro_sum / max(forwards, 1.0)
        losses["sequence"] = sequence_sum / max(sequences, 1.0)
    return losses
