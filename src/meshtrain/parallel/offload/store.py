"""Where offloaded state lives: host memory, or memory-mapped files on a local disk (nvme).

An :class:`OffloadStore` hands out flat CPU tensors (:meth:`OffloadStore.zeros`) that the engine
and the optimizer use as they would any tensor: the fp32 masters, the Adam moments, the gradient
shards and, under ``optimizer+params``, the parameter shards of one rank.

``host``: ordinary host memory (pinned when the compute device is CUDA, so copies to and from
the device run at full PCIe speed). On a CPU-only machine that is the memory the state would
have used anyway.

``nvme``: the tensors are page-aligned pieces of files of at least 1 GiB in this rank's
directory, mapped shared (``MAP_SHARED``) into the process. Whatever the code touches is paged
in from the page cache or the disk; :meth:`OffloadStore.release` then drops those pages from
the process (``madvise(MADV_DONTNEED)``: for a shared file mapping the data stays in the file
and the page cache, only the process's mapping of it goes), so every pass over offloaded state
walks it one chunk of :attr:`OffloadStore.chunk_numel` elements at a time and the process's
resident memory holds about one chunk of each tensor it is reading.
:meth:`OffloadStore.prefetch` (``MADV_WILLNEED``) starts reading the next chunk from disk while
the current one computes. Pages the process let go stay in the kernel's page cache while memory
is free (counted as the machine's cache, not the process's) and are written to the file and
dropped when memory is needed.

Crash care. The files hold the live state of a running process and are never read back: a
restarted run resumes from its checkpoint, which saves the offloaded tensors as the same logical
tensors as without offload (:mod:`meshtrain.checkpoint.dcp`, crash-safe as every checkpoint).
So the care is that nothing stale can be read and nothing fails halfway: each file is created
unnamed (``O_TMPFILE``; elsewhere created and unlinked at once), so a killed process leaves no
file behind and its disk space returns to the filesystem when it exits, and every block is
reserved at creation (``posix_fallocate``), so a full disk fails when the run starts, with the
sizes in the message, instead of as a ``SIGBUS`` in the middle of a step.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from meshtrain.errors import RunFailure

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
ARENA_BYTES = 1 << 30
"""Tensors are cut from files of at least this size (one open descriptor per file), each
tensor page-aligned in its file."""
ALIGN = 1 << 12
"""Chunks are multiples of this many elements (whole pages of fp32, whole gradient-norm rows),
counted from the start of the range they cut, so a chunked pass runs every element through the
same kernel path as one pass over the whole range."""


class OffloadStore:
    """Flat tensors of one rank's offloaded state, in host memory or in memory-mapped files."""

    def __init__(self, device: str, directory: Path | None = None, pin: bool = False,
                 chunk_mb: float = 16.0, params: bool = False, overlap: bool = False):
        """``device``: ``host`` or ``nvme``; ``directory``: this rank's directory (nvme);
        ``pin``: pinned host memory (CUDA); ``chunk_mb``: MiB of fp32 per chunk of a pass;
        ``params``: the parameter shards are offloaded too (``optimizer+params``);
        ``overlap``: the step over this state may run in the background at ZeRO-3
        (``parallel.offload_overlap``)."""
        if device not in ("host", "nvme"):
            raise ValueError(f"offload device must be host or nvme, got {device!r}")
        if device == "nvme" and directory is None:
            raise ValueError("nvme offload needs a directory")
        self.device, self.directory, self.pin, self.params = device, directory, pin, params
        self.overlap = overlap
        self.chunk_numel = max(ALIGN, int(chunk_mb * 2**20 / 4) // ALIGN * ALIGN)
        self._maps: dict[int, tuple[mmap.mmap, int, int]] = {}
        """Storage address of each nvme tensor -> (its file's map, offset, bytes)."""
        self._arena: list | None = None  # the map being filled: [map, bytes used, size]
        self._populate = True  # MADV_POPULATE_WRITE works here (until it fails once)
        self._host: set[int] = set()  # storage addresses of host tensors
        self.nbytes = 0
        """Bytes of every tensor handed out."""
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ tensors
    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed flat CPU tensor of ``numel`` ``dtype`` elements held by the store."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.nbytes += nbytes
        if self.device == "host":
            tensor = torch.zeros(numel, dtype=dtype, pin_memory=self.pin)
            self._host.add(tensor.untyped_storage().data_ptr())
            return tensor
        if not numel:
            return torch.zeros(0, dtype=dtype)
        size = -(-nbytes // PAGE) * PAGE  # every tensor starts on a page of its own
        if self._arena is None or self._arena[1] + size > self._arena[2]:
            arena = max(size, ARENA_BYTES)
            fd = self._reserved_file(arena)
            try:
                mapped = mmap.mmap(fd, arena, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._arena = [mapped, 0, arena]
        mapped, offset, _ = self._arena
        self._arena[1] += size
        tensor = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=offset)
        self._maps[tensor.untyped_storage().data_ptr()] = (mapped, offset, size)
        return tensor

    def _reserved_file(self, size: int) -> int:
        """An unnamed file of ``size`` bytes, every block reserved; returns its (closed on
        mapping) descriptor."""
        try:
            fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):  # no O_TMPFILE here: a named file, unlinked at once
            fd, name = tempfile.mkstemp(prefix="offload-", dir=self.directory)
            os.unlink(name)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RunFailure(
                    f"parallel.offload_dir {self.directory}: no room for {size / 2**30:.2f} GiB "
                    f"more of offloaded state (this rank has {self.nbytes / 2**30:.2f} GiB so "
                    f"far). Free space there or point parallel.offload_dir at a larger disk."
                ) from None
            raise
        return fd

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a tensor of this store."""
        address = tensor.untyped_storage().data_ptr()
        return address in self._maps or address in self._host

    # ------------------------------------------------------------------ residency
    def _advise(self, tensors: tuple[torch.Tensor, ...], advice: int) -> None:
        for tensor in tensors:
            entry = self._maps.get(tensor.untyped_storage().data_ptr())
            if entry is None or not tensor.numel():
                continue
            mapped, base, size = entry
            offset = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
            span = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(),
                                                        strict=True)) + 1
            start = offset // PAGE * PAGE
            stop = min(-(-(offset + span * tensor.element_size()) // PAGE) * PAGE, size)
            mapped.madvise(advice, base + start, stop - start)

    def release(self, *tensors: torch.Tensor) -> None:
        """Drop the pages of ``tensors`` (views of nvme tensors) from this process; their data
        stays in the files. Rounded out to whole pages, which is harmless for a shared file
        mapping. Anything else: nothing to do."""
        if self._maps:
            self._advise(tensors, mmap.MADV_DONTNEED)

    def prefetch(self, *tensors: torch.Tensor) -> None:
        """Ask the kernel to start reading ``tensors``' pages (nvme) before they are used."""
        if self._maps:
            self._advise(tensors, mmap.MADV_WILLNEED)

    def populate(self, *tensors: torch.Tensor) -> None:
        """Map ``tensors``' pages (nvme) writable in one call each before a kernel writes them
        (``MADV_POPULATE_WRITE``, Linux 5.14+), instead of one page fault per 4 KiB page inside
        the kernel; a no-op where the kernel does not know it."""
        if self._maps and self._populate:
            try:
                self._advise(tensors, MADV_POPULATE_WRITE)
            except OSError:
                self._populate = False

    def release_all(self) -> None:
        """Drop every page of every nvme tensor from this process (after a pass that touched
        offloaded state whole: a checkpoint, an outer step, the final save)."""
        for mapped, base, size in self._maps.values():
            mapped.madvise(mmap.MADV_DONTNEED, base, size)

    # ------------------------------------------------------------------ chunked passes
    def chunks(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` chunks of ``[lo, hi)``, each :attr:`chunk_numel` long but the
        last, counted from ``lo``."""
        for start in range(lo, hi, self.chunk_numel):
            yield start, min(start + self.chunk_numel, hi)

    @torch.no_grad()
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for flat tensors, a chunk at a time, releasing each."""
        for a, b in self.chunks(0, dst.numel()):
            self.populate(dst[a:b])
            dst[a:b].copy_(src[a:b])
            self.release(dst[a:b], src[a:b])

    @torch.no_grad()
    def zero(self, tensor: torch.Tensor) -> None:
        """``tensor.zero_()`` for a flat tensor, a chunk at a time, releasing each."""
        if not self._maps:
            tensor.zero_()
            return
        for a, b in self.chunks(0, tensor.numel()):
            self.populate(tensor[a:b])
            tensor[a:b].zero_()
            self.release(tensor[a:b])


def open_store(plan, mesh) -> OffloadStore | None:
    """The store ``plan`` (a :class:`~meshtrain.parallel.plan.ParallelPlan`) asks for on this
    rank of ``mesh``: None without offload, or on the meta device (a dry run holds no state)."""
    if getattr(plan, "offload", "none") == "none" or mesh.device.type == "meta":
        return None
    directory = None
    if plan.offload_device == "nvme":
        directory = Path(plan.offload_dir) / f"rank{mesh.rank}"
    return OffloadStore(plan.offload_device, directory, pin=mesh.device.type == "cuda",
                        chunk_mb=plan.offload_chunk_mb,
                        params=plan.offload == "optimizer+params",
                        overlap=plan.offload_overlap)
