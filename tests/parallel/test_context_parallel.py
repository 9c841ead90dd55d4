"""Context parallelism (``parallel.cp``): every layout with cp matches one process.

Parity is checked on fp32 with meshtrain.commands.verify's tolerances (2e-4 on the loss, 1e-3
relative on the gradient norm): cp changes only the order of floating-point sums (attention per
query chunk against gathered keys, gradients reduced over dp × cp), so the curves agree to rounding.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from meshtrain.config import ConfigError
from meshtrain.parallel.context import chunks_of_rank, local_positions, shard_sequence
from tests.distributed import run_distributed
from tests.helpers import assert_layouts_match_one_process, tiny_config


def test_each_rank_holds_one_early_and_one_late_chunk():
    assert [chunks_of_rank(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * 16).view(2, 16)
    parts = [shard_sequence(x, 4, r) for r in range(4)]
    # together the ranks hold every token exactly once, and the positions say where it was
    held = torch.cat([local_positions(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    assert torch.equal(torch.cat(parts, dim=1)[:, held.argsort()], x)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_equal_on_every_rank(cp):
    """Query-key pairs under the causal mask per rank: the load-balanced split gives every rank
    the same count (a plain split into cp pieces would not)."""
    seq = 16 * cp
    work = [int(sum(p + 1 for p in local_positions(seq, cp, r).tolist())) for r in range(cp)]
    assert len(set(work)) == 1
    assert sum(work) == seq * (seq + 1) // 2


@pytest.mark.parametrize("blockwise", [True, False])
def test_attention_over_gathered_chunks_equals_causal_attention(blockwise):
    """One rank holding both chunks (a cp group of one): the chunked attention, mask-free blocks
    or masked SDPA, gives plain causal attention's output and gradients."""
    import torch.nn.functional as F

    from meshtrain.parallel.comm import CommLog, CountedComm
    from meshtrain.parallel.context.attention import ContextParallelAttention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 24, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 24, 8, requires_grad=True) for _ in range(2))
    core = ContextParallelAttention(CountedComm("cp", None, 1, CommLog()), 0)
    core.blockwise = blockwise
    out = core(q, k, v)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_blockwise_merge_is_exact_for_a_late_chunk():
    """A query chunk at positions 3L..4L over a visible prefix and its causal square, merged by
    log-sum-exp, equals SDPA with the bottom-right causal mask (values and gradients)."""
    import torch.nn.functional as F

    from meshtrain.parallel.context.blockwise import blockwise_attention

    torch.manual_seed(1)
    rows, c = 8, 3
    q = torch.randn(2, 4, rows, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, (c + 1) * rows, 16, requires_grad=True) for _ in range(2))
    i, j = torch.arange(rows)[:, None], torch.arange((c + 1) * rows)[None, :]
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i + c * rows,
                                               enable_gqa=True)
    out = blockwise_attention(q, [(k[:, :, :c * rows], v[:, :, :c * rows], False),
                                  (k[:, :, c * rows:], v[:, :, c * rows:], True)])
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-5)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(reference, (q, k, v), grad), strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_indivisible_sequence_and_capacity_are_refused():
    with pytest.raises(ConfigError, match=r"seq_len = 20 is not divisible by 2 × cp = 8.*valid "
                                          r"cp for seq_len 20: 2, 5, 10"):
        tiny_config("parallel.cp=4", "train.seq_len=20", nproc=4)
    with pytest.raises(ConfigError, match="moe_capacity_factor = 1.5 with parallel.cp = 2"):
        tiny_config("parallel.cp=2", "model.moe_experts=4", "model.moe_capacity_factor=1.5",
                    nproc=2)
    with pytest.raises(ConfigError, match=r"dp × cp × tp × pp = 1 × 2 × 1 × 1 = 2 does not "
                                          r"equal --nproc 4"):
        tiny_config("parallel.cp=2", "parallel.dp=1", nproc=4)


