"""Chat fine-tuning under parallel layouts: a chat ``.jsonl`` (generated here) trained with the
loss on assistant tokens only gives one process's losses (fp32, 1e-4), gradient norms and
first-step gradients under dp 2 × tp 2 (vocab-parallel cross-entropy), pp 2 with micro-batches
(gradient accumulation; and its held-out loss) and cp 2 with document masking, each step
normalised by the same trained-token count."""

from __future__ import annotations

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_FP32,
    reference_config,
    run_layout_with_gradients,
)
from tests.chat_data import chat_settings, write_chat_jsonl
from tests.helpers import assert_gradients_match, run_with_gradients, tiny_config

STEPS = 3
LOSS_TOLERANCE = 1e-4


def test_chat_data_matches_one_process_under_dp_tp_pp_and_cp(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl")
    base = (*chat_settings(source), "train.seq_len=64")
    cases = [tiny_config(*base, "parallel.dp=2", "parallel.tp=2", nproc=4),
             tiny_config(*base, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2",
                         "train.eval_every=3", "data.valid_fraction=0.05",
                         "train.eval_batches=1", nproc=4),
             tiny_config(*base, "parallel.dp=2", "parallel.cp=2", "data.document_mask=true",
                         nproc=4)]
    results = run_with_gradients(4, cases, STEPS)
    every_token = cases[0].train.global_batch * cases[0].train.seq_len
    for config, (records, gradients) in zip(cases, results, strict=True):
        reference, reference_grads = run_layout_with_gradients(reference_config(config), 1,
                                                               STEPS)
        label = config.parallel
        for got, want in zip(records, reference, strict=True):
            assert abs(got["loss"] - want["loss"]) <= LOSS_TOLERANCE, (label, got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) <= \
                GRAD_NORM_RTOL_FP32 * want["grad_norm"], (label, got, want)
            # normalised by the same count: the assistant tokens of the whole global batch
            assert got["tokens"] == want["tokens"], (label, got, want)
            assert 0 < got["tokens"] < every_token, label
            if "eval_loss" in want:  # held-out loss over assistant tokens too
                assert abs(got["eval_loss"] - want["eval_loss"]) <= LOSS_TOLERANCE, label
        assert_gradients_match(gradients, reference_grads, label)
