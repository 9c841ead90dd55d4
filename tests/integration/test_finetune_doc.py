"""``docs/finetune.md`` runs: its ``sh`` blocks, in order, for a tiny random model of each family
(Llama 3.1, Qwen2.5, Qwen3), as ``tests/integration/test_guide.py`` runs the guide's: each block
in its own ``bash -e`` from one empty directory, this checkout's ``meshtrain`` and ``python``
first on ``PATH``. Afterwards the harness must have scored the converted checkpoint and the
fine-tuned run on the page's task, the run must have trained on the conversations from the
converted weights and evaluated, and exported a model of the same architecture and RoPE that
``transformers`` loads.

The fine-tuning step trains on chat data (``data.format = "chat"``, ``data.train_on``); a build
without those keys skips the walkthrough (:data:`CHAT_SFT`) rather than failing it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshtrain.config.sections import DataConfig
from tests.integration.test_guide import (
    _WRAPPERS,
    _install_tools,
    _user_env,
    guide_blocks,
    run_doc_blocks,
)

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

DOC = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
ARCHITECTURES = {"llama3.1": "LlamaForCausalLM", "qwen2.5": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
CHAT_SFT = {"format", "train_on"} <= {f.name for f in dataclasses.fields(DataConfig)}
"""Whether this build trains on chat data, which the page's fine-tuning step needs."""


def test_sh_blocks_are_found():
    blocks = [block for _, block in guide_blocks(DOC.read_text())]
    for command in ("meshtrain convert --from-hf", "meshtrain eval start", "data.format=chat",
                    "data.train_on=assistant", "checkpoint.init_from", "eval_loss",
                    "meshtrain eval runs/finetune", "meshtrain convert --to-hf"):
        assert any(command in block for block in blocks), command


@pytest.mark.skipif(not CHAT_SFT, reason="chat-format fine-tuning (data.format) not in this build")
@pytest.mark.parametrize("family", [
    family if family == "llama3.1" else pytest.param(family, marks=pytest.mark.slow)
    for family in ARCHITECTURES])  # one family in `make test` (20 s each), all in `make bench`
def test_finetune_walkthrough_runs(tmp_path, family):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    _install_tools(bin_dir, _WRAPPERS)
    env = dict(_user_env(bin_dir), FAMILY=family, HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    outputs = [out for _, out in run_doc_blocks(DOC, work, env)]

    source = json.loads((work / "hf-model" / "config.json").read_text())
    exported = json.loads((work / "hf-finetuned" / "config.json").read_text())
    assert exported["architectures"] == source["architectures"] == [ARCHITECTURES[family]]
    assert exported["rope_parameters"] == source["rope_parameters"]
    assert (work / "hf-finetuned" / "tokenizer.json").is_file()
    assert "chat_template" in json.loads(
        (work / "hf-finetuned" / "tokenizer_config.json").read_text())
    run_config = json.loads((work / "runs/finetune/config.json").read_text())
    assert run_config["checkpoint"]["init_from"] == "start"
    assert run_config["parallel"]["tp"] == 2
    assert run_config["data"]["format"] == "chat"
    records = [json.loads(r) for r in
               (work / "runs/finetune/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 5))
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert outputs[-3].count("held-out loss") == 2

    scores = {}
    for name in ("before", "after"):  # the harness's results JSON, 40 documents scored
        results = json.loads((work / "scores" / f"{name}.json").read_text())
        assert results["n-samples"]["sums"]["effective"] == 40
        scores[name] = results["results"]["sums"]["acc,none"]
        assert 0.0 <= scores[name] <= 1.0
    assert (f"sums accuracy: {scores['before']:.3f} before, {scores['after']:.3f} after"
            in outputs[-2])
    assert f"{ARCHITECTURES[family]} {{'rope_type'" in outputs[-1]
