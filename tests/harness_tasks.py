"""What the harness and tracker tests make for themselves (nothing is shipped or downloaded): a
byte-level ``tokenizer.json`` with an end-of-text token, a small corpus, three local
lm-evaluation-harness tasks (multiple choice, rolling log-likelihood, generation until a stop
sequence) with their JSONL data, and a reader of W&B's offline ``.wandb`` files.

Importing this module points the Hugging Face datasets cache at a temporary directory of its own
(unless the environment already names one), so the tests never write to the user's cache."""

from __future__ import annotations

import json
import os
import random
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="meshtrain-test-hf-"))

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon"]
TASKS = ("tiny_mc", "tiny_roll", "tiny_gen")

TINY_MODEL = ("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128",
              "train.seq_len=64", "train.global_batch=8", "train.warmup_steps=0",
              "train.eval_every=0", "data.valid_fraction=0")
"""``--set`` overrides of a model that trains a step in a fraction of a second."""


def write_tokenizer(directory: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` (256 byte symbols and ``<|endoftext|>``) and its
    ``tokenizer_config.json`` (no BOS, so ``lm_eval --model hf`` adds none); returns the
    ``tokenizer.json`` path."""
    import tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)} | {"<|endoftext|>": len(alphabet)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "bos_token": None}))
    return directory / "tokenizer.json"


def write_corpus(path: Path, lines: int = 400) -> Path:
    """Sentences of :data:`WORDS`, one per line."""
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(12)) + ".\n"
                            for _ in range(lines)))
    return path


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_tasks(directory: Path) -> Path:
    """Task YAMLs :data:`TASKS` and their data in ``directory`` (the ``--include-path``)."""
    directory.mkdir(parents=True, exist_ok=True)
    mc = _jsonl(directory / "mc.jsonl", [
        {"question": f"the {WORDS[i % 7]} and the", "choices": [" cat", " dog", " sun."],
         "answer": i % 3} for i in range(8)])
    roll = _jsonl(directory / "roll.jsonl", [
        {"text": " ".join(WORDS[(i + j) % 7] for j in range(12 + 8 * i))} for i in range(4)])
    gen = _jsonl(directory / "gen.jsonl", [
        {"question": f"the {WORDS[i]} and the", "answer": " cat"} for i in range(4)])
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: "
    (directory / "mc.yaml").write_text(
        f"task: tiny_mc\n{common}{mc}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    (directory / "roll.yaml").write_text(
        f"task: tiny_roll\n{common}{roll}\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (directory / "gen.yaml").write_text(
        f"task: tiny_gen\n{common}{gen}\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    return directory


def wandb_records(path: Path) -> Iterator:
    """The records of a W&B run file (``run-ID.wandb``), parsed with W&B's own protobuf
    ``Record``. The file is a LevelDB-style log: a 7-byte header (``:W&B``, 0xBEE1, version),
    then 32 KiB blocks of records, each ``crc32 (4) | length (2) | type (1) | data``, a record
    longer than a block split into first / middle / last pieces; the checksum covers the type
    byte and the data."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        body = data[position + 7:position + 7 + length]
        if kind == 0 and length == 0:  # zero padding to the block's end
            position += left
            continue
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, path
        position += 7 + length
        if kind in (2, 3):  # first or middle piece
            pending += body
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + body)
        pending = b""
        yield record


def wandb_finished_records(path: Path, timeout_s: float = 30.0) -> list:
    """:func:`wandb_records` once the file holds its ``exit`` record: W&B's service process
    writes the file, and its last records (the history rows, then ``exit``) can reach the disk
    a little after ``run.finish()`` has returned in the process that logged them."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(path))
        except AssertionError:  # a record still being written: its checksum fails
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has no exit record after {timeout_s:.0f} s")
        time.sleep(0.2)


def wandb_history(path: Path) -> list[dict]:
    """Every history row (``run.log``) of a finished W&B run file, as ``{name: value}``."""
    rows = []
    for record in wandb_finished_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
