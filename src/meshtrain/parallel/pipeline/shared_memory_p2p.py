"""Pipeline activations and gradients through shared memory between the ranks of one host.

Through gloo, a pipeline message crosses loopback TCP on gloo's threads, and a send completes
only once the receiver has posted its receive: both processes' gloo threads must get the CPU
while their main threads compute. On a CPU whose cores all run compute, the last stage of a
two-stage 1F1B step then starts its forwards and backwards 2-18 ms (median 6) late in all, after
the tensors they need were computed (``docs/performance.md``). When every rank of a pipeline
group runs on this host, :class:`SharedMemoryP2P` moves each message without any help from the
receiver's or the sender's other threads:

1. **send**: the sender copies its tensor into one of its own slots (a ``memfd`` of at least the
   message's size, reused once released) and writes a ``data`` record (sequence number, tag, the
   slot's descriptor and size) into the receiver's pipe. The send is then complete: it never
   waits for the receiver (a buffered send, as gloo's tagged sends are).
2. **receive**: when the receiver needs the message it reads its pipe until that record is there,
   copies the slot (mapped through ``/proc/<pid>/fd/<fd>``) into its own tensor and writes a
   ``release`` record back; the sender reuses the slot once it has read that record (at its next
   send), so a slot is never overwritten before it was read.

Only the two main threads act, each when it would anyway. Messages between a pair of ranks are
matched in the order they were posted (a sequence number per direction), as NCCL matches them;
with tags (the default point-to-point semantics, :mod:`.p2p`) a message whose tag differs from its
receive's fails with both named, instead of handing over the wrong tensor. Records are fixed-size
writes under ``PIPE_BUF``, so the kernel keeps them whole, and the pipe's system calls order the
copies between the two processes. A peer that died fails the receive at once (its pipe closed)
or at the next write to it; one that never sends fails it after ``timeout_s``, naming it. The
sender holds each message until it is released: as many slots as messages in flight to each peer.
"""

from __future__ import annotations

import os
import select
import struct
import time
import weakref
from collections import Counter

import torch

from meshtrain.parallel.shared_memory import (
    DEFAULT_TIMEOUT_S,
    close_all,
    open_host_pipes,
    peer_path,
)

_RECORD = struct.Struct("<8q")  # kind, sender, seq, tag, pid, fd, capacity, nbytes
_DATA, _RELEASE = 1, 2


class P2PTransferError(RuntimeError):
    """A pipeline message could not be delivered (peer gone, mismatched message, timeout)."""


