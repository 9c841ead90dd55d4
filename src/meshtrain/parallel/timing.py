"""Clocks that time the device, not the host's queueing of kernels.

On CPU every operation has finished when it returns, so ``time.perf_counter`` is exact. On CUDA
kernels run asynchronously: a host clock read right after launching them measures the launch,
not the work. Every place meshtrain reads a clock around device work goes through this module:

- :func:`stamp` returns a point in time: a ``perf_counter`` float on CPU, a recorded
  ``torch.cuda.Event`` (``enable_timing=True``) on CUDA. Recording an event does not
  synchronise.
- :func:`seconds` turns a stamp into seconds on the host's ``perf_counter`` scale. For a CUDA
  event it waits for that event only (``Event.synchronize``) and adds its elapsed time since an
  anchor event recorded right after one ``torch.cuda.synchronize`` (when the device was idle,
  so the anchor's host time is exact). Stamps of different processes on one machine therefore
  share one time axis, as ``perf_counter`` stamps do.
- :func:`elapsed` is ``seconds(end) - seconds(start)``.

Converting stamps is done once, after the timed work (end of step, or when the timeline is
written), so timing adds no synchronisation inside the step.
"""

from __future__ import annotations

import time

import torch

_anchors: dict[int, tuple[float, object]] = {}


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _anchor(index: int) -> tuple[float, object]:
    """(host perf_counter time, CUDA event) recorded together on an idle device ``index``."""
    if index not in _anchors:
        torch.cuda.synchronize(index)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        _anchors[index] = (time.perf_counter(), event)
    return _anchors[index]


class CudaStamp:
    """A CUDA event recorded on the current stream of device ``index``."""

    __slots__ = ("event", "index")

    def __init__(self, event, index: int):
        self.event, self.index = event, index


def stamp(device: torch.device | str | None = None) -> float | CudaStamp:
    """A point in time after all work queued so far on ``device`` (no synchronisation)."""
    if not _is_cuda(device):
        return time.perf_counter()
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    _anchor(index)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return CudaStamp(event, index)


def seconds(point: float | CudaStamp) -> float:
    """A stamp in seconds on the host ``perf_counter`` scale (waits for a CUDA event)."""
    if not isinstance(point, CudaStamp):
        return float(point)
    host, anchor = _anchor(point.index)
    point.event.synchronize()
    return host + anchor.elapsed_time(point.event) / 1000.0


def elapsed(start, end) -> float:
    """Seconds between two stamps of the same device."""
    return seconds(end) - seconds(start)


def events_to_seconds(events: list[tuple]) -> list[tuple]:
    """``(rank, action, start, end)`` events with stamps converted by :func:`seconds`."""
    return [(rank, action, seconds(t0), seconds(t1)) for rank, action, t0, t1 in events]


def reset() -> None:
    """Forget the anchors (tests; after a device reset)."""
    _anchors.clear()
