"""Tokenizers, corpus sources (raw text through the token cache), packing and the
deterministic global-batch sampler."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.config import ConfigError, DataConfig, TrainConfig
from meshtrain.data.builtin_corpus import builtin_corpus_texts
from meshtrain.data.packing import PackedDataset
from meshtrain.data.prepared import is_complete
from meshtrain.data.readers import document_texts
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.data.shards import write_token_bin
from meshtrain.data.sources import (
    CACHE_ENV,
    data_cache_dir,
    encode_documents,
    find_source_files,
    load_token_stream,
    raw_corpus_dir,
)
from meshtrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenizer_vocab_size,
)
from meshtrain.data.train_data import TrainData

EOS = 256


def byte_stream(*docs: str) -> list[int]:
    """The expected byte-tokenizer stream of ``docs``: each document's bytes, then eos."""
    return [t for doc in docs for t in (*doc.encode("utf-8"), EOS)]


def stream_of(source, **kwargs) -> list[int]:
    """The stream training reads from ``source``, after checking it equals the one the loader
    built before the token cache (every document read into a list and tokenized at once)."""
    stream = load_token_stream(DataConfig(source=str(source), **kwargs), ByteTokenizer()).tolist()
    if not str(source).endswith(".bin") and not (Path(source).is_dir()
                                                  and any(Path(source).glob("*.bin"))):
        field = kwargs.get("text_field", "text")
        texts = [t for p in find_source_files(str(source)) for t in document_texts(p, field)]
        assert stream == encode_documents(texts, ByteTokenizer()).tolist()
    return stream


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch) -> Path:
    """Each test tokenizes raw sources into a cache of its own (not ~/.cache)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "token-cache"))
    return tmp_path / "token-cache"


# ----------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_vocab():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, wörld — 日本語 🚀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, 260]) == text  # eos and reserved ids are skipped
    assert tok.decode([0xE6]) == "\ufffd"  # a cut character decodes, it does not raise
    assert tok.vocab_size == 264 == tokenizer_vocab_size("bytes") and tok.eos_id == 256
    assert all(tok.vocab_size % tp == 0 for tp in (2, 4, 8))


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory):
    """A tiny byte-level BPE tokenizer trained on a few strings, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog ate the cat"] * 5, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_loads_and_round_trips(hf_tokenizer_path):
    tok = load_tokenizer(str(hf_tokenizer_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 0 and tok.vocab_size == tokenizer_vocab_size(str(hf_tokenizer_path))
    text = "the cat ate the mat, naïvely ☃"
    ids = tok.encode(text)
    assert tok.eos_id not in ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text


def test_hf_tokenizer_missing_or_corrupt_file_is_config_error(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_tokenizer(str(missing))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match="corrupt.json"):
        HFTokenizer(corrupt)


# -------------------------------------------------------------------------------------- sources


def test_txt_directory_is_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("yo")
    (tmp_path / "a.txt").write_text("hé")
    (tmp_path / "sub" / "c.txt").write_text("c")
    (tmp_path / "notes.md").write_text("ignored")
    assert [p.name for p in find_source_files(str(tmp_path))] == ["a.txt", "b.txt", "c.txt"]
    assert stream_of(tmp_path) == byte_stream("hé", "yo", "c")
    assert stream_of(tmp_path / "*.txt") == byte_stream("hé", "yo")  # a glob


def test_jsonl_source(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "ab", "id": 1}) + "\n\n" + json.dumps({"text": "ç"}) + "\n")
    assert stream_of(path) == byte_stream("ab", "ç")
    path.write_text(json.dumps({"body": "xy"}) + "\n")
    assert stream_of(path, text_field="body") == byte_stream("xy")


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["one", None, "twö"], "n": [1, 2, 3]}), path)
    assert stream_of(path) == byte_stream("one", "twö")
    with pytest.raises(ConfigError, match="docs.parquet.*body"):
        stream_of(path, text_field="body")


