"""Vocab-parallel cross-entropy: the loss of logits split over tp by vocabulary, computed without
ever gathering the full ``[tokens, vocab]`` logits (Megatron-LM's approach).

Per token: ``loss = log(sum_v exp(z_v - m)) - (z_target - m)`` with ``m`` the global max. Each tp
rank holds a vocabulary slice; one all-reduce(MAX) of the per-token max and one all-reduce(SUM) of
the stacked (sum of exps, target logit) pair make every rank's loss the full one. The gradient,
``softmax - onehot(target)``, is local to each slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.parallel.comm import CountedComm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, comm, ignore_index):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        token_max = logits.max(dim=-1).values
        comm.all_reduce(token_max, op=dist.ReduceOp.MAX)
        shifted = logits - token_max.unsqueeze(-1)
        exp = shifted.exp()
        valid = targets != ignore_index
        local_target = targets - vocab_start
        mine = valid & (local_target >= 0) & (local_target < local_vocab)
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1) * mine
        stats = torch.stack([exp.sum(dim=-1), target_logit])
        comm.all_reduce(stats)
        sum_exp, target_logit = stats[0], stats[1]
        loss = (sum_exp.log() - target_logit) * valid
        exp.div_(sum_exp.unsqueeze(-1))  # softmax slice, kept for backward
        ctx.save_for_backward(exp, index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 comm: CountedComm, ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses ``[N]`` (0 where ignored) from ``logits`` ``[N, vocab/tp]`` holding
    vocabulary ids ``[vocab_start, vocab_start + vocab/tp)``; identical on every tp rank."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, comm, ignore_index)
