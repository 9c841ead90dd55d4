"""A rank's memory does not grow with the corpus: training data is read through memory maps.

Measured from outside (the kernel's VmHWM of every worker, see
:mod:`meshtrain.commands.bench.memory_peak`), dp 2, a tiny model:

- a 512 MiB pre-tokenized ``.bin`` corpus against a 1 MiB one: each worker's peak may be at most
  96 MiB above the small corpus's run (the bound of the data-at-scale issue);
- a raw ``.jsonl`` source against the same corpus prepared by ``meshtrain prepare``: with a cold
  token cache, so one rank of the raw run tokenizes the source (streaming, into the cache) and
  the other waits for it, each worker's peak may be at most 1.3 times its peak with the prepared
  corpus. 1 GiB of ``.jsonl`` in the slow test (``make bench``), 48 MiB in the suite.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshtrain.commands.bench.memory_peak import RUN, TINY_MODEL, measure_train_peaks
from meshtrain.data.prepare import prepare
from meshtrain.data.prepared import is_complete
from meshtrain.data.sources import CACHE_ENV

MIB = 2**20


def _write_corpus(path, size_bytes: int) -> None:
    """``size_bytes`` of uint16 byte-tokenizer ids (< 256), written in 64 MiB pieces."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as handle:
        for start in range(0, size_bytes // 2, 32 * MIB):
            count = min(32 * MIB, size_bytes // 2 - start)
            rng.integers(0, 256, count, dtype=np.uint16).tofile(handle)


@pytest.mark.slow
def test_512mib_corpus_costs_at_most_96mib_per_rank(tmp_path):
    """Every dp-2 worker's VmHWM with 512 MiB of tokens is <= its VmHWM with 1 MiB + 96 MiB."""
    peaks = {}
    for name, size in (("small", MIB), ("large", 512 * MIB)):
        corpus = tmp_path / f"{name}.bin"
        _write_corpus(corpus, size)
        overrides = TINY_MODEL + RUN + ["parallel.dp=2", f"data.source={corpus}"]
        peaks[name] = measure_train_peaks(overrides, 2, tmp_path / name)["peaks"]
        corpus.unlink()
    excess = [a - b for a, b in zip(peaks["large"], peaks["small"], strict=True)]
    print(f"VmHWM MiB small {[round(p / MIB) for p in peaks['small']]} "
          f"large {[round(p / MIB) for p in peaks['large']]} "
          f"excess {[round(e / MIB, 1) for e in excess]}")
    assert max(excess) <= 96 * MIB, f"excess MiB {[round(e / MIB) for e in excess]} > 96"


def _write_jsonl(path, size_bytes: int) -> None:
    """About ``size_bytes`` of ``.jsonl`` documents of 20-400 words (some non-ASCII): a 1 MiB
    block of them, repeated with fresh ids."""
    rng = np.random.default_rng(0)
    words = [f"w{i}ord" for i in range(5000)] + ["naïve", "café", "日本語", "the", "a"]
    texts = [" ".join(rng.choice(words, rng.integers(20, 400))) for _ in range(500)]
    written, block = 0, 0
    with open(path, "w") as handle:
        while written < size_bytes:
            lines = "".join(json.dumps({"text": text, "id": f"{block}-{i}"}) + "\n"
                            for i, text in enumerate(texts))
            handle.write(lines)
            written += len(lines.encode())
            block += 1


def _raw_against_prepared(tmp_path, monkeypatch, size_bytes: int) -> dict:
    """VmHWM of every dp-2 worker training from a ``size_bytes`` ``.jsonl`` source with a cold
    token cache, and from the same source prepared; wall seconds of both runs."""
    source = tmp_path / "corpus.jsonl"
    _write_jsonl(source, size_bytes)
    prepare([str(source)], tmp_path / "prepared", workers=2)
    cache = tmp_path / "token-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))  # the workers inherit it: nothing cached yet
    result = {}
    for name, data in (("prepared", tmp_path / "prepared"), ("raw", source)):
        overrides = TINY_MODEL + RUN + ["parallel.dp=2", f"data.source={data}"]
        result[name] = measure_train_peaks(overrides, 2, tmp_path / name)
    entries = [p for p in cache.glob("tokens-*") if p.is_dir()]
    assert len(entries) == 1 and is_complete(entries[0])  # the raw run tokenized it, once
    assert sum(p.stat().st_size for p in entries[0].glob("shard-*.bin")) == \
        sum(p.stat().st_size for p in (tmp_path / "prepared").glob("shard-*.bin"))
    raw, prepared = result["raw"]["peaks"], result["prepared"]["peaks"]
    ratios = [r / p for r, p in zip(raw, prepared, strict=True)]
    print(f"{source.stat().st_size / MIB:.0f} MiB .jsonl, VmHWM MiB per rank: prepared "
          f"{[round(p / MIB) for p in prepared]} ({result['prepared']['wall_s']:.1f} s), raw "
          f"with a cold cache {[round(r / MIB) for r in raw]} ({result['raw']['wall_s']:.1f} s): "
          f"x{[round(r, 3) for r in ratios]}")
    return {"ratios": ratios, "raw": raw, "prepared": prepared}


def test_raw_jsonl_rank_peaks_within_1_3x_of_the_prepared_corpus(tmp_path, monkeypatch):
    """48 MiB of ``.jsonl``: each worker's VmHWM from the raw source (tokenized into the cache by
    one of them) is at most 1.3 times its VmHWM from the same corpus prepared."""
    ratios = _raw_against_prepared(tmp_path, monkeypatch, 48 * MIB)["ratios"]
    assert max(ratios) <= 1.3, f"raw / prepared VmHWM {ratios}"


@pytest.mark.slow
def test_raw_1gib_jsonl_rank_peaks_within_1_3x_of_the_prepared_corpus(tmp_path, monkeypatch):
    """As above with 1 GiB of ``.jsonl`` (a rank loading it whole into a list, as before the
    token cache, would peak at several GiB)."""
    ratios = _raw_against_prepared(tmp_path, monkeypatch, 1024 * MIB)["ratios"]
    assert max(ratios) <= 1.3, f"raw / prepared VmHWM {ratios}"