def test_bin_source_uint16_and_uint32(tmp_path):
    tokens = np.array([5, 256, 7, 263, 0], dtype=np.int64)
    write_token_bin(tmp_path / "a.bin", tokens[:3], vocab_size=264)
    write_token_bin(tmp_path / "b.bin", tokens[3:], vocab_size=264)
    assert (tmp_path / "a.bin").stat().st_size == 3 * 2  # headerless little-endian uint16
    assert stream_of(tmp_path) == tokens.tolist()  # taken as-is, no eos added

    class BigVocab:
        vocab_size, eos_id, name = 100_000, None, "big"

    big = np.array([70_000, 3, 99_999], dtype=np.int64)
    write_token_bin(tmp_path / "big.bin", big, vocab_size=100_000)
    assert (tmp_path / "big.bin").stat().st_size == 3 * 4
    loaded = load_token_stream(DataConfig(source=str(tmp_path / "big.bin")), BigVocab())
    assert isinstance(loaded.arrays[0], np.memmap)  # read through a memory map, not loaded
    assert loaded.to_tensor().dtype == torch.int64 and loaded.tolist() == big.tolist()


class CountingTokenizer:
    """The byte tokenizer's ids through ``encode`` only, counting its calls."""

    vocab_size, eos_id, name, calls = 264, 256, "counting", 0

    def encode(self, text):
        CountingTokenizer.calls += 1
        return list(text.encode("utf-8"))


def test_raw_source_is_tokenized_once_into_a_content_keyed_cache(tmp_path, monkeypatch):
    from meshtrain.data import sources as data_module

    (tmp_path / "src").mkdir()
    source = tmp_path / "src" / "a.txt"
    source.write_text("abc")
    cfg = DataConfig(source=str(tmp_path / "src"))
    first = load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache")
    assert first.tolist() == byte_stream("abc") and isinstance(first.arrays[0], np.memmap)
    calls = CountingTokenizer.calls
    assert calls > 0
    entries = list((tmp_path / "cache").glob("tokens-*"))
    assert sorted(p.suffix for p in entries) == ["", ".lock"]  # the entry and its lock file
    assert is_complete(next(p for p in entries if p.is_dir()))

    monkeypatch.setattr(data_module, "_STREAM_CACHE", {})  # as if in a fresh process
    assert load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache").tolist() == \
        first.tolist()
    assert CountingTokenizer.calls == calls  # read from the cache, not tokenized again

    monkeypatch.setattr(data_module, "_STREAM_CACHE", {})
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same bytes
    load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache")
    assert CountingTokenizer.calls == calls
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2  # still one entry and its lock

    monkeypatch.setattr(data_module, "_STREAM_CACHE", {})
    source.write_text("abd")  # other bytes, same size and mtime: the key is the content
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache").tolist() == \
        byte_stream("abd")
    assert CountingTokenizer.calls > calls
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 4


def test_a_damaged_cache_entry_is_written_again(tmp_path, monkeypatch):
    from meshtrain.data import sources as data_module

    source = tmp_path / "a.txt"
    source.write_text("some text\n" * 100)
    cfg = DataConfig(source=str(source))
    expected = stream_of(source)
    (shard,) = raw_corpus_dir(cfg, ByteTokenizer()).glob("shard-*.bin")
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated mid-token
    monkeypatch.setattr(data_module, "_STREAM_CACHE", {})
    assert stream_of(source) == expected
    assert shard.stat().st_size == 2 * len(expected)


def test_token_cache_location(tmp_path, monkeypatch):
    assert data_cache_dir(tmp_path / "given") == tmp_path / "given"
    assert data_cache_dir() == tmp_path / "token-cache"  # $MESHTRAIN_DATA_CACHE (the fixture)
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_cache_dir() == tmp_path / "xdg" / "meshtrain" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data_cache_dir() == Path.home() / ".cache" / "meshtrain" / "tokens"
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        if not os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere
            with pytest.raises(ConfigError, match=f"cannot be written.*{CACHE_ENV}"):
                load_token_stream(DataConfig(source=str(tmp_path / "a.txt")), ByteTokenizer(),
                                  cache_dir=tmp_path / "ro" / "cache")
    finally:
        (tmp_path / "ro").chmod(0o700)


def _jsonl(path: Path, documents: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 50)}) + "\n"
                            for i in range(documents)))
    return path


LOAD_WHEN_TOLD = """
import hashlib, os, sys, time
from meshtrain.config import DataConfig
from meshtrain.data import sources
from meshtrain.data.tokenizer import ByteTokenizer
write = sources._write_entry
def counted(*args, **kwargs):
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return write(*args, **kwargs)
sources._write_entry = counted
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.005)
tokens = sources.load_token_stream(DataConfig(source=sys.argv[1]), ByteTokenizer())
print(hashlib.sha256(tokens.window(0, len(tokens)).tobytes()).hexdigest())
"""


