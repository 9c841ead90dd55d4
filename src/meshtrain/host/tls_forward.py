"""A TCP forwarder that adds or removes mutual TLS, for servers and clients that speak plain TCP.

torchft's lighthouse and manager speak plain gRPC/HTTP and cannot be given certificates. So a
server of theirs listens on loopback, and a :class:`TlsForwarder` in front of it listens on the
public address, completes a TLS handshake that requires a client certificate signed by the run's
CA, and only then opens a connection to the real server and relays bytes both ways
(:func:`serve_tls`). On the other side a client's forwarder listens on ``127.0.0.1``, and for
every plain connection torchft makes to it, dials the remote over TLS with this site's
certificate, verifying the server's against the run CA (:func:`dial_tls`). A peer without a
certificate from the run CA (plain TCP, TLS without a certificate, a certificate of another CA)
fails the handshake and is disconnected before a byte reaches the real server; each refusal is
counted in :attr:`TlsForwarder.refused` and logged as a warning on the ``meshtrain.tls`` logger
(stderr by default; at most one line per :data:`LOG_EVERY_S`).

Each forwarder runs an asyncio loop in a daemon thread of its own; TLS is Python's ``ssl``
(contexts from :class:`meshtrain.host.credentials.SiteCredentials`: TLS 1.2+, certificates
required on both sides).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time

logger = logging.getLogger("meshtrain.tls")

HANDSHAKE_TIMEOUT_S = 10.0
"""Longest a peer may take to complete the TLS handshake before it is disconnected."""

CONNECT_TIMEOUT_S = 30.0
"""Longest the forwarder waits to reach its target (and to complete the TLS handshake there)."""

LOG_EVERY_S = 10.0
"""Refusals are logged at most once per this many seconds (each one is counted)."""

_CHUNK = 1 << 16

_RELAY_ERRORS = (ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError)


class TlsForwarder:
    """Relay every connection accepted on ``listen`` to ``target``, byte for byte.

    ``accept``: a server-side TLS context that each accepted connection must complete a handshake
    with (None: plain TCP accepted); ``dial``: a client-side TLS context to connect to the target
    with (None: plain TCP). ``listen`` host ``""`` or ``"::"`` means every interface (IPv4 and
    IPv6), port 0 any free port (:attr:`address` says which). Use as a context manager, or
    :meth:`start` and :meth:`close`.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *,
                 accept: ssl.SSLContext | None = None, dial: ssl.SSLContext | None = None,
                 name: str = "forwarder"):
        self.listen, self.target = listen, target
        self.accept, self.dial, self.name = accept, dial, name
        self.address: tuple[str, int] = ("", 0)
        """Where it listens (after :meth:`start`): the first listening socket's host and port."""
        self.refused = 0
        """Connections turned away: failed TLS handshakes (on either side) and unreachable
        targets."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TlsForwarder:
        """Start listening (raises OSError when the address cannot be bound); returns self."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name=f"meshtrain-{self.name}")
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def close(self) -> None:
        """Stop listening and drop every relayed connection (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    def __enter__(self) -> TlsForwarder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        host = self.listen[0].strip("[]") or None
        if host == "::":
            host = None  # every interface, both families (asyncio makes "::" IPv6-only)
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._connected, host, self.listen[1], reuse_address=True, backlog=1024))
            self.address = tuple(self._server.sockets[0].getsockname()[:2])
        except BaseException as error:  # noqa: BLE001 - handed to start()
            self._error = error
            loop.close()
            ready.set()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*self._connections, return_exceptions=True))
            loop.close()

    # ------------------------------------------------------------------ connections
    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        upstream: asyncio.StreamWriter | None = None
        try:
            if self.accept is not None:
                try:
                    await writer.start_tls(self.accept, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
                except (*_RELAY_ERRORS, TimeoutError) as error:
                    self._refuse(peer, f"TLS handshake failed: {_reason(error)}")
                    return
            try:
                target_reader, upstream = await asyncio.wait_for(asyncio.open_connection(
                    self.target[0], self.target[1], ssl=self.dial,
                    server_hostname=self.target[0] if self.dial is not None else None,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.dial is not None
                    else None), CONNECT_TIMEOUT_S)
            except (*_RELAY_ERRORS, TimeoutError) as error:
                self._refuse(peer, f"cannot reach {self.target[0]}:{self.target[1]}: "
                                   f"{_reason(error)}")
                return
            await asyncio.gather(_pump(reader, upstream), _pump(target_reader, writer))
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    stream.close()
            self._connections.discard(task)

    def _refuse(self, peer, reason: str) -> None:
        """Count a refusal and log it: at most one line per :data:`LOG_EVERY_S`, which says
        how many were not logged since (a client retrying in a loop does not flood stderr)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        logger.warning("meshtrain %s: turned away a connection from %s: %s%s", self.name,
                       _peer_text(peer), reason, more)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy ``source`` to ``sink`` until either ends; then end ``sink`` too: half-close it where
    the transport allows (plain TCP), else close it (asyncio's TLS cannot half-close, so a plain
    client that half-closes towards a TLS hop loses the answer; gRPC, HTTP and torch's store
    clients never do)."""
    try:
        while data := await source.read(_CHUNK):
            sink.write(data)
            await sink.drain()
    except _RELAY_ERRORS:
        pass
    finally:
        try:
            if sink.can_write_eof() and not sink.is_closing():
                sink.write_eof()
            else:
                sink.close()
        except _RELAY_ERRORS:
            sink.close()


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    return getattr(error, "reason", None) or str(error) or type(error).__name__


def _peer_text(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else peer[0]
        return f"{host}:{peer[1]}"
    return str(peer)


def serve_tls(listen: tuple[str, int], target: tuple[str, int],
              server_context: ssl.SSLContext, name: str = "TLS server") -> TlsForwarder:
    """A started forwarder: mutual TLS on ``listen`` (public), plain TCP to ``target`` (a
    server on loopback)."""
    return TlsForwarder(listen, target, accept=server_context, name=name).start()


def dial_tls(remote: tuple[str, int], client_context: ssl.SSLContext,
             listen: tuple[str, int] = ("127.0.0.1", 0), name: str = "TLS client"
             ) -> TlsForwarder:
    """A started forwarder: plain TCP on ``listen`` (loopback), mutual TLS to ``remote``."""
    return TlsForwarder(listen, remote, dial=client_context, name=name).start()
