"""Token ids are range-checked once per file before launch: prepared directories against the
model's vocabulary, pre-tokenized ``.bin`` files against the tokenizer's, every source of a
mixture, of the replica groups and the held-out source alike; the result of a scan is remembered
per unchanged file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import ConfigError
from meshtrain.data import shards
from meshtrain.data.prepare import prepare
from meshtrain.data.prepared import check_prepared_ids, open_prepared, read_meta
from meshtrain.data.shards import check_token_file, scan_token_file, write_token_bin
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.validation.preflight import check_data_files, model_vocab_size, token_sources
from tests.helpers import tiny_config


@pytest.fixture(autouse=True)
def scan_cache(tmp_path, monkeypatch) -> Path:
    """Remembered scans go to this test's folder, and nothing is remembered in-process."""
    monkeypatch.setenv(shards.SCAN_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(shards, "_SCANNED", {})
    return tmp_path / "cache" / "token-ids"


def prepared_dir(root: Path, bad_id: int | None = None) -> Path:
    """A prepared corpus (byte tokenizer) of a few shards; ``bad_id`` written over one token of
    its second shard (size and meta unchanged)."""
    text = root / "text.txt"
    root.mkdir(parents=True, exist_ok=True)
    text.write_text("the cat sat on the mat.\n" * 200)
    out = root / "prepared"
    prepare([str(text)], out, shard_bytes=1000)
    if bad_id is not None:
        shard = out / read_meta(out)["shards"][1]["file"]
        ids = np.fromfile(shard, dtype="<u2")
        ids[7] = bad_id
        ids.tofile(shard)
    return out


def bin_file(path: Path, ids) -> Path:
    np.asarray(ids, dtype="<u2").tofile(path)
    return path


def test_prepared_id_beyond_the_vocabulary_is_refused_naming_file_id_and_vocabulary(tmp_path):
    out = prepared_dir(tmp_path, bad_id=300)
    with pytest.raises(ConfigError) as error:
        check_data_files(tiny_config(f"data.source={out}"))
    message = str(error.value)
    assert message.startswith("data.source: ") and "shard-00001.bin" in message
    assert "token id 300" in message and "has only 264 ids" in message
    # A model vocabulary padded past the id holds it: no refusal (ids < model.vocab_size).
    check_data_files(tiny_config(f"data.source={out}", "model.vocab_size=320"))
    # open_prepared checks only when asked (workers trust the launcher's check).
    assert len(open_prepared(out, ByteTokenizer())) > 2
    with pytest.raises(ConfigError, match="token id 300"):
        open_prepared(out, ByteTokenizer(), vocab_size=264)
    with pytest.raises(ConfigError, match="token id 300"):
        check_prepared_ids(out, 264)


def test_bin_ids_are_checked_against_the_tokenizer(tmp_path):
    good = bin_file(tmp_path / "good.bin", list(range(264)) * 4)
    check_data_files(tiny_config(f"data.source={good}"))
    bad = bin_file(tmp_path / "bad.bin", [1, 2, 263, 264] * 100)
    with pytest.raises(ConfigError, match=r"data.source: .*bad\.bin holds token id 264, but the "
                                          r'tokenizer "bytes" .* has only 264 ids'):
        check_data_files(tiny_config(f"data.source={bad}"))


def test_every_mixture_replica_and_held_out_source_is_checked(tmp_path):
    good = bin_file(tmp_path / "good.bin", [5] * 200)
    bad = prepared_dir(tmp_path / "p", bad_id=999)
    mixture = tiny_config(f"data.sources={good}:0.5,{bad}:0.5")
    assert [key for key, _ in token_sources(mixture)] == ["data.sources[0]", "data.sources[1]"]
    with pytest.raises(ConfigError, match=r"data.sources\[1\]: .*shard-00001\.bin holds token id "
                                          r"999"):
        check_data_files(mixture)
    held_out = bin_file(tmp_path / "held.bin", [4, 400])
    with pytest.raises(ConfigError, match=r"data.valid_source: .*held\.bin holds token id 400"):
        check_data_files(tiny_config(f"data.source={good}", f"data.valid_source={held_out}",
                                     "train.eval_every=2"))
    replicas = tiny_config("parallel.replicas=2", f"data.replica_sources={good},{bad}",
                           nproc=2)
    with pytest.raises(ConfigError, match=r"data.replica_sources\[1\]: .*token id 999"):
        check_data_files(replicas)


def test_the_vocabulary_is_the_models_when_set():
    assert model_vocab_size(tiny_config()) == 264
    assert model_vocab_size(tiny_config("model.vocab_size=512")) == 512


def test_a_scan_is_remembered_per_unchanged_file_and_redone_after_a_change(tmp_path, scan_cache,
                                                                         monkeypatch):
    path = bin_file(tmp_path / "t.bin", [1, 2, 3] * 1000)
    first = scan_token_file(path, np.dtype("<u2"))
    assert (first.tokens, first.max_id, first.scanned) == (3000, 3, 3000)
    assert len(list(scan_cache.glob("*.json"))) == 1
    monkeypatch.setattr(shards, "_SCANNED", {})  # another process: read from the disk record
    reads = []
    monkeypatch.setattr(shards, "max_token", lambda *a: reads.append(a) or 0)
    again = scan_token_file(path, np.dtype("<u2"))
    assert (again.tokens, again.max_id, again.scanned) == (3000, 3, 0) and not reads
    bin_file(path, [1, 2, 300] * 1000)  # same size, rewritten: scanned again
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    monkeypatch.undo()
    monkeypatch.setenv(shards.SCAN_CACHE_ENV, str(scan_cache.parent))
    assert scan_token_file(path, np.dtype("<u2")).max_id == 300


def test_an_unwritable_scan_cache_only_costs_a_rescan(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(shards.SCAN_CACHE_ENV, str(blocker))  # a file: no folder can be made
    path = bin_file(tmp_path / "t.bin", [7] * 10)
    assert scan_token_file(path, np.dtype("<u2")).max_id == 7


def test_the_check_reads_in_bounded_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_SCAN_CHUNK", 1000)
    counts = []
    real = np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda *a, **k: counts.append(k.get("count"))
                        or real(*a, **k))
    path = bin_file(tmp_path / "t.bin", np.arange(10_500) % 264)
    scan = check_token_file(path, np.dtype("<u2"), 264, "the vocabulary")
    assert scan.max_id == 263 and scan.tokens == 10_500
    assert set(counts) == {1000} and len(counts) == 12  # 11 chunks and the empty read


def test_write_token_bin_round_trip_keeps_its_check(tmp_path):
    write_token_bin(tmp_path / "a.bin", [1, 2, 3], vocab_size=264)
    with pytest.raises(ValueError):
        write_token_bin(tmp_path / "b.bin", [300], vocab_size=264)


def test_a_writer_can_record_the_largest_id_it_wrote(tmp_path, monkeypatch):
    path = bin_file(tmp_path / "t.bin", [1, 2, 3])
    shards.record_scan(path, np.dtype("<u2"), 3)
    monkeypatch.setattr(shards, "_SCANNED", {})
    monkeypatch.setattr(shards, "max_token", lambda *a: pytest.fail("read again"))
    scan = scan_token_file(path, np.dtype("<u2"))
    assert (scan.tokens, scan.max_id, scan.scanned) == (3, 3, 0)
