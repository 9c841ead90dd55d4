"""Where the torchft listeners of a fault-tolerant replica group listen, and how its rank 0
reaches the lighthouse (:mod:`meshtrain.training.diloco.replica_ft`).

A group's rank 0 serves a TCPStore (the group's managers share it; the quorum's primary group's
store is also where every group's ranks set up the cross-group process group) and a torchft
manager server (its own ranks' quorum and commit calls; a healing group asks it where to fetch
state; the lighthouse dashboard's kill button calls it); every rank serves a heal transport (a
healing group's same rank fetches this rank's state from it: meshtrain's own, safetensors over
HTTP(S), :mod:`meshtrain.training.diloco.heal_transport`). torchft 0.2.0 binds its manager server
to every interface (``[::]``), and a TCPStore server listens on every interface whatever host it
is given; both are bound here through a listening socket made first.

:meth:`GroupNetwork.plan` decides, from the lighthouse's address and the group's settings:

- **on this machine** (a loopback lighthouse and a group on one machine): the store, the manager
  server and the heal transport listen on ``127.0.0.1`` and advertise it, and gloo uses the
  loopback interface;
- **across a network** (``parallel.tls_dir`` or ``parallel.insecure_network``, checked by
  :mod:`meshtrain.validation.network`): they advertise ``MESHTRAIN_FT_HOST`` (else the host
  name) and listen on that address when ``MESHTRAIN_FT_HOST`` is set (a WireGuard tunnel's
  address keeps them inside the tunnel, docs/security.md), else on every interface. With
  ``tls_dir`` (which needs ``MESHTRAIN_FT_HOST``, on one machine or across sites) rank 0 reaches
  the lighthouse through a local mutual-TLS forwarder
  (:func:`meshtrain.host.tls_forward.dial_tls`), the heal transport speaks HTTPS with client
  certificates, and the store and the manager server listen on loopback behind mutual-TLS
  fronts on ``MESHTRAIN_FT_HOST``, which the other groups dial through TLS routes
  (:mod:`meshtrain.host.tls_routes`). The group says on stderr what it exposes when it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys

from meshtrain.host.loopback import (
    LOOPBACK,
    is_loopback,
    keep_collectives_on_loopback,
    loopback_store,
    split_address,
)

FT_HOST_ENV = "MESHTRAIN_FT_HOST"
"""The address a group advertises to the others across a network (default: the host name)."""


@dataclasses.dataclass
class GroupNetwork:
    """How one rank of a fault-tolerant group meets the others (module docstring)."""

    local: bool
    """Every listener on loopback (the lighthouse and every group on this machine)."""
    host: str
    """The address this group's store, manager and heal transport advertise."""
    lighthouse: str
    """The lighthouse address to hand torchft (a local TLS forwarder's with ``tls_dir``)."""
    forwarder: object | None = None
    """The running :class:`~meshtrain.host.tls_forward.TlsForwarder` to the lighthouse."""
    bind: str = LOOPBACK
    """Where the store, manager server and heal transport listen: an address, or ``""`` for
    every interface."""
    credentials: object | None = None
    """This site's :class:`~meshtrain.host.credentials.SiteCredentials` (``tls_dir``), else
    None: with them every connection torchft makes between groups runs over mutual TLS
    (:mod:`meshtrain.host.tls_routes`)."""
    served: object | None = None
    """The TLS fronts of this group's store and manager server (with credentials)."""
    routes: object | None = None
    """The TLS routes of this process's connections to other groups (with credentials)."""

    @classmethod
    def plan(cls, lighthouse: str, tls_dir: str, insecure: bool, rank: int, world_size: int,
             announce: bool) -> GroupNetwork:
        """The network of a rank: ``lighthouse`` with its scheme (``http://HOST:PORT``), the
        group's ``parallel.tls_dir``/``insecure_network``, this rank and the group's world;
        ``announce``: say on stderr what listens beyond loopback (the group's logging rank)."""
        host, port = split_address(lighthouse)
        one_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) >= world_size
        local = is_loopback(host) and one_machine and not tls_dir
        if local:
            keep_collectives_on_loopback()
        chosen = os.environ.get(FT_HOST_ENV, "")
        network = cls(local, LOOPBACK if local else chosen or socket.gethostname(), lighthouse,
                      bind=LOOPBACK if local else chosen)
        if tls_dir:
            from meshtrain.host.credentials import SiteCredentials
            from meshtrain.host.tls_routes import ServedOverTls, TlsRoutes

            network.credentials = SiteCredentials.load(tls_dir, "parallel.tls_dir")
            network.served = ServedOverTls(network.bind, network.credentials.server_context())
            network.routes = TlsRoutes(network.credentials.client_context())
            network.routes.install()
        if tls_dir and rank == 0:  # only rank 0's manager server talks to the lighthouse
            from meshtrain.host.tls_forward import dial_tls

            network.forwarder = dial_tls((host, port), network.credentials.client_context(),
                                         name="link to the lighthouse")
            network.lighthouse = f"http://{LOOPBACK}:{network.forwarder.address[1]}"
        if announce and tls_dir:
            print(f"meshtrain: replica group control plane over mutual TLS (parallel.tls_dir): "
                  f"the lighthouse link, and this group's store, torchft manager server and "
                  f"heal transport on {network.bind}; the cross-group gloo connections of the "
                  "outer all-reduce are not encrypted: keep them inside a tunnel between the "
                  "sites (docs/security.md).", file=sys.stderr, flush=True)
        elif announce and not local:
            insecure_note = " (parallel.insecure_network)" if insecure else ""
            where = (f"on {chosen} ({FT_HOST_ENV})" if chosen else
                     f"on every interface (set {FT_HOST_ENV} to a private or WireGuard address "
                     "to keep them there)")
            print(f"meshtrain: WARNING: this replica group reaches the lighthouse {host}:{port} "
                  f"without authentication{insecure_note}; its store, torchft manager server, "
                  f"heal transport and cross-group gloo connections listen {where} without "
                  "authentication: keep them inside a tunnel or firewall between the sites "
                  "(docs/security.md).", file=sys.stderr, flush=True)
        return network

    def store(self, world_size: int):
        """A TCPStore server for the group (rank 0), listening on :attr:`bind` (every interface
        when that is empty); with credentials on loopback, fronted by TLS on :attr:`bind`."""
        if self.served is not None:
            return self.served.store(world_size)
        if self.bind:
            return loopback_store(world_size=world_size, host=self.bind)
        import torch.distributed as dist

        return dist.TCPStore(self.host, 0, world_size, is_master=True, wait_for_workers=False)

    def manager_server(self) -> contextlib.AbstractContextManager:
        """Around the construction of torchft's Manager: its manager server binds :attr:`bind`
        (torchft 0.2.0 binds ``[::]`` and offers no option); with credentials it binds
        loopback, fronted by TLS on :attr:`bind`."""
        if self.served is not None:
            return self.served.manager_server()
        from meshtrain.host.tls_routes import manager_server_bound_to

        return manager_server_bound_to(self.bind) if self.bind else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the forwarders (lighthouse link, TLS fronts and routes) and put torchft's
        names back."""
        for part in (self.forwarder, self.served, self.routes):
            if part is not None:
                part.close()

