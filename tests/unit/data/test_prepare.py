"""``meshtrain prepare``: token-identical to training from raw files, resumable, safe, bounded,
linear in the input whatever the line lengths."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data import prepare as prep
from meshtrain.data import readers
from meshtrain.data import sources as data_sources
from meshtrain.data.prepared import MARKER, META, document_ends, is_complete, open_prepared
from meshtrain.data.readers import document_texts
from meshtrain.data.sources import (
    CACHE_ENV,
    encode_documents,
    find_source_files,
    load_token_stream,
    raw_corpus_dir,
)
from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer
from meshtrain.validation.preflight import check_data_files
from tests.helpers import tiny_config

MESHTRAIN = str(Path(sys.executable).with_name("meshtrain"))


def write_corpus(root: Path) -> Path:
    """A directory with every source kind and the awkward cases: CRLF and lone CR newlines,
    invalid UTF-8, multi-byte characters, blank jsonl lines, null parquet rows, two row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    lines = [f"line {i}: the cat sat on the mat, naïve café ☃ {i * 7}" for i in range(60)]
    (root / "a.txt").write_text("\n".join(lines) + "\n\n  indented\n\tend")
    (root / "b.txt").write_bytes(b"crlf one\r\ncrlf two\r\nlone cr\rbad \xff\xfe bytes \xe6\n"
                                 + "日本語のテキスト\n".encode() * 20)
    docs = [{"text": f"document {i} " + "word " * (i % 13), "id": i} for i in range(80)]
    body = "".join(json.dumps(d) + ("\n\n" if i % 9 == 0 else "\n") for i, d in enumerate(docs))
    (root / "c.jsonl").write_text(body + json.dumps({"text": "last, no newline"}))
    table = pa.table({"text": [f"row {i} ünïcode" if i % 5 else None for i in range(50)],
                      "n": list(range(50))})
    pq.write_table(table, root / "d.parquet", row_group_size=20)
    return root


def reference_stream(source, tokenizer) -> np.ndarray:
    """The stream training built from raw ``source`` before the token cache: every document read
    into one list and tokenized at once (what the cached stream must equal)."""
    texts = [t for p in find_source_files(str(source)) for t in document_texts(p, "text")]
    return encode_documents(texts, tokenizer)


def raw_stream(source, tokenizer) -> np.ndarray:
    """The token stream training builds from ``source`` directly (through the token cache),
    checked against :func:`reference_stream`."""
    stream = np.asarray(load_token_stream(DataConfig(source=str(source)), tokenizer).tolist())
    assert np.array_equal(stream, reference_stream(source, tokenizer))
    return stream


def prepared_stream(out, tokenizer) -> np.ndarray:
    return np.asarray(load_token_stream(DataConfig(source=str(out)), tokenizer).tolist())


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """A tiny byte-level BPE tokenizer.json with an eos, trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat\nline document word"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture
def small_reads(monkeypatch):
    """Tiny read chunks, so chunk edges fall inside characters, CRLF pairs and lines."""
    monkeypatch.setattr(readers, "READ_BYTES", 7)


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch) -> Path:
    """Raw sources are tokenized into a cache of this test's own (not ~/.cache)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "token-cache"))
    return tmp_path / "token-cache"


# ------------------------------------------------------------------------------- round trips


