"""``meshtrain eval``: the lm-evaluation-harness with meshtrain's model, against the harness's own
Hugging Face model on the same weights.

A tiny model trains a few steps at dp 2 (a checkpoint of its last step and its final weights),
is exported with ``meshtrain convert --to-hf``, and three local tasks (multiple choice, rolling
log-likelihood, generation until a stop sequence) are scored three ways: ``meshtrain eval`` on
the final weights, ``meshtrain eval`` on the dp-2 checkpoint (another batch size), and
``lm_eval --model hf`` (its ``simple_evaluate``) on the export. Every document's log-likelihoods
must agree within 1e-4, every generation and every accuracy exactly. Then the refusals: no
harness installed, bad options, a task whose data is not on this machine, no weights."""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness_tasks import (
    TASKS,
    TINY_MODEL,
    write_corpus,
    write_tasks,
    write_tokenizer,
)

pytest.importorskip("lm_eval")


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _leaves(value):
    """The innermost ``[log-likelihood, greedy]`` pairs, numbers and strings of a sample's
    responses, in order."""
    if isinstance(value, list) and value and not isinstance(value[0], list):
        return [tuple(value)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [(value,)]


def _responses(results: dict) -> dict[str, dict[int, list]]:
    return {task: {sample["doc_id"]: _leaves(sample["resps"]) for sample in samples}
            for task, samples in results["samples"].items()}


def _assert_same(ours: dict, theirs: dict, tolerance: float) -> None:
    for task in TASKS:
        assert ours[task].keys() == theirs[task].keys(), task
        for doc, answers in ours[task].items():
            for mine, other in zip(answers, theirs[task][doc], strict=True):
                for a, b in zip(mine, other, strict=True):
                    if isinstance(a, float):
                        assert a == pytest.approx(b, abs=tolerance), (task, doc, mine, other)
                    else:
                        assert a == b, (task, doc, mine, other)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained 6 steps at dp 2 with a checkpoint of step 6; its tokenizer and tasks."""
    from meshtrain.cli import main

    root = tmp_path_factory.mktemp("eval")
    tokenizer = write_tokenizer(root / "tokenizer")
    corpus = write_corpus(root / "corpus.txt")
    run = root / "run"
    assert main(["train", "--nproc", "2", "--steps", "6", "--run-dir", str(run),
                 *_sets(*TINY_MODEL, "parallel.dp=2", "checkpoint.every=6",
                        f"data.source={corpus}", f"data.tokenizer={tokenizer}")]) == 0
    return root, run, write_tasks(root / "tasks")


def test_eval_matches_lm_eval_hf_from_final_weights_and_a_dp2_checkpoint(trained, meshtrain):
    root, run, tasks = trained
    outputs = {}
    for name, source, batch in (("final", run, "3"),
                                ("checkpoint", run / "checkpoints" / "step_00000006", "5")):
        done = meshtrain("eval", str(source), "--tasks", ",".join(TASKS), "--include-path",
                         str(tasks), "--output", str(root / f"{name}.json"), "--log-samples",
                         "--batch-size", batch, "--device", "cpu")
        assert done.returncode == 0, done.stderr
        assert "tiny_mc" in done.stdout  # the harness's table
        outputs[name] = json.loads((root / f"{name}.json").read_text())
    assert meshtrain("convert", "--to-hf", str(run), "--out", str(root / "hf")).returncode == 0

    pytest.importorskip("accelerate")  # lm_eval's hf model needs it
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from meshtrain.training.harness.tasks import results_json

    reference = simple_evaluate(model="hf", model_args={"pretrained": str(root / "hf"),
                                                        "dtype": "float32"},
                                device="cpu", batch_size=4, tasks=list(TASKS),
                                task_manager=TaskManager(include_path=str(tasks)),
                                log_samples=True)
    reference = json.loads(results_json(reference))  # lists, as in our --output JSON
    final = outputs["final"]
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert final["results"][task][metric] == reference["results"][task][metric], task
        assert final["results"][task][metric] == outputs["checkpoint"]["results"][task][metric]
    assert final["results"]["tiny_roll"]["word_perplexity,none"] == pytest.approx(
        reference["results"]["tiny_roll"]["word_perplexity,none"], rel=1e-5)
    ours = _responses(final)
    _assert_same(ours, _responses(reference), 1e-4)
    _assert_same(ours, _responses(outputs["checkpoint"]), 1e-5)
    assert {len(ours[task]) for task in TASKS} == {8, 4}  # every document was scored
    mc_scores = [pair[0] for answers in ours["tiny_mc"].values() for pair in answers]
    assert len(set(mc_scores)) > 3 and all(score < 0 for score in mc_scores)


def test_eval_refusals(trained, meshtrain, monkeypatch, tmp_path):
    root, run, tasks = trained
    base = ["eval", str(run), "--include-path", str(tasks)]
    cases = [
        (["--tasks", "tiny_mc", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
        (["--tasks", "tiny_mc", "--limit", "0"], "--limit 0 must be at least 1"),
        (["--tasks", "tiny_mc", "--device", "cuda:7"] if not _cuda() else
         ["--tasks", "tiny_mc", "--device", "nonsense"], "--device"),
        (["--tasks", "tiny_mc", "--output", str(tmp_path)], "is a directory"),
    ]
    elsewhere = tmp_path / "remote"
    elsewhere.mkdir()
    (elsewhere / "remote.yaml").write_text(
        "task: remote_task\ndataset_path: nobody/not-on-this-machine\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\n'
        'doc_to_target: "{{a}}"\n')
    for args, message in cases:
        done = meshtrain(*base, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in _said(done) and "Traceback" not in done.stderr, done.stderr
    remote = meshtrain("eval", str(run), "--tasks", "remote_task", "--include-path",
                       str(elsewhere))
    assert remote.returncode == 2, remote.stderr
    for words in ('task "remote_task" could not be loaded', "Nothing is downloaded",
                  "--include-path"):
        assert words in _said(remote), remote.stderr
    nothing = meshtrain("eval", str(tmp_path), "--tasks", "tiny_mc", "--include-path",
                        str(tasks))
    assert nothing.returncode == 2 and "holds no weights" in _said(nothing)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    missing = meshtrain("eval", str(run), "--tasks", "tiny_mc")
    assert missing.returncode == 2 and 'pip install "meshtrain[eval]"' in _said(missing)


def _said(done) -> str:
    """stderr with its line wrapping undone."""
    return " ".join(done.stderr.split())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
