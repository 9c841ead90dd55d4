"""Document masking: a packed sample computes each document exactly as if it ran alone."""

from __future__ import annotations

import pytest
import torch

from meshtrain.config import ConfigError
from meshtrain.model.document_mask import document_layout
from tests.helpers import tiny_config

EOS = 7


def test_layout_positions_restart_after_each_eos():
    tokens = torch.tensor([[3, 4, EOS, 5, 6, 6, EOS, 1], [EOS, 2, 2, 2, 2, 2, 2, 2]])
    layout = document_layout(tokens, EOS)
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    mask = layout.mask[0, 0]
    assert mask[2, :3].all() and not mask[3, :3].any() and mask[3, 3]  # eos closes its document
    assert not mask.triu(1).any()  # still causal


def test_packed_documents_equal_running_them_separately():
    from meshtrain.config import ModelConfig
    from meshtrain.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64))
    docs = [torch.tensor([3, 4, 5, EOS]), torch.tensor([9, 8, 1, 2, 11, EOS]),
            torch.tensor([6, 6, 12])]
    packed = torch.cat(docs)[None]
    out = model(packed, document_layout(packed, EOS))
    start = 0
    for doc in docs:
        alone = model(doc[None])
        torch.testing.assert_close(out[:, start:start + len(doc)], alone, atol=1e-5, rtol=1e-5)
        start += len(doc)
    # without the mask the later documents see the earlier ones
    assert not torch.allclose(model(packed)[:, 4:10], model(docs[1][None]), atol=1e-3)


def _short_documents(tmp_path) -> str:
    """A .jsonl of short documents (5-40 characters), so every sample holds several."""
    import json
    import random

    rng = random.Random(0)
    words = ["def", "return", "x", "value", "for", "in", "range", "print", "(", ")", ":"]
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as handle:
        for _ in range(3000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
            handle.write(json.dumps({"text": text}) + "\n")
    return str(path)


def test_document_mask_matches_one_process_under_every_axis(tmp_path):
    from meshtrain.commands.verify import (
        GRAD_NORM_RTOL_FP32,
        LOSS_TOLERANCE_FP32,
        compare,
        reference_config,
        run_layout,
    )
    from tests.distributed import run_distributed
    from tests.helpers import train_many

    source = f"data.source={_short_documents(tmp_path)}"
    base = ("data.document_mask=true", "train.seq_len=64", source)
    cases = [tiny_config(*base, "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2),
             tiny_config(*base, "parallel.pp=2", "parallel.microbatches=4",
                         "model.n_layers=4", "parallel.pp_schedule=zb-v",
                         "parallel.virtual_stages=2", "parallel.activation_checkpointing=full",
                         nproc=2),
             tiny_config(*base, "parallel.zero=3", "parallel.microbatches=2",
                         "train.eval_every=2", "data.valid_fraction=0.05", nproc=2),
             tiny_config(*base, "parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2",
                         "model.moe_ffn_dim=32", "parallel.activation_checkpointing=selective",
                         nproc=2)]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], 3, timeout=900)[0]
    for config, records in zip(cases, results, strict=True):
        reference = run_layout(reference_config(config), 1, 3)
        report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
        assert report["ok"], (config.parallel, report)
    # the mask changes the computation: the loss differs from the unmasked run
    plain = run_layout(tiny_config("train.seq_len=64", source), 1, 1)
    masked = run_layout(tiny_config(*base), 1, 1)
    assert abs(plain[0]["loss"] - masked[0]["loss"]) > 1e-4


def test_document_mask_needs_an_eos(monkeypatch):
    from meshtrain.data import tokenizer
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    monkeypatch.setattr(tokenizer.ByteTokenizer, "eos_id", None)
    with pytest.raises(ConfigError, match="needs a tokenizer with an eos"):
        Trainer(tiny_config("data.document_mask=true"), ParallelMesh())