def test_bytes_round_trip_equals_training_from_raw(tmp_path, small_reads):
    corpus = write_corpus(tmp_path / "raw")
    meta = prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=300)
    tok = ByteTokenizer()
    raw = raw_stream(corpus, tok)
    assert np.array_equal(prepared_stream(tmp_path / "out", tok), raw)
    assert len(meta["shards"]) > 5 and meta["dtype"] == "uint16" and meta["tokens"] == len(raw)
    # documents: each ends with eos; a .txt file is one document even when cut into shards
    ends = document_ends(tmp_path / "out")
    assert np.array_equal(ends, np.flatnonzero(raw == tok.eos_id) + 1)
    assert meta["documents"] == len(ends) == 2 + 81 + 40
    shards = open_prepared(tmp_path / "out", tok)
    assert all(isinstance(s, np.memmap) for s in shards if len(s))  # memory-mapped


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_raw_source_and_the_same_source_prepared_are_the_same_tokens_and_documents(
        tmp_path, small_reads, monkeypatch, hf_tokenizer, tokenizer):
    """Training from raw files reads the stream of today's loader (:func:`reference_stream`), and
    its token cache entry is what ``meshtrain prepare`` writes: the same shards byte for byte,
    the same document ends."""
    spec = hf_tokenizer if tokenizer == "hf" else "bytes"
    tok = load_tokenizer(spec)
    corpus = write_corpus(tmp_path / "raw")
    monkeypatch.setattr(data_sources, "SHARD_BYTES", 300)  # many shards in the cache too
    raw = raw_stream(corpus, tok)
    prep.prepare([str(corpus)], tmp_path / "out", tokenizer=spec, shard_bytes=300)
    assert np.array_equal(prepared_stream(tmp_path / "out", tok), raw)
    entry = raw_corpus_dir(DataConfig(source=str(corpus)), tok)
    assert entry.parent == tmp_path / "token-cache" and is_complete(entry)
    ends = document_ends(entry)
    assert np.array_equal(ends, document_ends(tmp_path / "out"))
    assert np.array_equal(ends, np.flatnonzero(raw == tok.eos_id) + 1)
    assert len(ends) == 2 + 81 + 40
    shards = sorted(p.name for p in (tmp_path / "out").glob("shard-*"))
    assert len(shards) > 10 and shards == sorted(p.name for p in entry.glob("shard-*"))
    for name in shards:
        assert (entry / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_hf_tokenizer_round_trip_equals_training_from_raw(tmp_path, small_reads, hf_tokenizer):
    corpus = write_corpus(tmp_path / "raw")
    tok = load_tokenizer(hf_tokenizer)
    assert prep.lines_split_safely(tok) and prep.lines_split_safely(ByteTokenizer())
    meta = prep.prepare([str(corpus)], tmp_path / "out", tokenizer=hf_tokenizer, shard_bytes=300)
    assert sum(s["sources"][0]["path"].endswith("a.txt") for s in meta["shards"]) > 3  # cut up
    assert np.array_equal(prepared_stream(tmp_path / "out", tok), raw_stream(corpus, tok))
    assert meta["tokenizer"]["name"] == hf_tokenizer and meta["vocab_size"] == tok.vocab_size


def test_hf_tokenizer_not_splitting_at_lines_keeps_each_txt_whole(tmp_path, monkeypatch,
                                                                  hf_tokenizer):
    corpus = write_corpus(tmp_path / "raw")
    monkeypatch.setattr(prep, "lines_split_safely", lambda tokenizer: False)
    meta = prep.prepare([str(corpus / "a.txt")], tmp_path / "out", tokenizer=hf_tokenizer,
                        shard_bytes=300)
    assert len(meta["shards"]) == 1
    tok = load_tokenizer(hf_tokenizer)
    assert np.array_equal(prepared_stream(tmp_path / "out", tok), raw_stream(corpus / "a.txt", tok))


def test_vocab_over_65535_writes_uint32(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "raw")
    monkeypatch.setattr(ByteTokenizer, "vocab_size", 70_000)
    meta = prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=1000)
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_000
    size = sum((tmp_path / "out" / s["file"]).stat().st_size for s in meta["shards"])
    assert size == 4 * meta["tokens"]
    assert np.array_equal(prepared_stream(tmp_path / "out", ByteTokenizer()),
                          raw_stream(corpus, ByteTokenizer()))


def test_several_workers_write_the_same_files_as_one(tmp_path):
    corpus = write_corpus(tmp_path / "raw")
    (corpus / "big.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n"
                                              for i in range(3000)))
    one = prep.prepare([str(corpus)], tmp_path / "one", workers=1, shard_bytes=32 * 1024)
    two = prep.prepare([str(corpus)], tmp_path / "two", workers=2, shard_bytes=32 * 1024)
    assert len(one["shards"]) > 4 and one["shards"] == two["shards"]
    for shard in one["shards"]:
        for name in (shard["file"], shard["file"].replace(".bin", ".idx")):
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_training_from_prepared_dir_matches_raw_source(tmp_path):
    from meshtrain.commands.verify import train_steps

    corpus = write_corpus(tmp_path / "raw")
    prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    losses = {}
    for name, source in (("raw", corpus), ("prepared", tmp_path / "out")):
        config = tiny_config(f"data.source={source}", "train.device=cpu",
                             run_dir=str(tmp_path / f"run-{name}"))
        check_data_files(config)
        losses[name] = [r["loss"] for r in train_steps(config.to_dict(), 2)]
    assert losses["raw"] == losses["prepared"]


