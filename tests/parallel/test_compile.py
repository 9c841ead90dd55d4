"""``train.compile``: compiled blocks train to the same numbers as eager ones (fp32).

Tolerance: meshtrain.commands.verify's fp32 one (2e-4 absolute on the loss, 1e-3 relative on the
gradient norm): inductor may fuse and reorder fp32 element-wise arithmetic, which moves the last
bits.
"""

from __future__ import annotations

import pytest

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
    run_layout,
)
from meshtrain.config import ConfigError
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

STEPS = 3


def _assert_same(records: list[dict], reference: list[dict]) -> None:
    report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], report


def test_compiled_blocks_match_eager_on_one_process():
    eager = run_layout(tiny_config(), 1, STEPS)
    _assert_same(run_layout(tiny_config("train.compile=true"), 1, STEPS), eager)


@pytest.mark.slow  # ~15 s of compilation in two processes; `make bench` runs it
def test_compiled_blocks_match_eager_under_zero3_checkpointing_and_pp():
    eager = run_layout(tiny_config(), 1, STEPS)
    # ZeRO-3's gather / free hooks stay outside the compiled forward; full checkpointing
    # recomputes the compiled forward; pipeline stages compile only the blocks they hold.
    cases = [tiny_config("train.compile=true", "parallel.zero=3", nproc=2),
             tiny_config("train.compile=true", "parallel.activation_checkpointing=full",
                         nproc=2),
             tiny_config("train.compile=true", "parallel.pp=2", "parallel.microbatches=2",
                         nproc=2)]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    for records in results:
        _assert_same(records, eager)


MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")


@pytest.mark.slow  # ~75 s of compilation; the one-process compile test stays in `make test`
def test_compiled_blocks_match_eager_under_tp_sp_moe_ep_and_zero_bubble():
    """Collectives (tp regions, the MoE all-to-alls) and deferred weight gradients run eagerly
    between compiled pieces of each block; every layout matches its eager one-process run."""
    cases = [tiny_config("parallel.tp=2", "parallel.sequence_parallel=true", nproc=2),
             tiny_config(*MOE, "parallel.ep=2", nproc=2),
             tiny_config(*MOE, "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2),
             tiny_config("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4",
                         "parallel.pp_schedule=zb-h1", nproc=2)]
    compiled = [tiny_config("train.compile=true", *_overrides(c), nproc=2) for c in cases]
    results = run_distributed(2, train_many, [c.to_dict() for c in compiled], STEPS,
                              timeout=900)[0]
    for config, records in zip(cases, results, strict=True):
        _assert_same(records, run_layout(reference_config(config), 1, STEPS))
    one = tiny_config(*MOE, "train.compile=true")
    _assert_same(run_layout(one, 1, STEPS), run_layout(reference_config(one), 1, STEPS))


def _overrides(config) -> list[str]:
    """The --set overrides that rebuild ``config`` (its parallel and model sections)."""
    out = []
    for section in ("parallel", "model"):
        for key, value in config.to_dict()[section].items():
            if isinstance(value, bool):
                value = str(value).lower()
            out.append(f"{section}.{key}={value}")
    return out


def test_compile_refuses_selective_checkpointing():
    with pytest.raises(ConfigError, match="train.compile") as error:
        tiny_config("train.compile=true", "parallel.activation_checkpointing=selective")
    assert "selective" in str(error.value) and "Set train.compile = false" in str(error.value)


def test_every_block_shares_one_compiled_graph():
    """The blocks' shared RoPE tables are filled before the first trace (the first call runs
    eagerly), so the graph never guards on a missing table and the 3 blocks compile one graph,
    not two (one more compilation of the block code, measured 15 s against 18 s cold)."""
    import torch
    from torch._dynamo.utils import counters

    from meshtrain.config import load_config
    from meshtrain.model import build_model
    from meshtrain.parallel.compile import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    config = load_config(None, ["model.dim=32", "model.n_layers=3", "model.n_heads=4",
                                "model.n_kv_heads=2", "model.ffn_dim=64", "model.vocab_size=256"])
    model = build_model(config.model, seed=0)
    eager = build_model(config.model, seed=0)
    assert compile_blocks(model) == 3
    tokens = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        out = model(tokens)
        out.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, eager(tokens), atol=1e-5, rtol=0)
