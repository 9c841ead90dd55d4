"""``meshtrain prepare`` at scale: time linear in the length of a line, and peak memory of its
workers bounded, measured from outside (``VmHWM`` and CPU time from ``/proc``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshtrain.data import prepare as prep
from meshtrain.data import readers

MESHTRAIN = str(Path(sys.executable).with_name("meshtrain"))
MIB = 2**20


# --------------------------------------------------------------------------------- measurement


def _poll_tree(root: int, peaks: dict[int, int], cpu: dict[int, float]) -> None:
    """Record the VmHWM (bytes) and CPU seconds of ``root`` and every descendant."""
    children: dict[int, list[int]] = {}
    fields: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields[int(entry)] = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[int(entry)][1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            peaks[pid] = max(peaks.get(pid, 0), kb * 1024)
            cpu[pid] = (int(fields[pid][11]) + int(fields[pid][12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, StopIteration, KeyError):
            continue


def _write_big_jsonl(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    words = [f"w{i}ord" for i in range(5000)] + ["naïve", "café", "日本語", "the", "a"]
    lines = [json.dumps({"text": " ".join(rng.choice(words, rng.integers(20, 400))), "id": i})
             for i in range(4000)]
    block = ("\n".join(lines) + "\n").encode()
    with open(path, "wb") as handle:
        for _ in range(size // len(block) + 1):
            handle.write(block)


def _measure(source: Path, out: Path, workers: int) -> tuple[float, float, int, int]:
    """Wall seconds, CPU seconds of the tokenizing processes (the workers; the main process
    when there is one), the largest VmHWM of any process of ``meshtrain prepare`` and the
    largest of its child processes."""
    start = time.monotonic()
    proc = subprocess.Popen([MESHTRAIN, "prepare", str(source), "--out", str(out),
                             "--workers", str(workers)], stdout=subprocess.DEVNULL)
    peaks: dict[int, int] = {}
    cpu: dict[int, float] = {}
    while True:
        _poll_tree(proc.pid, peaks, cpu)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # ru_maxrss: the largest of the process and its reaped workers, in KiB
            break
        time.sleep(0.02)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    children = [peak for pid, peak in peaks.items() if pid != proc.pid]
    # the workers (the resource tracker's few ms left out), or the main process when it is alone
    busy = [cpu[proc.pid]] if workers == 1 else \
        sorted(v for pid, v in cpu.items() if pid != proc.pid)[-workers:]
    return (wall, sum(busy), max(*peaks.values(), usage.ru_maxrss * 1024),
            max(children, default=0))


@pytest.mark.slow
def test_prepare_200mb_jsonl_two_workers_peak_rss_under_500mib(tmp_path):
    """Every process of ``meshtrain prepare big.jsonl --workers 2`` stays under 500 MiB."""
    source = tmp_path / "big.jsonl"
    _write_big_jsonl(source, 200 * MIB)
    size = source.stat().st_size
    results = {w: _measure(source, tmp_path / f"out{w}", w) for w in (2, 1)}
    for workers, (wall, cpu, peak, worker_peak) in results.items():
        print(f"workers {workers}: {size / 1e6:.0f} MB in {wall:.1f} s wall = "
              f"{size / 1e6 / wall:.1f} MB/s ({size / 1e6 / wall / workers:.1f} per worker); "
              f"tokenizing processes {cpu:.1f} CPU s = {size / 1e6 / cpu:.1f} MB per CPU s; "
              f"peak VmHWM {peak / MIB:.0f} MiB (workers {worker_peak / MIB:.0f} MiB)")
    assert (tmp_path / "out1" / "shard-00000.bin").read_bytes() == \
        (tmp_path / "out2" / "shard-00000.bin").read_bytes()
    assert all(peak < 500 * MIB for _, _, peak, _ in results.values())


# ------------------------------------------------------------------------------ long lines


def _one_line_jsonl(path: Path, size: int) -> Path:
    """One JSON line of about ``size`` bytes (its non-ASCII text escaped, as json.dumps does)."""
    words = "naïve café 日本語 the cat sat; "
    repeat = size // len(json.dumps(words).encode())
    path.write_text(json.dumps({"text": words * repeat}) + "\n")
    return path


def test_prepare_time_is_linear_in_the_length_of_a_line(tmp_path, monkeypatch):
    """A one-line ``.jsonl`` four times as long (8 -> 32 MiB) takes at most six times as long to
    prepare, read in 64 KiB chunks (512 for the long line); the CPU time of this process is
    compared (``prepare`` runs here with one worker), the fastest of five runs each, so that other
    jobs on the machine do not decide it. The reader this replaced joined the line so far to every
    new chunk: 0.19 s -> 2.8 s here, fifteen times, growing with the square of the line. Memory:
    about four times the line (its text, its UTF-8 bytes, its uint16 ids)."""
    import shutil
    import tracemalloc

    monkeypatch.setattr(readers, "READ_BYTES", 64 * 1024)
    sources = {mib: _one_line_jsonl(tmp_path / f"line{mib}.jsonl", mib * MIB) for mib in (8, 32)}
    prep.prepare([str(sources[32])], tmp_path / "warm")  # imports, first touch of the memory
    cpu: dict[int, list[float]] = {8: [], 32: []}
    wall: dict[int, list[float]] = {8: [], 32: []}
    for attempt in range(5):
        for mib, source in sources.items():
            out = tmp_path / f"out{mib}-{attempt}"
            started, cpu_started = time.perf_counter(), time.process_time()
            meta = prep.prepare([str(source)], out)
            cpu[mib].append(time.process_time() - cpu_started)
            wall[mib].append(time.perf_counter() - started)
            assert meta["documents"] == 1
            shutil.rmtree(out)
    ratio = min(cpu[32]) / min(cpu[8])
    print(f"one-line jsonl, CPU s (wall s): 8 MiB {min(cpu[8]):.3f} ({min(wall[8]):.3f}), "
          f"32 MiB {min(cpu[32]):.3f} ({min(wall[32]):.3f}): x{ratio:.1f}")
    assert ratio <= 6, f"4x the line took {ratio:.1f}x as long ({min(cpu[8]):.3f} s for 8 MiB)"
    line = sources[8]
    tracemalloc.start()  # numpy reports its buffers to tracemalloc too
    try:
        prep.prepare([str(line)], tmp_path / "traced")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 5 * line.stat().st_size, f"peak {peak / line.stat().st_size:.1f}x the line"
