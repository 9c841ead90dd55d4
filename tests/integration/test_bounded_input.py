"""Nothing silently wrong from bad input: ``meshtrain train`` refuses, before any worker starts
and with exit 2 (no traceback), token ids outside the vocabulary in any source and a run whose
memory estimate exceeds what the machine has; a normal tiny run still passes, and the estimate
stays within a stated factor of the peak memory measured from outside.

The launcher runs in this process (``cli.main``): the refusals happen before any worker exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from meshtrain.cli import main
from meshtrain.commands.bench.memory_peak import measure_train_peaks
from meshtrain.commands.fit_check import estimate_ranks
from meshtrain.config import load_config
from meshtrain.data import shards
from meshtrain.data.prepare import prepare
from meshtrain.data.prepared import read_meta
from meshtrain.validation.run_config import validate_config

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=4", "train.warmup_steps=0",
        "data.max_bytes=200000", "train.device=cpu"]
ESTIMATE_FACTOR = 1.25
"""The memory estimate of a rank stays within this factor of its measured VmHWM (either way)."""


@pytest.fixture(autouse=True)
def scan_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(shards.SCAN_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(shards, "_SCANNED", {})


def train(tmp_path: Path, *overrides: str, nproc: int = 1, run: str = "run") -> int:
    args = ["train", "--nproc", str(nproc), "--steps", "1", "--run-dir", str(tmp_path / run)]
    for item in (*TINY, *overrides):
        args += ["--set", item]
    return main(args)


def prepared(root: Path, bad_id: int | None = None) -> Path:
    """A prepared corpus (byte tokenizer, vocabulary 264); ``bad_id`` over one token of its
    second shard, size and meta unchanged (a damaged or foreign shard)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "text.txt").write_text("".join(f"line {i}: the cat sat on the mat\n"
                                           for i in range(400)))
    out = root / "prepared"
    prepare([str(root / "text.txt")], out, shard_bytes=2000)
    if bad_id is not None:
        shard = out / read_meta(out)["shards"][1]["file"]
        ids = np.fromfile(shard, dtype="<u2")
        ids[5] = bad_id
        ids.tofile(shard)
    return out


def refused(capfd, status: int) -> str:
    """The launcher's stderr, its lines (wrapped at 100 columns) joined again."""
    err = capfd.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and "meshtrain: training" in err
    return " ".join(err.split())


def test_prepared_id_beyond_vocab_under_tp2_exits_2_naming_the_id(tmp_path, capfd):
    out = prepared(tmp_path, bad_id=300)
    err = refused(capfd, train(tmp_path, "parallel.tp=2", f"data.source={out}", nproc=2))
    assert re.search(r"data\.source: .*?shard-00001\.bin holds token id 300, but the model's "
                     r"vocabulary .* has only 264 ids", err), err
    assert not (tmp_path / "run" / "config.json").exists()  # nothing launched or written


def test_bin_and_mixture_sources_are_checked(tmp_path, capfd):
    bad_bin = tmp_path / "bad.bin"
    np.asarray([1, 2, 3, 270] * 50, dtype="<u2").tofile(bad_bin)
    err = refused(capfd, train(tmp_path, f"data.source={bad_bin}"))
    assert "bad.bin holds token id 270" in err and "264 ids" in err
    good_bin = tmp_path / "good.bin"
    np.asarray([1, 2, 3, 256] * 50, dtype="<u2").tofile(good_bin)
    out = prepared(tmp_path / "p", bad_id=4000)
    err = refused(capfd, train(tmp_path, f"data.sources={good_bin}:0.7,{out}:0.3"))
    assert re.search(r"data\.sources\[1\]: .*?shard-00001\.bin holds token id 4000", err), err


def test_a_million_token_sequence_is_refused_with_estimate_and_available(tmp_path, capfd):
    err = refused(capfd, train(tmp_path, "train.seq_len=1048576", "train.global_batch=1",
                               "model.dim=256", "model.n_heads=8", "model.ffn_dim=704"))
    found = re.search(r"cannot fit in memory: it needs about ([\d,.]+) GB of host memory, but "
                      r"only ([\d,.]+) GB is available", err)
    assert found, err
    needed, available = (float(x.replace(",", "")) for x in found.groups())
    assert needed > 40 and needed > available  # ~48 GB: far beyond this 24 GB machine
    assert "activations" in err and "train.seq_len" in err


def test_a_normal_tiny_run_passes_and_reports_its_checks(tmp_path, capfd):
    out = prepared(tmp_path)
    assert train(tmp_path, f"data.source={out}") == 0
    err = " ".join(capfd.readouterr().err.split())
    assert re.search(r"checked [\d,]+ tokens of .*?prepared in [\d.]+ s: largest id \d+ < "
                     r"vocabulary 264", err), err
    assert re.search(r"memory check: the run needs about [\d.]+ GB of host memory; [\d,.]+ GB is "
                     r"available", err), err
    # The same unchanged corpus again (another run): remembered, not read again.
    assert train(tmp_path, f"data.source={out}", "checkpoint.resume=none", run="run2") == 0
    assert "remembered from an earlier check" in capfd.readouterr().err


def test_estimate_is_within_a_factor_of_the_measured_peak(tmp_path):
    """Two dp ranks (gloo: no shared-memory pages counted twice), 4 sequences of 1024 tokens per
    rank: the estimate of each rank against its VmHWM read from outside."""
    overrides = ["parallel.dp=2", "parallel.dp_shared_memory=false", "train.seq_len=1024",
                 "train.global_batch=8", "train.steps=1", "train.warmup_steps=0",
                 "train.device=cpu", "train.eval_every=0", "data.max_bytes=1000000"]
    config = load_config(None, overrides)
    estimate = estimate_ranks(config, validate_config(config, 2))[0].total
    peaks = measure_train_peaks(overrides, 2, tmp_path)["peaks"]
    ratios = [estimate / peak for peak in peaks]
    print(f"estimate {estimate / 2**20:.0f} MiB, VmHWM {[round(p / 2**20) for p in peaks]} MiB")
    assert all(1 / ESTIMATE_FACTOR <= r <= ESTIMATE_FACTOR for r in ratios), ratios
