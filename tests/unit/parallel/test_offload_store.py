"""The offload store (:mod:`meshtrain.parallel.offload.store`): nvme tensors are pages of unnamed,
fully reserved files whose release drops them from the process but keeps their values; chunks
start at aligned offsets from their range's start."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from meshtrain.errors import RunFailure
from meshtrain.parallel.offload.store import ALIGN, OffloadStore

MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_nvme_tensors_start_zero_and_leave_no_file_behind(tmp_path):
    store = OffloadStore("nvme", tmp_path / "rank0")
    a = store.zeros(10_000, torch.float32)
    b = store.zeros(3, torch.bfloat16)
    assert a.device.type == "cpu" and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert not a.any() and not b.any()
    assert store.holds(a[100:]) and store.holds(b) and not store.holds(torch.zeros(4))
    assert store.nbytes == 10_000 * 4 + 3 * 2
    assert list((tmp_path / "rank0").iterdir()) == []  # unnamed: nothing for a crash to leave


def test_release_drops_resident_pages_and_keeps_values(tmp_path):
    """64 MiB written through the map are resident; released, the process's RSS falls by about
    that much, and reading back gives the written values (from the file's pages)."""
    store = OffloadStore("nvme", tmp_path / "rank0")
    t = store.zeros(16 * MIB, torch.float32)  # 64 MiB
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    touched = _rss_bytes()
    store.release(t)
    assert touched - _rss_bytes() > 56 * MIB
    assert torch.equal(t[::4096], torch.arange(0, t.numel(), 4096, dtype=torch.float32))
    store.release_all()
    assert touched - _rss_bytes() > 56 * MIB


def test_chunked_passes_stay_within_a_chunk(tmp_path):
    """Zeroing and copying 64 MiB a 4 MiB chunk at a time never holds much more than a chunk of
    each tensor."""
    store = OffloadStore("nvme", tmp_path / "rank0", chunk_mb=4)
    src, dst = store.zeros(16 * MIB, torch.float32), store.zeros(16 * MIB, torch.float32)
    src.fill_(3.0)
    store.release(src)
    before = _rss_bytes()
    store.copy(dst, src)
    after_copy = _rss_bytes()
    store.zero(src)
    assert after_copy - before < 16 * MIB and _rss_bytes() - before < 16 * MIB
    assert float(dst[-1]) == 3.0 and float(src[-1]) == 0.0


def test_chunks_are_aligned_from_the_range_start():
    store = OffloadStore("host", chunk_mb=0.001)
    assert store.chunk_numel == ALIGN
    pieces = list(store.chunks(5, 5 + 2 * ALIGN + 7))
    assert pieces == [(5, 5 + ALIGN), (5 + ALIGN, 5 + 2 * ALIGN), (5 + 2 * ALIGN,
                                                                     5 + 2 * ALIGN + 7)]
    assert OffloadStore("host", chunk_mb=16).chunk_numel == 4 * MIB


def test_a_full_disk_fails_at_allocation_with_the_sizes(tmp_path, monkeypatch):
    """posix_fallocate reserves every block when the file is made: ENOSPC there is a clear
    failure naming the directory, not a SIGBUS when a page is first written mid-step."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    store = OffloadStore("nvme", tmp_path / "rank0")
    with pytest.raises(RunFailure, match="no room for 1.00 GiB") as caught:
        store.zeros(1000, torch.float32)
    assert str(tmp_path / "rank0") in str(caught.value)


def test_host_store_holds_plain_memory():
    store = OffloadStore("host")
    t = store.zeros(100, torch.float32)
    store.release(t)  # nothing to drop
    t += 1
    assert store.holds(t[3:]) and float(t.sum()) == 100.0
