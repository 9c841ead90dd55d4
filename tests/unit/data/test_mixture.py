"""Weighted data mixtures (``data.sources``): shares honoured exactly, the order independent of
the layout, resume bit-exact, tokens per source reported."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError, load_config
from meshtrain.data.mixture import MixtureSampler
from tests.helpers import tiny_config


def _sources(tmp_path, n=3):
    paths = []
    for i in range(n):
        path = tmp_path / f"source{i}.txt"
        path.write_text("".join(f"source {i} line {k}: {'abc' * (k % 7)}\n" for k in range(400)))
        paths.append(str(path))
    return paths


def test_weights_are_honoured_within_one_sample():
    sampler = MixtureSampler([50, 70, 90], [0.5, 0.3, 0.2], ["a", "b", "c"], 8, seed=3)
    for step in range(125):  # 1,000 samples
        sampler.global_indices(step)
        sampler.advance()
    shares = sampler.samples_per_source()
    assert sum(shares.values()) == 1000
    for name, weight in zip("abc", (0.5, 0.3, 0.2), strict=True):
        assert abs(shares[name] - 1000 * weight) <= 1  # well inside 2 %


def test_order_does_not_depend_on_the_layout():
    one = MixtureSampler([40, 60], [0.6, 0.4], ["a", "b"], 8, seed=1)
    ranks = [MixtureSampler([40, 60], [0.6, 0.4], ["a", "b"], 8, seed=1, dp_rank=r, dp_size=2,
                            microbatches=2) for r in range(2)]
    for step in range(30):  # several epochs of both sources
        merged = [i for s in ranks for micro in s.local_microbatch_indices(step) for i in micro]
        assert merged == one.global_indices(step)
        for s in (one, *ranks):
            s.advance()
    # each source's samples are visited once per epoch
    fresh = MixtureSampler([40, 60], [0.6, 0.4], ["a", "b"], 8, seed=1)
    seen = []
    for step in range(10):
        seen += fresh.global_indices(step)
        fresh.advance()
    first_epoch = [i for i in seen if i < 40][:40]
    assert sorted(first_epoch) == list(range(40))


def test_resume_is_bit_exact_and_refuses_another_mixture():
    a = MixtureSampler([40, 60], [0.6, 0.4], ["a", "b"], 8, seed=1)
    for step in range(7):
        a.global_indices(step)
        a.advance()
    b = MixtureSampler([40, 60], [0.6, 0.4], ["a", "b"], 8, seed=1)
    b.load_state_dict(a.state_dict())
    for step in range(7, 20):
        assert a.global_indices(step) == b.global_indices(step)
        a.advance()
        b.advance()
    other = MixtureSampler([40, 60], [0.5, 0.5], ["a", "b"], 8, seed=1)
    with pytest.raises(ValueError, match="mixture"):
        other.load_state_dict(a.state_dict())


def test_training_with_a_mixture_reports_tokens_and_resumes_exactly(tmp_path):
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    paths = _sources(tmp_path)
    spec = ",".join(f"{p}:{w}" for p, w in zip(paths, (0.5, 0.3, 0.2), strict=True))
    overrides = (f"data.sources={spec}", "train.steps=6", "checkpoint.every=3")
    whole = Trainer(tiny_config(*overrides, run_dir=str(tmp_path / "a")), ParallelMesh()).fit()
    last = whole[-1]["tokens_per_source"]
    assert sum(last.values()) == 6 * 8 * 16
    assert last == {paths[0]: 24 * 16, paths[1]: 14 * 16, paths[2]: 10 * 16}
    first = Trainer(tiny_config(*overrides, run_dir=str(tmp_path / "b")), ParallelMesh())
    losses = [first.train_step()["loss"] for _ in range(3)]
    first.save_checkpoint()
    resumed = Trainer(tiny_config(*overrides, "checkpoint.resume=auto",
                                  run_dir=str(tmp_path / "b")), ParallelMesh()).fit()
    assert losses + [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_mixture_matches_one_process_at_dp2(tmp_path):
    from meshtrain.commands.verify import run_layout
    from tests.helpers import assert_layouts_match_one_process

    paths = _sources(tmp_path, 2)
    spec = f"data.sources={paths[0]}:0.7,{paths[1]}:0.3"
    results = assert_layouts_match_one_process(
        2, [tiny_config(spec, "parallel.microbatches=2", nproc=2)], 3)
    one = run_layout(tiny_config(spec, "parallel.microbatches=4"), 1, 3)
    assert results[0][-1]["tokens_per_source"] == one[-1]["tokens_per_source"]


def test_config_forms_and_bad_mixtures(tmp_path):
    paths = _sources(tmp_path, 2)
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[data]\nsources = [{{path = "{paths[0]}", weight = 3}}, '
                    f'{{path = "{paths[1]}", weight = 1}}]\n')
    config = load_config(toml)
    assert config.data.sources == [{"path": paths[0], "weight": 3.0},
                                   {"path": paths[1], "weight": 1.0}]
    cases = [
        ([f"data.sources={paths[0]}"], "has no weight"),
        ([f"data.sources={paths[0]}:0"], "weights must be positive"),
        ([f"data.sources={paths[0]}:x"], "not a valid float"),
        ([f"data.sources={tmp_path}/missing.txt:1"], "does not exist"),
        ([f"data.sources={paths[0]}:1", f"data.source={paths[1]}"], "both set"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            tiny_config(*overrides)