class _Slot:
    """A send buffer in this process's shared memory."""

    __slots__ = ("fd", "capacity", "bytes", "busy")

    def __init__(self, capacity: int):
        self.fd = os.memfd_create("meshtrain-p2p", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.capacity, self.busy = capacity, False
        self.bytes = torch.from_file(peer_path(os.getpid(), self.fd), shared=True,
                                     size=capacity, dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _Done:
    """The work handle of a send: complete once posted."""

    __slots__ = ()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    """The work handle of a receive: ``wait`` copies the message into the tensor."""

    __slots__ = ("link", "buf", "peer", "seq", "tag", "done")

    def __init__(self, link: _Link, buf: torch.Tensor, peer: int, seq: int, tag: int):
        self.link, self.buf, self.peer, self.seq, self.tag = link, buf, peer, seq, tag
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.link.receive(self)
            self.done = True
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.link.read_records(block=False)
        return self.done or (self.peer, self.seq) in self.link.inbox


class _Link:
    """One rank's side of the group's pipes and slots (see :class:`SharedMemoryP2P`)."""

    def __init__(self, read_fd: int, to_peer: dict[int, int], rank: int,
                 global_ranks: list[int], timeout_s: float):
        self.read_fd, self.to_peer, self.rank = read_fd, to_peer, rank
        self.global_ranks, self.timeout_s = global_ranks, timeout_s
        self.sent: Counter = Counter()      # axis peer -> messages sent to it
        self.received: Counter = Counter()  # axis peer -> receives posted from it
        self.inbox: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}
        """(peer, seq) -> (tag, pid, fd, capacity, nbytes) of a message waiting in its slot."""
        self.slots: dict[int, _Slot] = {}  # by descriptor
        self.mapped: dict[tuple[int, int], torch.Tensor] = {}  # a peer's slot, by (pid, fd)
        self._partial = b""
        self._closed = False  # every peer's end of this rank's pipe is closed
        self.poller = select.poll()
        self.poller.register(read_fd, select.POLLIN)

    def close(self) -> None:
        close_all([self.read_fd, *self.to_peer.values(), *self.slots])

    def _name(self, peer: int) -> str:
        return f"rank {self.global_ranks[peer]}"

    def _write(self, peer: int, *fields: int) -> None:
        try:
            os.write(self.to_peer[peer], _RECORD.pack(*fields))
        except OSError as error:  # BrokenPipeError: the peer's read end is closed
            raise P2PTransferError(f"pipeline message to {self._name(peer)}: connection closed "
                                   f"(the process exited): {error}") from None

    def read_records(self, block: bool, timeout_s: float = 0.0) -> None:
        """Take the records in this rank's pipe: messages into :attr:`inbox`, releases free
        their slots. ``block``: wait up to ``timeout_s`` for at least one."""
        while not self._closed:
            if not self.poller.poll(max(int(timeout_s * 1000), 1) if block else 0):
                return
            data = os.read(self.read_fd, 64 * _RECORD.size)
            if not data:  # every writer closed: the other ranks are gone
                self._closed = True
                return
            data = self._partial + data
            cut = len(data) // _RECORD.size * _RECORD.size
            data, self._partial = data[:cut], data[cut:]
            for offset in range(0, len(data), _RECORD.size):
                kind, sender, seq, tag, pid, fd, capacity, nbytes = _RECORD.unpack_from(data,
                                                                                       offset)
                if kind == _DATA:
                    self.inbox[(sender, seq)] = (tag, pid, fd, capacity, nbytes)
                elif fd in self.slots:  # _RELEASE of this rank's slot ``fd``
                    self.slots[fd].busy = False
            block = False  # then take whatever else is already there

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        """Copy ``tensor`` into a free slot and tell ``peer``; complete at once."""
        nbytes = tensor.numel() * tensor.element_size()
        self.read_records(block=False)  # releases of earlier messages
        free = [s for s in self.slots.values() if not s.busy and s.capacity >= nbytes]
        slot = min(free, key=lambda s: s.capacity) if free else None
        if slot is None:
            slot = _Slot(max(nbytes, 1))
            self.slots[slot.fd] = slot
        slot.bytes[:nbytes].copy_(_as_bytes(tensor))
        slot.busy = True
        seq = self.sent[peer]
        self.sent[peer] += 1
        self._write(peer, _DATA, self.rank, seq, tag, os.getpid(), slot.fd, slot.capacity,
                    nbytes)
        return _Done()

    def post_receive(self, buf: torch.Tensor, peer: int, tag: int) -> _Receive:
        if not buf.is_contiguous():
            raise ValueError("a pipeline receive needs a contiguous tensor")
        seq = self.received[peer]
        self.received[peer] += 1
        return _Receive(self, buf, peer, seq, tag)

    def receive(self, handle: _Receive) -> None:
        """Wait for ``handle``'s message, copy it into its tensor and release the slot."""
        key = (handle.peer, handle.seq)
        what = f"pipeline message #{handle.seq + 1} from {self._name(handle.peer)}"
        deadline = time.monotonic() + self.timeout_s
        while key not in self.inbox:
            remaining = deadline - time.monotonic()
            if self._closed:
                raise P2PTransferError(f"{what}: connection closed (the process exited)")
            if remaining <= 0:
                raise P2PTransferError(f"{what} did not arrive within {self.timeout_s:g} s "
                                       "(train.collective_timeout_s)")
            self.read_records(block=True, timeout_s=remaining)
        tag, pid, fd, capacity, nbytes = self.inbox.pop(key)
        want = handle.buf.numel() * handle.buf.element_size()
        if tag != handle.tag:
            raise P2PTransferError(f"{what} has tag {tag}, but this rank's receive #"
                                   f"{handle.seq + 1} from it has tag {handle.tag}: the two ranks "
                                   "post their messages in different orders")
        if nbytes != want:
            raise P2PTransferError(f"{what} is {nbytes} bytes; this rank's receive expects {want}")
        source = self.mapped.get((pid, fd))
        if source is None:
            try:
                source = torch.from_file(peer_path(pid, fd), shared=True, size=capacity,
                                         dtype=torch.uint8)
            except RuntimeError as error:  # its slot went with the process
                raise P2PTransferError(f"{what}: the sender's buffer is gone (the process "
                                       f"exited): {error}") from None
            self.mapped[(pid, fd)] = source
        _as_bytes(handle.buf).copy_(source[:nbytes])
        try:  # the message is in; a sender that has closed its end needs no release
            os.write(self.to_peer[handle.peer],
                     _RECORD.pack(_RELEASE, self.rank, handle.seq, tag, pid, fd, capacity, nbytes))
        except OSError:
            pass


class SharedMemoryP2P:
    """Point-to-point messages of one pipeline group through shared memory (module doc).

    Create it with :meth:`connect` (collective on the group); the
    :class:`~meshtrain.parallel.comm.CountedComm` it is attached to then posts its exchanges
    through :meth:`post`, counting them as usual."""

    def __init__(self, read_fd: int, to_peer: dict[int, int], rank: int,
                 global_ranks: list[int], timeout_s: float):
        self._link = _Link(read_fd, to_peer, rank, global_ranks, timeout_s)
        self.close = weakref.finalize(self, self._link.close)
        """Close this rank's pipe ends and slots now (they close with the object otherwise)."""

    @classmethod
    def connect(cls, comm, timeout_s: float) -> SharedMemoryP2P | None:
        """Attach a transport to ``comm`` when every rank of its group shares this host's memory;
        return it, or None (``comm`` keeps gloo). Collective on the group."""
        import torch.distributed as dist

        if not comm.active or dist.get_backend(comm.group) != "gloo":
            return None
        pipes = open_host_pipes(comm)
        if pipes is None:
            return None
        transport = cls(*pipes, timeout_s)
        comm.shared_p2p = transport
        return transport

    def post(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> list:
        """Post ``("send" | "recv", tensor, axis rank of the peer, tag)`` ops; returns one work
        handle per op, in order. Sends are complete on return; a receive's ``wait`` fills its
        tensor."""
        return [self._link.send(tensor, peer, tag) if op == "send"
                else self._link.post_receive(tensor, peer, tag)
                for op, tensor, peer, tag in ops]


def connect_transport(comm, requested: bool, timeout_s: float | None) -> None:
    """Attach a :class:`SharedMemoryP2P` to the ``pp`` comm when ``requested``
    (``parallel.pp_shared_memory`` on a CPU run) and the group's ranks share this host; once per
    comm (collective on its group). ``timeout_s``: the mesh's collective timeout (None: 30
    minutes)."""
    if requested and comm.shared_p2p is None:
        SharedMemoryP2P.connect(comm, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)


def transport_summary(comm, requested: bool, device: torch.device) -> str | None:
    """One line for the run's log on how a CPU pipeline's messages travel, and why not through
    shared memory when they do not; None without pipeline parallelism or off CPU."""
    if not comm.active or device.type != "cpu":
        return None
    if comm.shared_p2p is not None:
        return f"pipeline messages go through shared memory ({comm.size} ranks on one host)"
    reason = ("parallel.pp_shared_memory = false" if not requested else
              "the ranks cannot map each other's memory: several hosts, or no /proc access")
    return f"pipeline messages go through gloo ({reason})"
