"""meshtrain.parallel.timing: perf_counter on CPU, CUDA events (no host sync inside) on CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from meshtrain.parallel import timing


def test_cpu_stamps_are_perf_counter_and_time_real_work():
    start = timing.stamp(torch.device("cpu"))
    assert isinstance(start, float)
    time.sleep(0.05)
    end = timing.stamp("cpu")
    assert 0.04 < timing.elapsed(start, end) < 1.0
    events = timing.events_to_seconds([(0, "F0", start, end)])
    assert events == [(0, "F0", start, end)]


class FakeClock:
    """A fake GPU: kernels "run" on a device clock that the host only sees after a sync."""

    def __init__(self):
        self.gpu_time_ms = 0.0
        self.syncs = 0
        self.event_syncs = 0


@pytest.fixture
def fake_cuda(monkeypatch):
    clock = FakeClock()

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock.gpu_time_ms

        def synchronize(self):
            clock.event_syncs += 1

        def elapsed_time(self, other):
            return other.at - self.at

    def synchronize(device=None):
        clock.syncs += 1

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    timing.reset()
    yield clock
    timing.reset()


def test_cuda_stamps_are_events_timed_on_the_device(fake_cuda):
    start = timing.stamp(torch.device("cuda"))
    assert isinstance(start, timing.CudaStamp)
    syncs_after_anchor = fake_cuda.syncs
    fake_cuda.gpu_time_ms += 250.0  # asynchronous kernels: 0.25 s of device time, ~0 host time
    end = timing.stamp("cuda:0")
    assert fake_cuda.syncs == syncs_after_anchor == 1  # stamping never synchronises the device
    assert fake_cuda.event_syncs == 1  # only the anchor waited
    assert timing.elapsed(start, end) == pytest.approx(0.25)
    [(_, _, host0, host1)] = timing.events_to_seconds([(1, "B3", start, end)])
    assert host1 - host0 == pytest.approx(0.25)
    assert abs(host0 - time.perf_counter()) < 5.0  # on the host perf_counter axis


def test_perf_counter_would_miss_asynchronous_work(fake_cuda):
    """The reason for the module: a host clock around queued kernels reads ~0."""
    host_start = time.perf_counter()
    gpu_start = timing.stamp("cuda")
    fake_cuda.gpu_time_ms += 1000.0
    assert time.perf_counter() - host_start < 0.5
    assert timing.elapsed(gpu_start, timing.stamp("cuda")) == pytest.approx(1.0)
