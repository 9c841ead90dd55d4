"""``docs/finetune.md`` runs: its ``sh`` blocks, in order, for a tiny random model of each family
(Llama 3.1, Qwen2.5, Qwen3), as ``tests/integration/test_guide.py`` runs the guide's: each block
in its own ``bash -e`` from one empty directory, this checkout's ``meshtrain`` and ``python``
first on ``PATH``. Afterwards the run must have trained from the converted weights, evaluated,
and exported a model of the same architecture and RoPE that ``transformers`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_guide import _install_tools, _user_env, guide_blocks, run_doc_blocks

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
ARCHITECTURES = {"llama3.1": "LlamaForCausalLM", "qwen2.5": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def test_sh_blocks_are_found():
    blocks = [block for _, block in guide_blocks(DOC.read_text())]
    for command in ("meshtrain convert --from-hf", "meshtrain prepare", "checkpoint.init_from",
                    "eval_loss", "meshtrain convert --to-hf"):
        assert any(command in block for block in blocks), command


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_finetune_walkthrough_runs(tmp_path, family):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    _install_tools(bin_dir)
    env = dict(_user_env(bin_dir), FAMILY=family)
    outputs = [out for _, out in run_doc_blocks(DOC, work, env)]

    source = json.loads((work / "hf-model" / "config.json").read_text())
    exported = json.loads((work / "hf-finetuned" / "config.json").read_text())
    assert exported["architectures"] == source["architectures"] == [ARCHITECTURES[family]]
    assert exported["rope_parameters"] == source["rope_parameters"]
    assert (work / "hf-finetuned" / "tokenizer.json").is_file()
    run_config = json.loads((work / "runs/finetune/config.json").read_text())
    assert run_config["checkpoint"]["init_from"] == "start"
    assert run_config["parallel"]["tp"] == 2
    records = [json.loads(r) for r in
               (work / "runs/finetune/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 5))
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert outputs[-2].count("held-out loss") == 2
    assert f"{ARCHITECTURES[family]} {{'rope_type'" in outputs[-1]
