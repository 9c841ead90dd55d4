"""torchft's connections between replica groups, over mutual TLS (``parallel.tls_dir``).

torchft dials other groups' servers itself, in plain TCP, at the addresses they advertise: a
group's torchft manager server (a healing group asks the live group's for where to fetch state;
each group's own ranks ask their rank 0's for quorums and commits) and its TCPStore (the store
of the quorum's primary group is where every group's ranks meet to set up the cross-group
process group). With credentials each such server listens on loopback only, and a
:func:`~meshtrain.host.tls_forward.serve_tls` forwarder on the group's advertised address
(``MESHTRAIN_FT_HOST``, same port) admits only parties with a certificate from the run's CA
(:meth:`ServedOverTls.manager_server`, :meth:`ServedOverTls.store`). On the dialling side
:meth:`TlsRoutes.install` replaces the names torchft dials with (``ManagerClient`` and
``TCPStore`` in ``torchft.manager``, ``TCPStore`` in ``torchft.process_group``) by ones that
connect through a local :func:`~meshtrain.host.tls_forward.dial_tls` forwarder per remote
address, started on first use. gloo's own connections between groups are not covered (torch
cannot encrypt them: docs/security.md).
"""

from __future__ import annotations

import contextlib
import threading

from meshtrain.host.loopback import LOOPBACK, loopback_store, split_address


class TlsRoutes:
    """Local forwarders that carry torchft's plain connections to other groups over mutual
    TLS, one per remote address (``client_context``: this site's, from
    :class:`~meshtrain.host.credentials.SiteCredentials`)."""

    def __init__(self, client_context):
        self.context = client_context
        self._forwarders: dict[tuple[str, int], object] = {}
        self._lock = threading.Lock()
        self._undo: list = []

    def local_port(self, host: str, port: int) -> int:
        """The loopback port of the forwarder to ``host:port`` (started on first use)."""
        from meshtrain.host.tls_forward import dial_tls

        with self._lock:
            forwarder = self._forwarders.get((host, port))
            if forwarder is None:
                forwarder = dial_tls((host, port), self.context, name=f"link to {host}:{port}")
                self._forwarders[(host, port)] = forwarder
            return forwarder.address[1]

    def install(self) -> None:
        """Route torchft's manager clients and store clients through :meth:`local_port` (for
        this process, until :meth:`close`)."""
        import torchft.manager as manager_module
        import torchft.process_group as process_group_module

        real_client, real_store = manager_module.ManagerClient, manager_module.TCPStore
        routes = self

        def manager_client(address: str, *args, **kwargs):
            host, port = split_address(address)
            return real_client(f"http://{LOOPBACK}:{routes.local_port(host, port)}", *args,
                               **kwargs)

        def store_client(host_name: str, port: int, *args, is_master: bool = False, **kwargs):
            if not is_master:
                host_name, port = LOOPBACK, routes.local_port(host_name, int(port))
            return real_store(host_name, port, *args, is_master=is_master, **kwargs)

        for module, name, value in ((manager_module, "ManagerClient", manager_client),
                                    (manager_module, "TCPStore", store_client),
                                    (process_group_module, "TCPStore", store_client)):
            self._undo.append((module, name, getattr(module, name)))
            setattr(module, name, value)

    def close(self) -> None:
        """Put torchft's names back and stop the forwarders."""
        for module, name, value in reversed(self._undo):
            setattr(module, name, value)
        self._undo.clear()
        with self._lock:
            for forwarder in self._forwarders.values():
                forwarder.close()
            self._forwarders.clear()


class ServedOverTls:
    """A group's servers that torchft dials, each on loopback behind a mutual-TLS forwarder on
    ``public`` (the advertised address), same port (``server_context``: this site's)."""

    def __init__(self, public: str, server_context):
        self.public, self.context = public, server_context
        self.forwarders: list = []

    def _front(self, port: int, what: str) -> None:
        from meshtrain.host.tls_forward import serve_tls

        self.forwarders.append(serve_tls((self.public, port), (LOOPBACK, port), self.context,
                                         name=what))

    def store(self, world_size: int):
        """The group's TCPStore server on loopback, fronted on ``public`` at the same port."""
        store = loopback_store(world_size=world_size)
        self._front(store.port, "the group's store")
        return store

    def manager_server(self):
        """While inside, torchft's Manager creates its manager server on loopback and a TLS
        forwarder fronts it on ``public`` at the same port (the address torchft advertises)."""
        return manager_server_bound_to(LOOPBACK, lambda server: self._front(
            split_address(server.address())[1], "the torchft manager server"))

    def close(self) -> None:
        """Stop the forwarders."""
        for forwarder in self.forwarders:
            forwarder.close()
        self.forwarders.clear()


@contextlib.contextmanager
def manager_server_bound_to(host: str, on_created=None):
    """While inside, torchft's Manager creates its manager server on ``host`` (same port);
    ``on_created(server)`` runs on each server made (e.g. to front it with TLS)."""
    import torchft.manager as manager_module

    real = manager_module.ManagerServer

    def bound(**kwargs):
        kwargs["bind"] = f"{host}:{split_address(kwargs['bind'])[1]}"
        server = real(**kwargs)
        if on_created is not None:
            on_created(server)
        return server

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = real
