"""A rank's memory does not grow with the corpus: training data is read through memory maps.

Measured from outside (the kernel's VmHWM of every worker, see
:mod:`meshtrain.commands.bench.memory_peak`):
dp 2, a tiny model, a 512 MiB pre-tokenized ``.bin`` corpus against a 1 MiB one. Each worker's
peak may be at most 96 MiB above the small corpus's run (the bound of the data-at-scale issue).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.commands.bench.memory_peak import RUN, TINY_MODEL, measure_train_peaks

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
