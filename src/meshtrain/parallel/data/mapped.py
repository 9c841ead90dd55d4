"""ZeRO-3 gather buffers that give their memory back to the kernel when freed (CPU).

A ZeRO-3 bucket's full parameter buffer exists only while its block computes. The gatherer frees
it between uses; autograd has saved views of it, so it must stay the *same* storage, refilled by
the next gather. On CUDA that is ``storage.resize_(0)`` and back (the caching allocator reuses
the blocks). On the CPU, ``malloc`` serves those 10-100 MiB requests from the heap, which
meshtrain's host allocator settings keep (:mod:`meshtrain.host.allocator`): repeated gathers
and frees of differently sized buckets between the step's other allocations fragment it, and a
dp 8 ZeRO-3 rank's resident memory grew by hundreds of MiB per step (measured from outside).

So on the CPU each bucket's buffer is its own anonymous memory map: "free" is
``madvise(MADV_DONTNEED)``, which drops the pages at once (the next gather faults in zeroed
pages), and the storage never moves. The map must be *private*: Python's ``mmap.mmap(-1, n)``
is shared by default, and a shared anonymous map is shared memory (``Shmem`` in
``/proc/meminfo``) whose pages ``MADV_DONTNEED`` only unmaps from the process, so its resident
size falls while the machine keeps every byte (and the next gather reads the old values back).
"""

from __future__ import annotations

import mmap

import torch


class MappedBuffer:
    """A 1-D tensor of ``numel`` ``dtype`` elements over an anonymous memory map."""

    def __init__(self, numel: int, dtype: torch.dtype):
        size = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # see the module docstring
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=size)[
            :numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def release(self) -> None:
        """Hand the pages back to the kernel; the contents read as zeros afterwards."""
        self._map.madvise(mmap.MADV_DONTNEED)


def mapped_buffers_supported(device: torch.device) -> bool:
    """Whether buffers on ``device`` can be :class:`MappedBuffer` (CPU, ``madvise`` present)."""
    return device.type == "cpu" and hasattr(mmap, "MADV_DONTNEED")


def release_full_buffer(b) -> None:
    """Drop the memory of a ZeRO-3 bucket's full parameter buffer, keeping the tensor (and the
    storage autograd saved views of) to be refilled by the next gather."""
    if getattr(b, "mapped", None) is not None:
        b.mapped.release()
    else:
        b.param_buffer.untyped_storage().resize_(0)


def restore_full_buffer(b) -> None:
    """Give a released bucket buffer its memory back (contents undefined until gathered)."""
    if getattr(b, "mapped", None) is None:
        b.param_buffer.untyped_storage().resize_(b.padded_numel * b.param_buffer.element_size())
