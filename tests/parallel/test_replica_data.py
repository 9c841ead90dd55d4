"""Each replica group its own data (``data.replica_sources``): no group reads another's tokens.

Two sites hold texts with disjoint alphabets (letters at site A, digits and punctuation at site
B), so every token id a rank trains on says which site it came from. At replicas 2 × dp 2 each
rank's batches must hold only its group's ids, each step must train on every sample of both
groups' shares, and ``tokens_per_group`` must report each group's tokens.
"""

from __future__ import annotations

import math

import pytest

from meshtrain.config import ConfigError, config_from_dict
from tests.distributed import run_distributed
from tests.helpers import tiny_config

STEPS = 3
SITE_TEXT = {"a": "the quick brown fox jumps over a lazy dog\n",
             "b": "0123,4567;89(12)[34]=56+78-90."}


def _write_sites(tmp_path) -> list[str]:
    paths = []
    for name, line in SITE_TEXT.items():
        path = tmp_path / f"site_{name}.txt"
        path.write_text(line * 400)
        paths.append(str(path))
    return paths


def _batches_and_records(config_dict: dict, steps: int) -> tuple[int, list[set], list[dict]]:
    """Train ``steps`` steps; return this rank's replica group, the token ids of each step's
    batches, and the metric records."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    mesh = build_mesh(config)
    trainer = Trainer(config, mesh)
    seen, records = [], []
    for _ in range(steps):
        micro = trainer.data.sampler.local_microbatch_indices(trainer.data.step)
        seen.append({int(t) for indices in micro for inputs, targets in
                     [trainer.data.dataset.batch(indices)] for t in inputs.flatten()})
        records.append(trainer.train_step())
    return mesh.replica_rank, seen, records


def _site_ids(tokenizer, text: str) -> set[int]:
    return set(tokenizer.encode(text)) | {tokenizer.eos_id}


def test_each_group_reads_only_its_own_source(tmp_path):
    from meshtrain.data.tokenizer import load_tokenizer

    sites = _write_sites(tmp_path)
    config = tiny_config("parallel.replicas=2", "parallel.sync_every=2",
                         f"data.replica_sources={','.join(sites)}", nproc=4)
    results = run_distributed(4, _batches_and_records, config.to_dict(), STEPS)
    tokenizer = load_tokenizer("bytes")
    ids = [_site_ids(tokenizer, SITE_TEXT["a"]), _site_ids(tokenizer, SITE_TEXT["b"])]
    assert not (ids[0] - {tokenizer.eos_id}) & ids[1]  # the alphabets are disjoint
    groups = sorted(group for group, _, _ in results)
    assert groups == [0, 0, 1, 1]
    for group, seen, _ in results:
        for step_ids in seen:
            assert step_ids and step_ids <= ids[group], (group, step_ids - ids[group])
    records = next(records for _, _, records in results if records)
    share = config.train.global_batch // 2 * config.train.seq_len
    for record in records:
        assert record["tokens_per_group"] == [share, share]
        assert record["tokens"] == 2 * share
        assert math.isfinite(record["loss"])
    assert records[-1]["loss"] < records[0]["loss"]


def test_replica_sources_refused_where_they_cannot_work(tmp_path):
    sites = _write_sites(tmp_path)
    joined = ",".join(sites)
    with pytest.raises(ConfigError, match="one source per replica group"):
        tiny_config("parallel.replicas=4", f"data.replica_sources={joined}", nproc=4)
    with pytest.raises(ConfigError, match="replaces data.source"):
        tiny_config("parallel.replicas=2", f"data.replica_sources={joined}",
                    f"data.source={sites[0]}", nproc=2)
    with pytest.raises(ConfigError, match="missing"):
        tiny_config("parallel.replicas=2", f"data.replica_sources={sites[0]},"
                    f"{tmp_path / 'missing.txt'}", nproc=2)


def test_per_group_data_resumes_bitwise(tmp_path):
    """Stopped after step 3 of 6 (H = 2, mid-round) and resumed: each group's data position
    comes back, so the losses equal the uninterrupted run's bitwise."""
    from tests.parallel.test_checkpoint import resume_and_finish, train_then_stop, uninterrupted

    sites = _write_sites(tmp_path)
    common = ("parallel.replicas=2", "parallel.sync_every=2", "train.steps=6",
              f"data.replica_sources={','.join(sites)}")
    saved = tiny_config(*common, run_dir=str(tmp_path / "run"), nproc=2)
    first = run_distributed(2, train_then_stop, saved.to_dict(), 3)[0]
    resumed = tiny_config(*common, "checkpoint.resume=auto", run_dir=str(tmp_path / "run"),
                          nproc=2)
    rest = run_distributed(2, resume_and_finish, resumed.to_dict())[0]
    straight = tiny_config(*common, run_dir=str(tmp_path / "straight"), nproc=2)
    assert first + rest == run_distributed(2, uninterrupted, straight.to_dict())[0]
