"""ZeRO-3's CPU gather buffers really give their memory back when released.

A released :class:`~meshtrain.parallel.data.mapped.MappedBuffer` must read as zeros: its pages
were dropped. A *shared* anonymous map (Python's ``mmap`` default) would keep them as shared
memory and read the old values back, while the process's resident size (what ``VmHWM`` sees)
fell as if they were gone.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.parallel.data.mapped import MappedBuffer, mapped_buffers_supported

pytestmark = pytest.mark.skipif(not mapped_buffers_supported(torch.device("cpu")),
                                reason="needs madvise(MADV_DONTNEED)")


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_released_buffer_drops_its_pages_and_reads_zeros():
    buffer = MappedBuffer(8 << 20, torch.float32)  # 32 MiB
    buffer.tensor.fill_(3.0)
    filled = _resident_kib()
    buffer.release()
    assert _resident_kib() < filled - (16 << 10)  # at least half of it left the process
    assert int(buffer.tensor.count_nonzero()) == 0  # the pages are gone, not just unmapped
    buffer.tensor[:4] = 1.0  # usable again: faults in fresh pages
    assert buffer.tensor[:5].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