def test_two_data_parallel_ranks_read_the_prepared_dir_as_one_process_reads_raw(tmp_path):
    from meshtrain.commands.verify import run_layout

    corpus = write_corpus(tmp_path / "raw")
    prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    raw = run_layout(tiny_config(f"data.source={corpus}", "train.device=cpu"), 1, 2)
    dp2 = run_layout(tiny_config(f"data.source={tmp_path / 'out'}", "train.device=cpu",
                                 "parallel.dp=2", nproc=2), 2, 2)
    assert [r["loss"] for r in dp2] == pytest.approx([r["loss"] for r in raw], abs=2e-4)


# -------------------------------------------------------------------------- re-runs, failures


def _mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_rerun_is_a_no_op_until_a_source_changes(tmp_path):
    corpus = write_corpus(tmp_path / "raw")
    first = prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    before = _mtimes(tmp_path / "out")
    time.sleep(0.01)
    again = prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    assert again["up_to_date"] and not first["up_to_date"]
    assert _mtimes(tmp_path / "out") == before  # nothing rewritten
    (corpus / "a.txt").write_text("changed\n")
    redone = prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    assert not redone["up_to_date"] and redone["tokens"] < first["tokens"]
    assert np.array_equal(prepared_stream(tmp_path / "out", ByteTokenizer()),
                          raw_stream(corpus, ByteTokenizer()))


def test_failing_worker_leaves_no_marker_and_a_rerun_succeeds(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "raw")
    prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    (corpus / "c.jsonl").touch()  # the next run must redo the directory
    calls = []
    real = prep._Encoder.documents

    def failing(self, texts):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return real(self, texts)

    monkeypatch.setattr(prep._Encoder, "documents", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)
    assert not is_complete(tmp_path / "out") and not (tmp_path / "out" / MARKER).exists()
    assert not list((tmp_path / "out").glob("shard-*")) and not list(tmp_path.glob("out/*.partial"))
    monkeypatch.setattr(prep._Encoder, "documents", real)
    assert not prep.prepare([str(corpus)], tmp_path / "out", shard_bytes=500)["up_to_date"]
    assert is_complete(tmp_path / "out")


KILL_MID_RUN = """
import os, signal, sys
from meshtrain.data import prepare as prep
finish, done = prep._ShardWriter.finish, []
def finish_then_die(self):
    finish(self)
    done.append(1)
    if len(done) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
prep._ShardWriter.finish = finish_then_die
prep.prepare([sys.argv[1]], sys.argv[2], shard_bytes=400)
"""


def test_kill_9_mid_run_leaves_nothing_complete_and_a_rerun_redoes_it(tmp_path):
    corpus = write_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_RUN, str(corpus), str(out)])
    assert proc.returncode == -signal.SIGKILL
    assert len(list(out.glob("shard-*.bin"))) == 2 and not (out / MARKER).exists()
    assert not is_complete(out)
    for check in (lambda: find_source_files(str(out)),  # config validation
                  lambda: load_token_stream(DataConfig(source=str(out)), ByteTokenizer())):
        with pytest.raises(ConfigError, match="unfinished prepared corpus"):
            check()
    meta = prep.prepare([str(corpus)], out, shard_bytes=400)
    assert not meta["up_to_date"] and is_complete(out)
    tok = ByteTokenizer()
    assert np.array_equal(prepared_stream(out, tok), raw_stream(corpus, tok))


# ------------------------------------------------------------------------------- bad input


