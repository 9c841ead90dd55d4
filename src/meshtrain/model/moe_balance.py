"""Load-balance statistics of a MoE layer's routing, at the three scopes of the auxiliary loss.

The balance loss of a set of tokens is ``E * sum_i f_i * P_i`` (Switch Transformer): ``f_i`` the
fraction of the set's ``T * k`` assignments that chose expert ``i`` (before capacity dropping; no
gradient) and ``P_i`` the mean over its ``T`` tokens of expert ``i``'s router probability
(sigmoid scores normalised to sum to 1 per token first). It is 1 when both are uniform and
grows with imbalance. ``model.moe_balance_scope`` says which set (:class:`~meshtrain.model.moe.
MoE` multiplies by ``moe_aux_coef`` for the objective):

* ``micro-batch``: one forward's tokens; the trainer averages the micro-batches' losses;
* ``sequence``: each sequence on its own, averaged over the sequences (DeepSeek's sequence-wise
  balance loss);
* ``global-batch``: ``f`` of every token of the step (all micro-batches, all data- and
  context-parallel ranks), ``P`` likewise. Given the global ``f`` the loss is linear in the
  probabilities, so each forward contributes ``E * sum_i f_i * (its probability sum_i) / (its
  tokens)`` and the trainer's average over the step's equal-sized micro-batches is exactly the
  global-batch loss.

The helpers here are plain tensor functions (no communication); the layer sums counts over the
ranks that share a sequence or a batch through the communicators the trainer gives it.
"""

from __future__ import annotations

import torch


def selection_probs(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """The per-token probabilities ``P`` averages: softmax scores as they are, sigmoid scores
    normalised to sum to 1 per token."""
    if score_func == "sigmoid":
        return scores / scores.sum(dim=-1, keepdim=True)
    return scores


def sequence_counts(indices: torch.Tensor, seq_len: int, num_experts: int) -> torch.Tensor:
    """Assignments per (sequence, expert) of ``indices`` [T, k] whose ``T`` tokens are whole
    sequences of ``seq_len`` positions: a LongTensor [T / seq_len, E]."""
    tokens, k = indices.shape
    sequences = max(tokens // max(seq_len, 1), 1)
    sequence = (torch.arange(tokens, device=indices.device) // seq_len).repeat_interleave(k)
    key = sequence * num_experts + indices.reshape(-1)
    counts = torch.zeros(sequences * num_experts, dtype=torch.long, device=indices.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return counts.view(sequences, num_experts)


def balance(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: float | torch.Tensor,
            num_experts: int) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` over the last dimension, with ``f = counts / counts.sum()`` and
    ``P = prob_sums / tokens`` (leading dimensions, e.g. sequences, are kept)."""
    counts = counts.float()
    fraction = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1)
    return num_experts * (fraction * prob_sums / tokens).sum(dim=-1)


@torch.no_grad()
def forward_balance_stats(probs: torch.Tensor, indices: torch.Tensor,
                          tokens_per_expert: torch.Tensor, seq_len: int | None,
                          num_experts: int) -> dict[str, torch.Tensor]:
    """One forward's contribution to the step's balance numbers (detached, on the device):
    ``prob_sum`` [E] (the probabilities summed over its tokens), ``tokens``, ``micro_batch``
    (its own balance loss), ``sequence_sum`` (the sum of its sequences' balance losses) and
    ``sequences``. On a rank that holds only part of each sequence (context parallelism) the
    last three describe that part, not the whole."""
    tokens = probs.shape[0]
    prob_sum = probs.detach().float().sum(dim=0)
    seq = seq_len or max(tokens, 1)
    per_sequence = sequence_counts(indices, seq, num_experts)
    sequence_probs = probs.detach().float().reshape(per_sequence.shape[0], -1,
                                                   num_experts).sum(dim=1)
    return {
        "prob_sum": prob_sum,
        "tokens": prob_sum.new_tensor(float(tokens)),
        "micro_batch": balance(tokens_per_expert, prob_sum, max(tokens, 1), num_experts),
        "sequence_sum": balance(per_sequence, sequence_probs, seq, num_experts).sum(),
        "sequences": prob_sum.new_tensor(float(per_sequence.shape[0])),
    }
