"""How a restarted replica group fetches a live group's state: safetensors over HTTP(S), no pickle.

torchft's own heal transport streams the state with ``torch.save`` and loads it with
``weights_only=False``: whoever answers a healing group's request runs code in it. This one
carries the same state (:meth:`~meshtrain.training.diloco.replica_ft.ReplicaQuorum.state_dict`,
wrapped by torchft's manager) as **one safetensors file**: every tensor by name, and the rest of
the tree (dicts, lists, numbers, strings) as JSON in the file's metadata, where each tensor is a
``{"tensor": NAME}`` leaf. Reading it parses a length-prefixed JSON header and copies bytes: no
code runs, whatever the peer sends. The receiver also bounds what it reads (``max_bytes``, from
the size of its own state) and :meth:`ReplicaQuorum.load_state_dict` checks every tensor's name,
shape, dtype and finiteness against its own before copying anything.

The server listens on ``bind_host`` (loopback when every group is on this machine) and, with
``server_context``/``client_context`` (``parallel.tls_dir``), speaks HTTPS with a client
certificate required on both sides: a party without a certificate from the run's CA gets no
byte of state.
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import struct
import threading
import urllib.request
from datetime import timedelta

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torchft.checkpointing.transport import CheckpointTransport

TREE_KEY = "meshtrain_heal_tree"
"""The safetensors metadata entry holding the state's tree as JSON."""


def encode_state(state: object) -> bytes:
    """``state`` (nested dicts with string keys, lists and tuples of tensors, numbers, strings,
    booleans and None) as one safetensors file's bytes; ValueError on anything else."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: object) -> object:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().to("cpu").contiguous()
            return {"tensor": name}
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                raise ValueError("heal state: dict keys must be strings")
            return {"dict": {key: walk(item) for key, item in value.items()}}
        if isinstance(value, list | tuple):
            return {"list": [walk(item) for item in value]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"value": value}
        raise ValueError(f"heal state: a {type(value).__name__} cannot be sent (tensors, "
                         "numbers, strings, lists and dicts can)")

    tree = walk(state)
    return save_safetensors(tensors, metadata={TREE_KEY: json.dumps(tree)})


def decode_state(data: bytes) -> object:
    """The state :func:`encode_state` wrote; ValueError when ``data`` is not such a file."""
    if len(data) < 8:
        raise ValueError("heal state: truncated (no safetensors header)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError("heal state: truncated safetensors header")
    try:
        header = json.loads(data[8:8 + header_len])
        tree = json.loads(header["__metadata__"][TREE_KEY])
        tensors = load_safetensors(data)
    except Exception as error:  # malformed JSON, missing keys, bad tensor offsets
        raise ValueError(f"heal state: not a meshtrain heal file ({error})") from None
    used: set[str] = set()

    def build(node: object) -> object:
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError("heal state: malformed tree")
        (kind, value), = node.items()
        if kind == "tensor":
            if value not in tensors or value in used:
                raise ValueError(f"heal state: tensor {value!r} missing or used twice")
            used.add(value)
            return tensors[value]
        if kind == "dict" and isinstance(value, dict):
            return {key: build(item) for key, item in value.items()}
        if kind == "list" and isinstance(value, list):
            return [build(item) for item in value]
        if kind == "value" and (value is None or isinstance(value, bool | int | float | str)):
            return value
        raise ValueError(f"heal state: malformed tree node {kind!r}")

    state = build(tree)
    if used != set(tensors):
        raise ValueError("heal state: tensors that the tree does not name")
    return state


class SafeHeal(CheckpointTransport[dict]):
    """torchft's checkpoint transport (``Manager(checkpoint_transport=...)``), without pickle.

    One HTTP(S) server per rank serves this rank's encoded state while torchft allows it
    (between :meth:`send_checkpoint` and :meth:`disallow_checkpoint`); :meth:`recv_checkpoint`
    fetches the same rank's state from the group torchft names."""

    def __init__(self, bind_host: str, advertise_host: str, max_bytes: int,
                 server_context: ssl.SSLContext | None = None,
                 client_context: ssl.SSLContext | None = None):
        """``bind_host``: the address to listen on (port: any free one); ``advertise_host``:
        the address the other groups reach it at; ``max_bytes``: the most this rank reads from a
        peer; the TLS contexts: HTTPS with client certificates (both or neither)."""
        self.max_bytes = max_bytes
        self.client_context = client_context
        self._ready = threading.Condition()
        self._step: int | None = None
        self._payload: bytes | None = None
        transport = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the http.server name)
                payload = transport._serve_payload(self.path)
                if payload is None:
                    self.send_error(404, "no state at this step")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):  # keep the training log clean
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            daemon_threads = True

            def finish_request(self, request, client_address):
                # The TLS handshake in the connection's own thread, with a deadline: a peer
                # that connects and stays silent holds up nobody else.
                if server_context is not None:
                    request.settimeout(30)
                    try:
                        request = server_context.wrap_socket(request, server_side=True)
                    except (OSError, ssl.SSLError):
                        request.close()
                        return
                super().finish_request(request, client_address)

        self._server = Server((bind_host, 0), Handler)
        self._scheme = "https" if server_context is not None else "http"
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self._address = (f"{self._scheme}://{host}:{self._server.server_address[1]}"
                         "/meshtrain-heal/")
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="meshtrain-heal-server")
        self._thread.start()

    def _serve_payload(self, path: str) -> bytes | None:
        """The encoded state when ``path`` asks for the step being served (waits up to 60 s
        while nothing is served yet: the peer may ask before torchft hands this rank its
        state)."""
        try:
            step = int(path.rstrip("/").rsplit("/", 1)[-1])
        except ValueError:
            return None
        with self._ready:
            self._ready.wait_for(lambda: self._step is not None, timeout=60)
            return self._payload if self._step == step else None

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._server.server_address[1]

    def metadata(self) -> str:
        """The URL prefix a healing group fetches this rank's state from."""
        return self._address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict,
                        timeout: timedelta) -> None:
        """Serve ``state_dict`` (encoded now, so later changes do not leak in) for ``step``."""
        payload = encode_state(state_dict)
        with self._ready:
            self._payload, self._step = payload, step
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving (the state is about to change)."""
        with self._ready:
            self._payload, self._step = None, None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict:
        """Fetch and decode the state a live group serves at ``metadata`` for ``step``; at most
        :attr:`max_bytes` are read."""
        if not metadata.startswith(("http://", "https://")):
            raise ValueError(f"heal: {metadata!r} is not a meshtrain heal address")
        if metadata.startswith("http://") and self.client_context is not None:
            raise ValueError(f"heal: {metadata} is not over TLS, but this group has "
                             "parallel.tls_dir: refusing to fetch state in the clear")
        request = urllib.request.Request(f"{metadata}{int(step)}")
        with urllib.request.urlopen(request, timeout=timeout.total_seconds(),
                                    context=self.client_context) as response:
            length = int(response.headers.get("Content-Length") or -1)
            if length < 0 or length > self.max_bytes:
                raise ValueError(f"heal: the peer offers {length} bytes, more than this "
                                 f"group's own state allows ({self.max_bytes})")
            data = response.read(self.max_bytes + 1)
        if len(data) != length:
            raise ValueError(f"heal: got {len(data)} bytes of the announced {length}")
        return decode_state(data)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