def test_bad_sources_are_config_errors_before_anything_is_written(tmp_path, hf_tokenizer):
    corpus = write_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="nope.txt.*does not exist"):
        prep.prepare([str(tmp_path / "nope.txt")], out)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl: the file is empty"):
        prep.prepare([str(corpus), str(tmp_path / "empty.jsonl")], out)
    with pytest.raises(ConfigError, match=r'd\.parquet: no column "body".*columns: text, n'):
        prep.prepare([str(corpus / "d.parquet")], out, text_field="body")
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match="tok.json.*not a valid Hugging Face tokenizer"):
        prep.prepare([str(corpus)], out, tokenizer=str(tmp_path / "tok.json"))
    assert not out.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_jsonl_lines_name_file_and_line_and_leave_nothing(tmp_path, workers):
    lines = [json.dumps({"text": f"fine {i}"}) for i in range(400)]
    cases = {"not valid JSON": '{"text": oops}', 'no "text" field': '{"body": "x"}',
             'field "text" is int, not a string': '{"text": 3}'}
    for message, bad in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(lines[:300] + [bad] + lines[300:]) + "\n")
        with pytest.raises(ConfigError, match=rf"bad\.jsonl, line 301: {message}"):
            prep.prepare([str(path)], tmp_path / "out", workers=workers, shard_bytes=1000)
        assert not (tmp_path / "out").exists()


def test_user_directories_are_never_deleted(tmp_path):
    corpus = write_corpus(tmp_path / "raw")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep me")
    with pytest.raises(ConfigError, match="is not a prepared corpus.*nothing in it is deleted"):
        prep.prepare([str(corpus)], mine)
    (mine / META).write_text('{"format": "someone-else"}')
    with pytest.raises(ConfigError, match="is not a prepared corpus"):
        prep.prepare([str(corpus)], mine)
    assert sorted(p.name for p in mine.iterdir()) == ["meta.json", "notes.md"]
    with pytest.raises(ConfigError, match="is a file"):
        prep.prepare([str(corpus)], corpus / "a.txt")
    prep.prepare([str(corpus)], tmp_path / "out")
    with pytest.raises(ConfigError, match="already a prepared corpus"):
        prep.prepare([str(tmp_path / "out")], tmp_path / "again")
    # an output inside the sources is not read back as a source
    assert not prep.prepare([str(corpus)], corpus / "prepared")["up_to_date"]
    assert prep.prepare([str(corpus)], corpus / "prepared")["up_to_date"]


def test_cli_exit_status_2_with_one_paragraph(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": oops}\n')
    for args in (["missing.txt"], [str(bad), "--workers", "2"]):
        proc = subprocess.run([MESHTRAIN, "prepare", *args, "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("meshtrain prepare: ")
    assert "bad.jsonl, line 2: not valid JSON" in " ".join(proc.stderr.split())
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- training from a bad dir


def test_damaged_or_foreign_prepared_dirs_are_refused_before_launch(tmp_path, hf_tokenizer):
    corpus = write_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    meta = prep.prepare([str(corpus)], out, shard_bytes=2000)
    config = tiny_config(f"data.source={out}")
    check_data_files(config)  # whole: fine
    with pytest.raises(ConfigError, match=r"prepared with tokenizer bytes \(vocab 264.*"
                                          r"this run uses .*tokenizer\.json"):
        check_data_files(tiny_config(f"data.source={out}", f"data.tokenizer={hf_tokenizer}"))
    shard = out / meta["shards"][1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])  # cut mid-token
    with pytest.raises(ConfigError, match=rf"{shard.name}: {len(data) - 1} bytes, but meta.json "
                                          rf"expects {len(data) // 2} uint16 tokens"):
        check_data_files(config)
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"{shard.name}: missing"):
        check_data_files(config)
    shard.write_bytes(data)
    check_data_files(config)
    (out / MARKER).unlink()
    with pytest.raises(ConfigError, match="unfinished prepared corpus.*run meshtrain prepare"):
        tiny_config(f"data.source={out}")  # refused by config validation already


def test_cli_train_refuses_a_truncated_shard_with_exit_2(tmp_path):
    corpus = write_corpus(tmp_path / "raw")
    meta = prep.prepare([str(corpus)], tmp_path / "out")
    shard = tmp_path / "out" / meta["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-3])
    proc = subprocess.run([MESHTRAIN, "train", "--set", f"data.source={tmp_path / 'out'}",
                           "--run-dir", str(tmp_path / "run"), "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    message = " ".join(proc.stderr.split())
    assert "shard-00000.bin" in message and "prepare the corpus again" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
