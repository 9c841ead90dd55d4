"""The three scopes of the MoE auxiliary loss (``model.moe_balance_scope``) on one process: what
each computes by hand, that the global-batch loss summed over micro-batches is the whole batch's
(value and gradient) while the micro-batch loss is not, the step's balance numbers, and the
config check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.model import build_model
from meshtrain.model.moe_balance import balance, forward_balance_stats, sequence_counts
from meshtrain.training.moe_stats import summarize_loads
from tests.helpers import tiny_config

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=64, moe_experts=4,
                     moe_top_k=2, moe_ffn_dim=16, moe_balance="aux-loss", moe_aux_coef=0.1)


def _moe(**changes):
    return build_model(dataclasses.replace(CONFIG, **changes)).layers["0"].moe


def _sequences(batch: int = 4, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, seq, CONFIG.dim, generator=torch.Generator().manual_seed(seed))


def test_sequence_counts_and_balance_by_hand():
    indices = torch.tensor([[0, 1], [1, 2], [0, 3], [0, 1]])  # two sequences of two tokens
    counts = sequence_counts(indices, 2, 4)
    assert counts.tolist() == [[1, 2, 1, 0], [2, 1, 0, 1]]
    # Uniform probabilities: f . P = 1/E whatever f, so the balance loss is 1 per sequence.
    uniform = torch.full((2, 4), 0.5)
    torch.testing.assert_close(balance(counts, uniform, 2, 4), torch.ones(2))
    # All mass on expert 0 for sequence 0: E * f_0 * 1 = 4 * 1/4.
    skewed = torch.tensor([[2.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]])
    torch.testing.assert_close(balance(counts, skewed, 2, 4), torch.tensor([1.0, 1.0]))


def test_sequence_scope_averages_the_sequences_own_losses():
    x = _sequences()
    moe = _moe(moe_balance_scope="sequence")
    moe(x)
    each = []
    alone = _moe()  # micro-batch scope: one sequence per forward is that sequence's loss
    alone.load_state_dict(moe.state_dict())
    for sequence in x:
        alone(sequence.unsqueeze(0))
        each.append(alone.last_stats["aux_loss"])
    torch.testing.assert_close(moe.last_stats["aux_loss"], torch.stack(each).mean())


def _aux_and_grads(moe, batches: list[torch.Tensor]):
    """Summed aux loss of ``batches`` (each micro-batch's divided by their number, as the trainer
    does) and its gradients with respect to the router weight and the inputs."""
    moe.router.weight.grad = None
    inputs = [b.clone().requires_grad_() for b in batches]
    total = torch.zeros(())
    for b in inputs:
        moe(b)
        total = total + moe.last_stats["aux_loss"] / len(inputs)
    total.backward()
    return (total.detach(), moe.router.weight.grad.clone(),
            torch.cat([b.grad for b in inputs]))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_global_batch_loss_over_micro_batches_is_the_whole_batch_loss(score):
    x = _sequences(batch=4, seq=8)
    whole = _moe(moe_balance_scope="global-batch", moe_score=score)
    expected = _aux_and_grads(whole, [x])
    split = _moe(moe_balance_scope="global-batch", moe_score=score)
    split.load_state_dict(whole.state_dict())
    # What the trainer's pre-pass does: route every micro-batch first, then set the step's load.
    split.load_tally = torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        for part in x.split(2):
            split(part)
    split.global_load, split.load_tally = split.load_tally, None
    got = _aux_and_grads(split, list(x.split(2)))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)

    # The micro-batch scope differs: each half's loss uses its own load fractions.
    local = _moe(moe_balance_scope="micro-batch", moe_score=score)
    local.load_state_dict(whole.state_dict())
    _, router_grad, _ = _aux_and_grads(local, list(x.split(2)))
    assert (router_grad - expected[1]).norm() > 1e-3 * expected[1].norm()


class _DoublingComm:
    """A stand-in for the trainer's dp × cp group of two ranks holding the same tokens."""

    active, size = True, 2

    def __init__(self):
        self.calls = 0

    def all_reduce(self, tensor):
        self.calls += 1
        tensor.mul_(2)