def test_ranks_loading_one_raw_source_at_once_tokenize_it_once(tmp_path, token_cache):
    """Four processes ask for the same uncached source at the same moment: one writes the entry
    (under the lock), the others wait and memory-map it; nothing temporary is left."""
    source = _jsonl(tmp_path / "docs.jsonl", 60_000)  # ~3 MB: writing it takes a while
    writers, go = tmp_path / "writers", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_WHEN_TOLD, str(source), str(writers),
                               str(go)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    digests = {proc.communicate(timeout=120)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(writers.read_text().split()) == 1  # tokenized once
    reference = encode_documents(list(document_texts(source, "text")), ByteTokenizer())
    assert digests == {hashlib.sha256(reference.astype(np.int64).tobytes()).hexdigest()}
    entry, lock = sorted(token_cache.glob("*tokens-*"), key=lambda p: p.name)  # nothing else
    assert is_complete(entry) and lock.name == f"{entry.name}.lock"


KILL_WRITER = """
import os, signal, sys
from meshtrain.config import DataConfig
from meshtrain.data import prepare, sources
from meshtrain.data.tokenizer import ByteTokenizer
sources.SHARD_BYTES = 2000
finish = prepare._ShardWriter.finish
def finish_then_die(self):
    finish(self)
    os.kill(os.getpid(), signal.SIGKILL)
prepare._ShardWriter.finish = finish_then_die
sources.load_token_stream(DataConfig(source=sys.argv[1]), ByteTokenizer())
"""


def test_a_writer_killed_mid_entry_leaves_nothing_complete_and_the_next_load_redoes_it(
        tmp_path, token_cache, monkeypatch):
    from meshtrain.data import sources as data_module

    source = _jsonl(tmp_path / "docs.jsonl", 500)
    proc = subprocess.run([sys.executable, "-c", KILL_WRITER, str(source)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (partial,) = token_cache.glob(".tokens-*.partial")  # one shard written, then killed
    assert list(partial.glob("shard-00000.bin")) and not list(token_cache.glob("tokens-*/"))
    monkeypatch.setattr(data_module, "SHARD_BYTES", 2000)  # the same key as the killed writer
    assert stream_of(source) == byte_stream(*document_texts(source, "text"))
    assert not list(token_cache.glob(".*partial"))  # the dead writer's directory is gone
    (entry,) = [p for p in token_cache.glob("tokens-*") if p.is_dir()]
    assert len(list(entry.glob("shard-*.bin"))) > 5


def test_bad_sources_raise_config_error_naming_the_path(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl, line 2"):
        stream_of(bad)
    bad.write_text('{"text": "ok"}\n{"other": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl, line 2.*\"text\""):
        stream_of(bad)
    assert not [p for p in data_cache_dir().glob("*tokens-*") if p.suffix != ".lock"]
    with pytest.raises(ConfigError, match="missing_dir"):
        find_source_files(str(tmp_path / "missing_dir"))
    csv = tmp_path / "table.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"table\.csv.*\.txt, \.jsonl, \.parquet, \.bin"):
        find_source_files(str(csv))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match="empty.*no usable file"):
        find_source_files(str(empty))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("a")
    write_token_bin(mixed / "b.bin", [1, 2], vocab_size=264)
    with pytest.raises(ConfigError, match="mixes"):
        find_source_files(str(mixed))


def test_builtin_corpus_is_real_bounded_and_deterministic():
    texts = builtin_corpus_texts(50_000)
    assert texts and texts == builtin_corpus_texts(50_000)
    assert 0 < sum(len(t.encode("utf-8")) for t in texts) <= 50_000
    assert any("def " in t or "import " in t for t in texts)
    bigger = builtin_corpus_texts(120_000)
    assert bigger[: len(texts) - 1] == texts[:-1]  # a prefix: the same sorted file order
    stream = load_token_stream(DataConfig(max_bytes=50_000), ByteTokenizer()).to_tensor()
    assert stream.dtype == torch.int64 and stream.dim() == 1
    assert int((stream == EOS).sum()) == len(texts) and int(stream[-1]) == EOS


# ------------------------------------------------------------------------------------- packing


def test_packing_shapes_and_shift_by_one():
    tokens = torch.arange(23)
    data = PackedDataset(tokens, seq_len=5)
    assert len(data) == 4  # (23 - 1) // 5
    inputs, targets = data[1]
    assert inputs.tolist() == [5, 6, 7, 8, 9] and targets.tolist() == [6, 7, 8, 9, 10]
    assert data[3][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        data[4]
    inputs, targets = data.batch([3, 0])
    assert inputs.shape == targets.shape == (2, 5) and inputs.dtype == torch.int64
    assert torch.equal(inputs[0], data[3][0]) and torch.equal(targets[:, :-1], inputs[:, 1:])
    assert len(PackedDataset(torch.arange(21), seq_len=5)) == 4  # exactly enough for the targets


# ------------------------------------------------------------------------------------- sampler


LAYOUTS = [(1, 1), (2, 1), (1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("dp,mb", LAYOUTS)
def test_sampler_layouts_cover_the_same_global_batch(dp, mb):
    reference = GlobalBatchSampler(num_samples=37, global_batch=8, seed=3)
    for step in range(12):  # 12 * 8 = 96 positions: several epochs, batches straddling them
        expected = reference.global_indices(step)
        pieces = []
        for rank in range(dp):
            sampler = GlobalBatchSampler(37, 8, 3, dp_rank=rank, dp_size=dp, microbatches=mb)
            assert sampler.global_indices(step) == expected
            micro = sampler.local_microbatch_indices(step)
            assert len(micro) == mb and all(len(m) == 8 // (dp * mb) for m in micro)
            pieces.extend(i for m in micro for i in m)
        assert pieces == expected  # same sequences, in the same order, whatever the layout


def test_sampler_deterministic_and_epochs_are_permutations():
    a, b = GlobalBatchSampler(10, 4, seed=7), GlobalBatchSampler(10, 4, seed=7)
    stream = [i for step in range(5) for i in a.global_indices(step)]  # 20 = 2 epochs
    assert stream == [i for step in range(5) for i in b.global_indices(step)]
    assert sorted(stream[:10]) == list(range(10)) == sorted(stream[10:])
    assert stream[:10] != stream[10:]  # each epoch reshuffles
    assert not torch.equal(GlobalBatchSampler(10, 4, seed=8).epoch_order(0), a.epoch_order(0))


def test_sampler_state_dict_resume_and_refusals():
    sampler = GlobalBatchSampler(50, 6, seed=1, dp_rank=1, dp_size=3)
    sampler.step = 9
    state = sampler.state_dict()
    assert state == {"step": 9, "seed": 1, "global_batch": 6}
    resumed = GlobalBatchSampler(50, 6, seed=1, dp_rank=1, dp_size=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.step == 9
    assert resumed.local_microbatch_indices(9) == sampler.local_microbatch_indices(9)
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(50, 6, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatchSampler(50, 12, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="divisible"):
        GlobalBatchSampler(50, 6, seed=1, dp_size=4)
    with pytest.raises(ConfigError):
        GlobalBatchSampler(0, 6, seed=1)


# ----------------------------------------------------------------------------------- TrainData


def test_train_data_next_step_shapes_layouts_and_resume():
    data_cfg = DataConfig(max_bytes=30_000)
    train_cfg = TrainConfig(seq_len=32, global_batch=8, seed=5)
    tok = ByteTokenizer()
    single = TrainData(data_cfg, train_cfg, tok)
    assert single.num_samples == (len(single.tokens) - 1) // 32
    ((inputs, targets),) = single.next_step()
    assert inputs.shape == targets.shape == (8, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and single.step == 1

    ranks = [TrainData(data_cfg, train_cfg, tok, dp_rank=r, dp_size=2, microbatches=2)
             for r in range(2)]
    micro = [rank.next_step() for rank in ranks]
    assert all(x.shape == (2, 32) for per_rank in micro for pair in per_rank for x in pair)
    assert torch.equal(torch.cat([x for per_rank in micro for x, _ in per_rank]), inputs)

    state = single.state_dict()
    expected = single.next_step()
    resumed = TrainData(data_cfg, train_cfg, tok)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_step()[0][0], expected[0][0])


def test_train_data_too_small_corpus_is_config_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 100)
    with pytest.raises(ConfigError, match="3 samples.*smaller seq_len"):
        TrainData(DataConfig(source=str(tmp_path)), TrainConfig(seq_len=32, global_batch=4),
                  ByteTokenizer())
