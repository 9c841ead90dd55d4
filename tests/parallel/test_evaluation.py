"""Held-out evaluation (``train.eval_every``) under every layout against one process (fp32;
meshtrain.commands.verify's loss tolerance, 2e-4: the forward is the training forward, so
differences
are the ~1e-6 of summing in another order)."""

from __future__ import annotations

import pytest

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32, reference_config, run_layout
from meshtrain.config import ConfigError
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

STEPS = 4
EVAL = ("train.eval_every=2", "data.valid_fraction=0.05", "train.eval_batches=2")
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
       "model.moe_balance=bias", "model.moe_bias_rate=0.01")


def _eval_losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def test_eval_loss_at_every_eval_step_and_the_last_one():
    records = run_layout(tiny_config(*EVAL, "train.steps=5"), 1, 5)
    assert [s for s, _ in _eval_losses(records)] == [2, 4, 5]
    for r in records:
        if "eval_loss" in r:
            assert r["eval_ppl"] == pytest.approx(2.718281828 ** r["eval_loss"], rel=1e-6)
    # learning shows on held-out data too
    assert records[-1]["eval_loss"] < records[1]["eval_loss"]


LAYOUTS = [
    ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"),
    ("parallel.tp=2", "parallel.microbatches=4"),
    ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
     "parallel.microbatches=2"),
    ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=zb-v",
     "parallel.virtual_stages=2", "model.n_layers=4"),
    ("parallel.dp=4", "parallel.zero=3"),
    ("parallel.dp=4", "parallel.ep=2", *MOE),
]


def test_eval_loss_matches_one_process_under_every_layout():
    cases = [tiny_config(*EVAL, *layout, nproc=4) for layout in LAYOUTS]
    results = run_distributed(4, train_many, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    for config, records in zip(cases, results, strict=True):
        reference = run_layout(reference_config(config), 1, STEPS)
        got, want = _eval_losses(records), _eval_losses(reference)
        assert [s for s, _ in got] == [s for s, _ in want] == [2, 4]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert abs(a - b) < LOSS_TOLERANCE_FP32, (config.parallel, got, want)


def test_evaluation_changes_nothing_in_training():
    """With and without evaluation: the same training losses, norms and MoE statistics, bit
    for bit (no optimizer step, no data-position change, MoE loads untouched)."""
    cases = [tiny_config("data.valid_fraction=0.05", *MOE, "parallel.pp=2",
                         "parallel.microbatches=2", "model.n_layers=4", nproc=2),
             tiny_config("data.valid_fraction=0.05", *MOE, *EVAL[:1], "parallel.pp=2",
                         "parallel.microbatches=2", "model.n_layers=4", nproc=2)]
    plain, evaluated = run_distributed(2, train_many, [c.to_dict() for c in cases], STEPS,
                                       timeout=900)[0]
    assert _eval_losses(evaluated) and not _eval_losses(plain)
    for a, b in zip(plain, evaluated, strict=True):
        assert (a["loss"], a["grad_norm"], a["moe"]) == (b["loss"], b["grad_norm"], b["moe"])


def test_held_out_tail_is_never_trained_on_and_starts_a_document():
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    whole = Trainer(tiny_config(), ParallelMesh()).data.tokens
    data = Trainer(tiny_config("data.valid_fraction=0.05"), ParallelMesh()).data
    train, held = data.tokens, data.held_out
    assert len(train) + len(held) == len(whole) and len(held) >= 0.05 * len(whole)
    assert train.tolist() + held.tolist() == whole.tolist()
    eos = data.tokenizer.eos_id
    assert train.tolist()[-1] == eos  # the held-out part begins a document


def test_valid_source_file(tmp_path):
    valid = tmp_path / "valid.txt"
    valid.write_text("def held_out(x):\n    return x + 1\n" * 40)
    records = run_layout(tiny_config("train.eval_every=1", f"data.valid_source={valid}",
                                     "train.eval_batches=1"), 1, 2)
    assert len(_eval_losses(records)) == 2


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_every=2"], "needs held-out data"),
    (["data.valid_fraction=1.0"], "must be in [0, 1)"),
    (["data.valid_fraction=0.1", "data.valid_source=builtin"], "both set"),
    (["train.eval_every=2", "data.valid_source=/nonexistent/valid.txt"], "does not exist"),
    (["train.eval_every=1", "data.valid_fraction=0.1", "train.eval_batches=0"], "eval_batches"),
])
def test_bad_evaluation_configs(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        tiny_config(*overrides)


def test_too_little_held_out_data_is_refused(tmp_path):
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    tiny = tmp_path / "valid.txt"
    tiny.write_text("x")
    with pytest.raises(ConfigError, match="less than one sample"):
        Trainer(tiny_config("train.eval_every=1", f"data.valid_source={tiny}"), ParallelMesh())