def test_global_batch_load_is_summed_over_the_batch_once_per_step():
    moe = _moe(moe_balance_scope="global-batch")
    moe.batch_comm = comm = _DoublingComm()
    x = _sequences()
    moe(x)
    first = moe.global_load.clone()
    assert first.sum().item() == 2 * x.shape[0] * x.shape[1] * 2  # two ranks' assignments
    moe(x)  # e.g. a recomputation in backward: the step's load is kept
    assert comm.calls == 1 and torch.equal(moe.global_load, first)
    # Ranks with the same tokens: the global fractions are the local ones, the loss too.
    alone = _moe(moe_balance_scope="global-batch")
    alone.load_state_dict(moe.state_dict())
    alone(x)
    torch.testing.assert_close(moe.last_stats["aux_loss"], alone.last_stats["aux_loss"])


def test_forward_balance_stats_and_step_summary():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.4, 0.3, 0.2],
                          [0.5, 0.1, 0.1, 0.3], [0.6, 0.2, 0.15, 0.05]])
    indices = torch.tensor([[0, 1], [1, 2], [0, 3], [0, 1]])
    counts = torch.tensor([3, 3, 1, 1])
    stats = forward_balance_stats(probs, indices, counts, 2, 4)
    assert stats["micro_batch"].item() == pytest.approx(4 * 0.2875)  # the hand-computed loss
    torch.testing.assert_close(stats["prob_sum"], probs.sum(0))
    assert stats["sequences"].item() == 2 and stats["tokens"].item() == 4
    by_hand = balance(sequence_counts(indices, 2, 4), probs.view(2, 2, 4).sum(1), 2, 4).sum()
    torch.testing.assert_close(stats["sequence_sum"], by_hand)

    # One layer's step table: loads, dropped, probability sums, tokens, the micro-batch and
    # sequence sums, sequences, forwards (two forwards of these four tokens).
    row = torch.cat([2 * counts.double(), torch.tensor([0.0]), 2 * probs.sum(0).double(),
                     torch.tensor([8.0, 2 * stats["micro_batch"].item(),
                                   2 * stats["sequence_sum"].item(), 4.0, 2.0],
                                  dtype=torch.float64)])
    summary = summarize_loads(row.unsqueeze(0), [0], experts=4)
    losses = summary["layers"]["0"]["balance_loss"]
    assert losses["global-batch"] == pytest.approx(4 * 0.2875)
    assert losses["micro-batch"] == pytest.approx(4 * 0.2875)
    assert losses["sequence"] == pytest.approx(stats["sequence_sum"].item() / 2)
    assert summary["layers"]["0"]["min_load"] == 2 and summary["balance_loss"] == losses
    no_sequences = summarize_loads(row.unsqueeze(0), [0], experts=4, whole_sequences=False)
    assert set(no_sequences["layers"]["0"]["balance_loss"]) == {"global-batch"}


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_balance_scope=global"],
     'model.moe_balance_scope = "global" is not valid; choose one of: micro-batch, sequence, '
     'global-batch'),
    (["model.moe_balance=bias", "model.moe_balance_scope=sequence"],
     'moe_balance_scope = "sequence" is a scope of the auxiliary loss'),
])
def test_bad_balance_scopes_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config("model.moe_experts=4", *overrides)


def test_valid_balance_scopes():
    for scope in ("micro-batch", "sequence", "global-batch"):
        assert tiny_config("model.moe_experts=4",
                           f"model.moe_balance_scope={scope}").model.moe_balance_scope == scope
    assert tiny_config("model.moe_experts=4", "model.moe_balance=bias",
                       "model.moe_balance_scope=global-batch")
