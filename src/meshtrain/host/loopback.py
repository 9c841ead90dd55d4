"""Listening on this machine only: loopback addresses, a loopback-only TCPStore, and whether an
address names this machine.

A ``torch.distributed.TCPStore`` server listens on every interface whatever host it is given
(the host only tells its clients where to connect); handed a socket that is already listening,
it serves that one instead. :func:`loopback_store` does that, so a store that only this
machine's processes need is not reachable from the network.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

LOOPBACK = "127.0.0.1"
"""The address meshtrain's single-machine listeners bind."""

INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The network interface gloo (else: the one the host name resolves to) and NCCL's bootstrap
(else: the first that is not loopback) listen and connect on."""


def split_address(address: str, default_port: int | None = None) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``, ``[V6]:PORT`` or ``scheme://HOST:PORT[/path]``;
    raises ValueError for a malformed one (a missing port is ``default_port`` when given)."""
    text = address.strip()
    if "://" in text:
        text = text.split("://", 1)[1]
    text = text.split("/", 1)[0]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a bare name, or a bare IPv6 address without a port
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ValueError(f"{address!r} has no port (HOST:PORT)")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"{address!r}: {port_text!r} is not a TCP port number")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP address or a name) can only be reached from this machine: a
    loopback address, or a name all of whose addresses are loopback ones (``localhost``). A
    name that does not resolve counts as not loopback."""
    host = host.strip().strip("[]")
    if not host:
        return False  # an empty host means every interface to a server
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def loopback_listener(port: int = 0, host: str = LOOPBACK) -> socket.socket:
    """A TCP socket listening on ``host:port`` (loopback; port 0 = a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_store(port: int = 0, world_size: int | None = None,
                   timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                   multi_tenant: bool = False, wait_for_workers: bool = False,
                   host: str = LOOPBACK):
    """A ``torch.distributed.TCPStore`` server listening on ``host:port`` only (default
    ``127.0.0.1``; port 0 = a free one; the store's ``port`` says which). Raises OSError when
    the port is taken."""
    import torch.distributed as dist

    sock = loopback_listener(port, host)
    bound = sock.getsockname()[1]
    # the store owns the descriptor from here on (it closes it when it shuts down)
    return dist.TCPStore(host, bound, world_size, True, timeout,
                         wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                         master_listen_fd=sock.detach())


def keep_collectives_on_loopback(environ: dict | None = None) -> list[str]:
    """Make gloo and NCCL listen and connect on the loopback interface (``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` = ``lo``), each unless the user chose an interface; returns the
    variables it set. For processes that all run on this machine: otherwise gloo listens on the
    address the host name resolves to, and NCCL's bootstrap on the first non-loopback interface,
    often reachable from the network. (NCCL moves a single machine's data over NVLink, PCIe or
    shared memory; its sockets only bootstrap.)"""
    environ = os.environ if environ is None else environ
    chosen = []
    for name in INTERFACE_ENVS:
        if not environ.get(name):
            environ[name] = loopback_interface()
            chosen.append(name)
    return chosen


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    try:
        for _, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo0"):
                return name
    except OSError:
        pass
    return "lo"
