"""Peak resident memory of child processes, read from outside them.

A process's own report of its peak memory is a number it computes about itself; the kernel's
high-water mark of its resident set (``VmHWM`` in ``/proc/<pid>/status``) is not. A
:class:`PeakWatcher` runs in the parent beside the workers it started and reads every worker's
``VmHWM`` every ``interval_s`` until the worker exits. ``VmHWM`` only grows, so the last value read
is the worker's peak up to that moment; a worker's memory stops growing once its work is done
(it then only sends its result and exits), so the last read, taken after that, is its peak.
"""

from __future__ import annotations

import threading


def read_vm_hwm(pid: int) -> int | None:
    """``VmHWM`` of process ``pid`` in bytes, or None once it has exited (or off Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class PeakWatcher:
    """Polls the ``VmHWM`` of ``pids`` on a daemon thread; :meth:`stop` returns the last value
    read for each (0 for a process that could never be read, e.g. off Linux)."""

    def __init__(self, pids: list[int], interval_s: float = 0.02):
        self.pids = list(pids)
        self.peaks = [0] * len(self.pids)
        self._interval = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            alive = False
            for k, pid in enumerate(self.pids):
                value = read_vm_hwm(pid)
                if value is not None:
                    alive = True
                    self.peaks[k] = max(self.peaks[k], value)
            if not alive or self._done.wait(self._interval):
                return

    def stop(self) -> list[int]:
        """Read once more, stop polling and return each process's peak in bytes."""
        for k, pid in enumerate(self.pids):
            value = read_vm_hwm(pid)
            if value is not None:
                self.peaks[k] = max(self.peaks[k], value)
        self._done.set()
        self._thread.join()
        return list(self.peaks)
