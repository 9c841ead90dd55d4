"""What processes listen on, read from Linux's /proc: the TCP sockets in state LISTEN
(/proc/net/tcp, /proc/net/tcp6) whose inodes are among a process's open descriptors
(/proc/PID/fd links ``socket:[INODE]``). For the tests that check that meshtrain opens nothing
to the network unless asked."""

from __future__ import annotations

import ipaddress
import os
import struct
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp writes it


def proc_available() -> bool:
    """True where /proc/net/tcp and /proc/PID/fd can be read (Linux)."""
    return Path("/proc/net/tcp").exists() and Path(f"/proc/{os.getpid()}/fd").is_dir()


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (hex, in host byte order per 32-bit word) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0])
                     for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def listening_table() -> dict[int, tuple[str, int]]:
    """``{socket inode: (address, port)}`` of every listening TCP socket of this namespace."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            hex_address, hex_port = fields[1].split(":")
            table[int(fields[9])] = (_address(hex_address), int(hex_port, 16))
    return table


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open (empty once it is gone)."""
    found = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    tree, index = [pid], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    return tree


def listening(pids: list[int]) -> dict[tuple[str, int], set[int]]:
    """``{(address, port): pids}`` of the listening TCP sockets the processes hold."""
    table = listening_table()
    found: dict[tuple[str, int], set[int]] = {}
    for pid in pids:
        for inode in socket_inodes(pid):
            if inode in table:
                found.setdefault(table[inode], set()).add(pid)
    return found


def is_loopback_address(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (0.0.0.0 and :: are every interface)."""
    return ipaddress.ip_address(address).is_loopback


def environ_of(pid: int) -> dict[str, str]:
    """Process ``pid``'s environment (empty when it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}
