"""Peak resident memory read from outside a process (:mod:`meshtrain.host.peak_watch`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshtrain.host.peak_watch import PeakWatcher, read_vm_hwm
from tests.distributed import _fresh_workers as run_distributed  # the package's, unpooled

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")

MIB = 1024 * 1024
TOUCH = """
import sys, time
block = bytearray({size})  # zero-filled: every page touched
time.sleep(0.3)
del block
time.sleep(0.3)
"""


def _child(size: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TOUCH.format(size=size)])


def test_watcher_sees_a_peak_the_child_has_already_given_back():
    small, large = _child(1 * MIB), _child(160 * MIB)
    watcher = PeakWatcher([small.pid, large.pid])
    small.wait()
    large.wait()
    peaks = watcher.stop()
    # The 160 MiB block was freed before the child exited; its high-water mark still holds it.
    assert peaks[1] - peaks[0] > 150 * MIB
    assert read_vm_hwm(large.pid) is None  # gone: nothing more to read


def test_a_pid_that_never_existed_reads_as_zero():
    watcher = PeakWatcher([2**22 + 12345])
    assert watcher.stop() == [0]


def grow(megabytes: int) -> int:
    block = bytearray(megabytes * MIB)
    return len(block)


def test_run_distributed_reports_each_workers_peak_from_outside():
    peaks: list[int] = []
    run_distributed(1, grow, 8, peaks=peaks)
    base = peaks[0]
    run_distributed(1, grow, 200, peaks=peaks)
    assert peaks[0] - base > 180 * MIB
