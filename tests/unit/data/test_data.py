"""Tokenizers, corpus sources, packing and the deterministic global-batch sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtrain.config import ConfigError, DataConfig, TrainConfig
from meshtrain.data.builtin_corpus import builtin_corpus_texts
from meshtrain.data.packing import PackedDataset
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.data.shards import write_token_bin
from meshtrain.data.sources import find_source_files, load_token_stream
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
    return load_token_stream(DataConfig(source=str(source), **kwargs), ByteTokenizer()).tolist()


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


def test_disk_cache_skips_tokenizing_again(tmp_path, monkeypatch):
    from meshtrain.data import sources as data_module

    class CountingTokenizer:
        vocab_size, eos_id, name, calls = 264, 256, "counting", 0

        def encode(self, text):
            CountingTokenizer.calls += 1
            return list(text.encode("utf-8"))

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("abc")
    cfg = DataConfig(source=str(tmp_path / "src"))
    first = load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache")
    monkeypatch.setattr(data_module, "_STREAM_CACHE", {})  # as if in a fresh process
    again = load_token_stream(cfg, CountingTokenizer(), cache_dir=tmp_path / "cache")
    assert CountingTokenizer.calls == 1 and again.tolist() == first.tolist() == byte_stream("abc")
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 1


def test_bad_sources_raise_config_error_naming_the_path(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl, line 2"):
        stream_of(bad)
    bad.write_text('{"text": "ok"}\n{"other": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl, line 2.*\"text\""):
        stream_of(bad)
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
