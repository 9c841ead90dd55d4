"""Gradient reduction through shared memory between the ranks of one host.

On CPU, gloo moves every byte of an all-reduce through loopback TCP: a two-process all-reduce of
a 13 MB gradient bucket took 13.6 ms on an idle two-core VM and 18–20 ms of a 0.6 s
data-parallel step in training, while summing the same bytes through shared memory took 4.5 ms
(``docs/performance.md``, measured 2026-11-30). When every rank of a data-parallel group runs on
this host, :class:`SharedMemoryReducer` places each rank's flat gradient buffer in anonymous
shared memory (a ``memfd``) that every other rank of the group maps as well, and reduces it in
place:

1. barrier: every rank's buffer holds its local gradients;
2. rank ``r`` sums segment ``r`` (the buffer cut in ``n`` equal pieces) over all buffers, in rank
   order, into its own buffer;
3. barrier: every segment is reduced;
4. rank ``r`` copies every other segment ``k`` from rank ``k``'s buffer (all-reduce only);
5. barrier: no rank reads another's buffer any more, so the next step may write its own.

A reduce-scatter is steps 1, 2 and 5.

**Barriers** go through pipes, not through gloo: each rank owns a pipe that every other rank
opened for writing, and a barrier writes this rank's id into every peer's pipe, then reads its own
until every peer has arrived (each message names its sender, so a fast rank already in the next
barrier is not miscounted). A barrier costs 0.03 ms between two ranks, against 0.3 ms for a
one-element gloo all-reduce (idle) and ~2 ms under training load; it blocks in the kernel (no
spinning) and never touches the group's gloo channel, so it cannot pair up with the group's other
collectives. A rank that does not arrive within ``timeout_s`` (``train.collective_timeout_s``)
fails the wait with a message naming it; a rank that died closes its pipe ends, which fails the
others at once (``connection closed``) when they next write to it or, in a group of two, while
they wait for it (in larger groups a rank already waiting notices at the timeout).

**Numerics.** Each segment is summed in rank order (``((g0 + g1) + g2) + ...``) by one rank and
copied bit for bit to the others: deterministic, the same on every rank, and, for two ranks,
bitwise equal to gloo's result (a two-operand floating-point sum does not depend on the order).

**Overlap.** Each reduction runs on a short-lived thread, so the caller (a gradient hook during
backward) goes on computing as it would with gloo's asynchronous work; reductions of one group run
one after another, in the order they were issued, as the barriers require. PyTorch's kernels
release the GIL, so the reduction and backward run in parallel.

**Where it applies.** :meth:`SharedMemoryReducer.connect` probes the group once: each rank writes
a random token into a small ``memfd`` and every other rank must read it back through
``/proc/<pid>/fd/<fd>``. That fails across hosts, across containers with separate PID namespaces
or where ``/proc`` access is restricted, and then the group keeps gloo (every rank agrees on the
outcome). Buffers are ``memfd``s rather than files in ``/dev/shm``: nothing is left behind when a
process dies, and the size is not capped by a small ``/dev/shm`` mount (Docker's default is 64 MB).
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

_TOKEN_BYTES = 16
_ID_BYTES = 4
DEFAULT_TIMEOUT_S = 1800.0
"""Barrier timeout when the group states none (torch's default for gloo, 30 minutes)."""


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux


def drop_resident_pages(view: torch.Tensor) -> None:
    """Unmap this process's pages of ``view`` (a part of another rank's shared buffer that was
    just read): they stay in the owner's memory, and are counted in this process's resident set
    (and ``VmHWM``) only until here. The next read faults them in again. Only whole pages inside
    the view are dropped."""
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    first = -(-start // _PAGE) * _PAGE
    last = end // _PAGE * _PAGE
    if last <= first:
        return
    _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def peer_path(pid: int, fd: int) -> str:
    """Where another process's open descriptor ``fd`` can be opened from this one."""
    return f"/proc/{pid}/fd/{fd}"


def _read_token(pid: int, fd: int) -> bytes | None:
    """The first bytes of another process's memfd, or None when it cannot be opened here."""
    try:
        peer = os.open(peer_path(pid, fd), os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(peer, _TOKEN_BYTES, 0)
    finally:
        os.close(peer)


def close_all(fds: list[int]) -> None:
    """Close every descriptor of ``fds``, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class PipeBarrier:
    """A barrier among the ranks of one host through one pipe per rank (see the module doc)."""

    def __init__(self, read_fd: int, to_peer: dict[int, int], rank: int, global_ranks: list[int],
                 axis: str, timeout_s: float):
        self._read_fd, self._to_peer = read_fd, to_peer
        self.rank, self.global_ranks, self.axis = rank, global_ranks, axis
        self.timeout_s = timeout_s
        self._arrived = [0] * len(global_ranks)
        self._count = 0
        self._partial = b""
        self.close = weakref.finalize(self, close_all, [read_fd, *to_peer.values()])
        """Close this rank's pipe ends now (they close with the object otherwise); the other
        ranks' next barrier then fails as if this process had exited."""

    def wait(self) -> None:
        """Return once every rank of the group has called its ``wait`` as often as this one;
        raise ``RuntimeError`` when a rank is gone or does not arrive within ``timeout_s``."""
        self._count += 1
        me = self.rank.to_bytes(_ID_BYTES, "little")
        for peer, fd in self._to_peer.items():
            try:
                os.write(fd, me)
            except OSError as error:  # BrokenPipeError: the peer's read end is closed
                raise RuntimeError(self._lost([peer], error)) from error
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [k for k in self._to_peer if self._arrived[k] < self._count]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable(remaining):
                ranks = ", ".join(str(self.global_ranks[k]) for k in missing)
                raise RuntimeError(
                    f"shared-memory reduction on the {self.axis} group timed out after "
                    f"{self.timeout_s:g} s: rank(s) {ranks} did not arrive "
                    "(train.collective_timeout_s)")
            data = os.read(self._read_fd, 4096)
            if not data:  # every writer closed: all the other ranks are gone
                raise RuntimeError(self._lost(missing, None))
            data, cut = self._partial + data, len(self._partial + data) // _ID_BYTES * _ID_BYTES
            data, self._partial = data[:cut], data[cut:]
            for i in range(0, len(data), _ID_BYTES):
                self._arrived[int.from_bytes(data[i:i + _ID_BYTES], "little")] += 1

    def _readable(self, timeout_s: float) -> bool:
        """Whether this rank's pipe has data (or every writer closed it) within ``timeout_s``.
        ``poll``, not ``select``: ``select`` refuses descriptors numbered 1024 or more, which a
        process holding many sockets (gloo's, in a large job) or files reaches."""
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        return bool(poller.poll(max(int(timeout_s * 1000), 1)))

    def _lost(self, peers: list[int], error: BaseException | None) -> str:
        ranks = ", ".join(str(self.global_ranks[k]) for k in peers)
        return (f"shared-memory reduction on the {self.axis} group: connection closed by rank(s) "
                f"{ranks} (the process exited){f': {error}' if error else ''}")


def open_host_pipes(comm) -> tuple[int, dict[int, int], int, list[int]] | None:
    """Probe whether every rank of ``comm`` can map this rank's memory and, if so, open one pipe
    per rank that every other rank writes into (collective; every rank gets the same verdict).

    Returns ``(read_fd, to_peer, rank, global_ranks)``: this rank's read end, a write end into
    each other rank's pipe by its axis rank, this rank's axis rank and every axis rank's global
    rank; the caller owns the descriptors. None when the group cannot share memory (across
    hosts, separate PID namespaces, ``/proc`` restricted, no ``memfd``)."""
    token = secrets.token_bytes(_TOKEN_BYTES)
    own: list[int] = []
    opened: list[int] = []
    try:
        probe = os.memfd_create("meshtrain-probe", os.MFD_CLOEXEC)
        own.append(probe)
        os.write(probe, token)
        read_fd, write_fd = os.pipe()
        own += [read_fd, write_fd]
        mine = [os.getpid(), probe, token.hex(), read_fd]  # JSON: the token as hex
    except (OSError, AttributeError):  # no memfd on this platform
        mine = None
    try:
        peers = comm.all_gather_json(mine)
        rank = dist.get_rank(comm.group)
        to_peer: dict[int, int] = {}
        ok = None not in peers
        if ok:
            ok = all(_read_token(pid, fd) == bytes.fromhex(peer_token)
                     for pid, fd, peer_token, _ in peers)
        if ok:
            try:
                for k, (pid, _, _, peer_read) in enumerate(peers):
                    if k != rank:
                        to_peer[k] = os.open(peer_path(pid, peer_read), os.O_WRONLY)
                        opened.append(to_peer[k])
            except OSError:
                ok = False
        ok = all(comm.all_gather_json(ok))  # also: everyone has opened what it needs
        if not ok:
            return None
        global_ranks = [dist.get_global_rank(comm.group, k) for k in range(comm.size)]
        own.remove(read_fd)
        opened.clear()  # the caller owns them now
        return read_fd, to_peer, rank, global_ranks
    finally:
        close_all(own + opened)


def _connect_channels(comm, timeout_s: float) -> PipeBarrier | None:
    """The group's :class:`PipeBarrier` (:func:`open_host_pipes`), or None."""
    pipes = open_host_pipes(comm)
    if pipes is None:
        return None
    read_fd, to_peer, rank, global_ranks = pipes
    return PipeBarrier(read_fd, to_peer, rank, global_ranks, comm.axis, timeout_s)


class SharedWork:
    """An in-flight shared-memory reduction (the counterpart of a gloo ``Work`` handle)."""

    def __init__(self, run: Callable[[], None], previous: SharedWork | None):
        self._run, self._previous = run, previous
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="meshtrain-shm-reduce",
                                        daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            if self._previous is not None:
                self._previous.wait()  # keep the group's reductions in issue order
            self._run()
        except BaseException as error:  # noqa: BLE001 - re-raised in wait()
            self._error = error
        finally:
            self._run = self._previous = None

    def wait(self) -> bool:
        """Block until the reduction finished; re-raise its error (e.g. a dead rank)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return True


class SharedMemoryReducer:
    """In-place all-reduce and reduce-scatter of buffers that every rank of a group maps.

    Create it with :meth:`connect` (collective on the group), allocate the buffers to be reduced
    with :meth:`new_buffer` (collective, same order on every rank), then reduce them through the
    :class:`~meshtrain.parallel.comm.CountedComm` it is attached to, which counts and logs each
    call like any other collective."""

    def __init__(self, barrier: PipeBarrier, size: int):
        self.barrier, self.rank, self.size = barrier, barrier.rank, size
        self._buffers: dict[int, list[torch.Tensor]] = {}
        """By the data pointer of this rank's buffer: every rank's buffer of the same reduction,
        mapped into this process (index ``k`` is rank ``k``'s)."""
        self._last: SharedWork | None = None
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, comm, timeout_s: float | None = None) -> SharedMemoryReducer | None:
        """Attach a reducer to ``comm`` when every rank of its group shares this host's memory;
        return it, or None (and leave ``comm`` on gloo) when not. Collective on the group.
        ``timeout_s``: how long a barrier waits for a late rank (None = 30 minutes)."""
        if not comm.active or dist.get_backend(comm.group) != "gloo":
            return None
        barrier = _connect_channels(comm, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        if barrier is None:
            return None
        reducer = cls(barrier, comm.size)
        comm.shared_memory = reducer
        return reducer

    # ------------------------------------------------------------------ buffers
    def new_buffer(self, comm, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D buffer of ``numel`` elements in shared memory, mapped by every rank of
        the group (collective: every rank allocates the same buffers in the same order)."""
        self.wait_all()  # the barrier below must not interleave with a reduction's
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create("meshtrain-grad", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            peers = comm.all_gather_json([os.getpid(), fd])
            views = [torch.from_file(peer_path(pid, peer_fd), shared=True, size=numel,
                                     dtype=dtype) for pid, peer_fd in peers]
            self.barrier.wait()  # every rank mapped every buffer: the fds may close
        finally:
            os.close(fd)
        self._buffers[views[self.rank].data_ptr()] = views
        return views[self.rank]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this reducer's buffers, or a leading part of one."""
        views = self._buffers.get(tensor.data_ptr())
        return (views is not None and tensor.dim() == 1 and tensor.is_contiguous()
                and tensor.numel() <= views[self.rank].numel())

    def peer_views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's counterpart of ``tensor`` (a buffer of :meth:`new_buffer` or a leading
        part of one), index ``k`` being rank ``k``'s, this rank's own included."""
        return [view[:tensor.numel()] for view in self._buffers[tensor.data_ptr()]]

    def barrier_after_reductions(self) -> None:
        """Finish every reduction in flight, then wait until every rank of the group is here."""
        self.wait_all()
        self.barrier.wait()

    # ------------------------------------------------------------------ reductions
    def _segment(self, numel: int, k: int) -> slice:
        per = -(-numel // self.size)
        return slice(min(k * per, numel), min((k + 1) * per, numel))

    def _reduce_own_segment(self, views: list[torch.Tensor]) -> torch.Tensor:
        """Sum this rank's segment over every rank's buffer, in rank order, into our buffer."""
        seg = self._segment(views[0].numel(), self.rank)
        parts = [v[seg] for v in views]
        out = parts[self.rank]
        if self.rank <= 1:  # our own values are consumed by the first addition
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        else:
            total = parts[0] + parts[1]
            for part in parts[2:]:
                total.add_(part)
            out.copy_(total)
        return out

    def _submit(self, run: Callable[[], None]) -> SharedWork:
        with self._lock:
            self._last = SharedWork(run, self._last)
            return self._last

    def all_reduce(self, tensor: torch.Tensor) -> SharedWork:
        """Start summing ``tensor`` (a buffer of :meth:`new_buffer`) over the group, in place."""
        views = self.peer_views(tensor)
        barrier = self.barrier

        def run():
            barrier.wait()
            self._reduce_own_segment(views)
            barrier.wait()
            mine = views[self.rank]
            for k, view in enumerate(views):
                if k != self.rank:
                    seg = self._segment(mine.numel(), k)
                    mine[seg].copy_(view[seg])
            barrier.wait()
        return self._submit(run)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor,
                       drop_read_pages: bool = False) -> SharedWork:
        """Start reducing ``full`` (a buffer of :meth:`new_buffer` whose length the group size
        divides) so that ``shard`` receives this rank's equal piece of the sum. ``full``'s own
        piece holds the sum as well; its other pieces keep their local values. ``drop_read_pages``:
        afterwards unmap this process's pages of the other ranks' pieces it read
        (:func:`drop_resident_pages`; ZeRO-3's staging buffers)."""
        views = self.peer_views(full)
        if full.numel() % self.size:
            raise ValueError(f"reduce-scatter of {full.numel()} elements over {self.size} ranks: "
                             "the length must be a multiple of the group size")
        barrier = self.barrier

        def run():
            barrier.wait()
            out = self._reduce_own_segment(views)
            if shard.data_ptr() != out.data_ptr():
                shard.copy_(out.view(shard.shape))
            if drop_read_pages:  # the other ranks' pieces just read: not this rank's memory
                seg = self._segment(full.numel(), self.rank)
                for k, view in enumerate(views):
                    if k != self.rank:
                        drop_resident_pages(view[seg])
            barrier.wait()
        return self._submit(run)

    def wait_all(self) -> None:
        """Finish every reduction issued so far (before the group is used for anything else)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.wait()