def test_cp_alone_and_with_document_masking_and_evaluation_match_one_process(tmp_path):
    from tests.parallel.test_document_mask import _short_documents
    from tests.parallel.test_model_options import OPTIONS

    source = f"data.source={_short_documents(tmp_path)}"
    cases = [tiny_config("parallel.cp=2", nproc=2),
             tiny_config("parallel.cp=2", "data.document_mask=true", "train.seq_len=64", source,
                         "train.eval_every=2", "data.valid_fraction=0.05", nproc=2),
             tiny_config("parallel.cp=2", "model.moe_experts=4", "model.moe_top_k=2",
                         "model.moe_ffn_dim=32", "model.moe_balance=bias", nproc=2),
             tiny_config("parallel.cp=2", *OPTIONS, nproc=2)]  # biases, QK-norm, yarn RoPE
    records = assert_layouts_match_one_process(2, cases, 3)
    evals = [r["eval_loss"] for r in records[1] if "eval_loss" in r]
    from meshtrain.commands.verify import reference_config, run_layout

    reference = [r["eval_loss"] for r in run_layout(reference_config(cases[1]), 1, 3)
                 if "eval_loss" in r]
    assert evals and evals == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_cp_composes_with_every_axis():
    n4 = ("model.n_layers=4", "parallel.microbatches=4")
    moe = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
           "model.moe_balance=aux-loss")
    cases = [tiny_config("parallel.cp=4", nproc=4),
             tiny_config("parallel.cp=2", "parallel.dp=2", "parallel.zero=3",
                         "parallel.microbatches=2", nproc=4),
             tiny_config("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                         nproc=4),
             tiny_config("parallel.cp=2", "parallel.pp=2", *n4, nproc=4),
             tiny_config("parallel.cp=2", "parallel.pp=2", *n4, "parallel.pp_schedule=zb-h1",
                         "parallel.activation_checkpointing=full", nproc=4),
             tiny_config("parallel.cp=2", "parallel.pp=2", *n4, "parallel.pp_schedule=zb-v",
                         "parallel.virtual_stages=2", nproc=4),
             tiny_config("parallel.cp=2", "parallel.pp=2", *n4,
                         "parallel.pp_schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                         nproc=4),
             tiny_config("parallel.cp=2", "parallel.dp=2", "parallel.ep=2", *moe,
                         "parallel.activation_checkpointing=selective", nproc=4)]
    records = assert_layouts_match_one_process(4, cases, 3)
    kv_bytes = 8 * 16 * 16 * 4  # micro-batch 8 sequences x seq 16 x kv width 16 x fp32
    # cp 4 alone: per layer per step 2 all-gathers forward + 2 reduce-scatters backward of the
    # whole sequence's keys/values, 3/4 of each crossing the links (bus bytes), 2 layers
    assert records[0][0]["comm_bytes"]["cp"] == 2 * 4 * kv_bytes * 3 // 4
    # the planner's count of the same traffic (rank 0: its pipeline stage's layers) agrees
    from meshtrain.planner.cost.context_parallel import step_bus_bytes
    from meshtrain.planner.cost.workload import Workload, stage_layers

    for config, run in zip(cases, records, strict=True):
        layers = len(stage_layers(config.model, config.parallel.layout())[0])
        planned = step_bus_bytes(Workload.from_config(config), config.parallel.layout(), layers)
        measured = run[-1]["comm_bytes"]["cp"]
        assert abs(measured - planned) <= 0.15 * planned, (config.parallel, measured, planned)


def test_resume_a_cp2_checkpoint_at_cp1(tmp_path):
    from tests.parallel.test_checkpoint import (
        SPLIT,
        TOTAL,
        _cfg,
        resume_and_finish,
        train_then_stop,
        uninterrupted,
    )

    reference = uninterrupted(_cfg(tmp_path / "reference", nproc=1).to_dict())
    saved = _cfg(tmp_path / "run", "parallel.cp=2", "parallel.zero=1", nproc=2)
    first = run_distributed(2, train_then_stop, saved.to_dict(), SPLIT)[0]
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    rest = resume_and_finish(_cfg(tmp_path / "run", "checkpoint.resume=auto",
                                  nproc=1).to_dict())
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    # and back up to cp 2 x dp 2 (ZeRO-2): the same curve
    rest4 = run_distributed(4, resume_and_finish,
                            _cfg(tmp_path / "again", "parallel.cp=2", "parallel.zero=2",
                                 "checkpoint.resume=auto", nproc=4).to_dict())[0]
    assert len(rest4) == TOTAL - SPLIT
    assert first + rest4 == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


@pytest.mark.slow
def test_long_sequence_memory_falls_with_cp_as_the_planner_says(tmp_path):
    """seq 8192, a small model: each rank's activation memory (VmHWM at seq 8192 minus at 512,
    measured from outside) at cp 2 and 4 is near 1/cp of cp 1's, and within 15 % of the
    planner's estimate of the same difference."""
    from tests.helpers import load_benchmark

    long_context = load_benchmark("long_context")
    MODEL, RUN, SHORT_SEQ, measure = (long_context.MODEL, long_context.RUN,
                                      long_context.SHORT_SEQ, long_context.measure)
    from meshtrain.config import load_config
    from meshtrain.data.tokenizer import tokenizer_vocab_size
    from meshtrain.planner.cost.memory import rank_memory
    from meshtrain.planner.cost.workload import Workload

    def planned(cp: int, seq: int) -> float:
        config = load_config(None, [*MODEL, *RUN, f"parallel.cp={cp}", f"train.seq_len={seq}"])
        config.model.vocab_size = tokenizer_vocab_size(config.data.tokenizer)
        layers = list(range(config.model.n_layers))
        return rank_memory(Workload.from_config(config), config.parallel.layout(), 0, layers,
                           1.0).activation_bytes

    measured = {cp: max(measure(cp, 8192, tmp_path / str(cp))["activation_bytes"])
                for cp in (1, 2, 4)}
    for cp in (2, 4):
        assert measured[cp] <= 1.35 * measured[1] / cp, measured  # + the gathered K/V
    for cp, value in measured.items():
        expected = planned(cp, 8192) - planned(cp, SHORT_SEQ)
        assert abs(value - expected) <= 0.15 * expected, (cp, value, expected)
