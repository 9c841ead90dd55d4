"""The heal transport of fault-tolerant replica groups: state as safetensors + JSON, no pickle.

Round trips of the state tree through a real server on loopback; a peer that sends a pickle, a
truncated or oversized body, or a tree naming tensors that are not there is refused with a
ValueError and nothing runs; a rank with TLS credentials refuses to fetch in the clear.
"""

from __future__ import annotations

import http.server
import pickle
import socket
import ssl
import threading
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")

from meshtrain.training.diloco.heal_transport import SafeHeal, decode_state, encode_state  # noqa: E402

TIMEOUT = timedelta(seconds=10)


def _state() -> dict:
    return {"user": {"default": {
        "phase": "sync", "step": 7, "optimizer_step": 7, "outer_rounds": 3,
        "master": [torch.randn(5), torch.randn(2, 3)],
        "buffers": {"layers.0.freqs": torch.arange(4, dtype=torch.int64)},
        "data_step": 7, "flag": None, "ratio": 0.5, "ok": True}},
        "torchft": {"step": 4, "batches_committed": 0}}


def test_the_state_round_trips_exactly():
    state = _state()
    back = decode_state(encode_state(state))
    user, got = state["user"]["default"], back["user"]["default"]
    assert back["torchft"] == state["torchft"]
    for key in ("phase", "step", "data_step", "flag", "ratio", "ok"):
        assert got[key] == user[key]
    assert all(torch.equal(a, b) for a, b in zip(got["master"], user["master"], strict=True))
    assert torch.equal(got["buffers"]["layers.0.freqs"], user["buffers"]["layers.0.freqs"])
    assert got["buffers"]["layers.0.freqs"].dtype == torch.int64


def test_objects_that_are_not_data_are_not_sent():
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_state({"x": object()})
    with pytest.raises(ValueError, match="keys must be strings"):
        encode_state({1: torch.zeros(1)})


class _Marker:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').close()",))


@pytest.mark.parametrize("body", [
    pickle.dumps(_Marker()),                # what torchft's transport would unpickle
    b"\x08\x00\x00\x00\x00\x00\x00\x00{}",  # a header without the tree
    b"\xff" * 4,                            # truncated
])
def test_what_is_not_a_heal_file_is_refused_and_runs_nothing(body, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="heal state"):
        decode_state(body)
    assert not (tmp_path / "PWNED").exists()


def test_a_tree_naming_a_missing_tensor_is_refused():
    from safetensors.torch import save

    forged = save({"t0": torch.zeros(2)},
                  metadata={"meshtrain_heal_tree": '{"list": [{"tensor": "t9"}]}'})
    with pytest.raises(ValueError, match="missing"):
        decode_state(forged)


def test_serves_on_loopback_and_a_peer_fetches_it():
    server = SafeHeal("127.0.0.1", "127.0.0.1", max_bytes=1 << 20)
    client = SafeHeal("127.0.0.1", "127.0.0.1", max_bytes=1 << 20)
    try:
        assert server.metadata().startswith("http://127.0.0.1:")
        server.send_checkpoint([1], 12, _state(), TIMEOUT)
        got = client.recv_checkpoint(0, server.metadata(), 12, TIMEOUT)
        assert got["user"]["default"]["step"] == 7
        with pytest.raises(urllib.error.HTTPError, match="404"):  # not the step served
            client.recv_checkpoint(0, server.metadata(), 11, timedelta(seconds=2))
        server.disallow_checkpoint()
        small = SafeHeal("127.0.0.1", "127.0.0.1", max_bytes=64)
        try:
            server.send_checkpoint([1], 13, _state(), TIMEOUT)
            with pytest.raises(ValueError, match="more than this group's own state allows"):
                small.recv_checkpoint(0, server.metadata(), 13, TIMEOUT)
        finally:
            small.shutdown()
    finally:
        server.shutdown()
        client.shutdown()


def test_a_hostile_peer_serving_a_pickle_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    body = pickle.dumps(_Marker())

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    client = SafeHeal("127.0.0.1", "127.0.0.1", max_bytes=1 << 20)
    try:
        with pytest.raises(ValueError, match="heal state"):
            client.recv_checkpoint(0, f"http://127.0.0.1:{hostile.server_address[1]}/x/", 3,
                                   TIMEOUT)
    finally:
        hostile.shutdown()
        client.shutdown()
    assert not (tmp_path / "PWNED").exists()


def test_with_credentials_state_is_not_fetched_in_the_clear():
    client = SafeHeal("127.0.0.1", "127.0.0.1", max_bytes=1 << 20,
                      client_context=ssl.create_default_context())
    try:
        with pytest.raises(ValueError, match="not over TLS"):
            client.recv_checkpoint(0, "http://127.0.0.1:1/meshtrain-heal/", 3, TIMEOUT)
    finally:
        client.shutdown()


def test_over_tls_only_a_run_certificate_gets_the_state(tmp_path):
    pytest.importorskip("cryptography")
    from meshtrain.host.credentials import SiteCredentials, make_run_credentials

    site_a, site_b = (SiteCredentials.load(d) for d in make_run_credentials(tmp_path / "run", 2))
    stranger = SiteCredentials.load(make_run_credentials(tmp_path / "other", 1)[0])
    server = SafeHeal("127.0.0.1", "127.0.0.1", 1 << 20, site_a.server_context(),
                      site_a.client_context())
    member = SafeHeal("127.0.0.1", "127.0.0.1", 1 << 20, site_b.server_context(),
                      site_b.client_context())
    outsider = SafeHeal("127.0.0.1", "127.0.0.1", 1 << 20, stranger.server_context(),
                        stranger.client_context())
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
    anonymous = SafeHeal("127.0.0.1", "127.0.0.1", 1 << 20, client_context=no_cert)
    try:
        assert server.metadata().startswith("https://127.0.0.1:")
        silent = socket.create_connection(("127.0.0.1", server.port))  # never says a word
        server.send_checkpoint([1], 5, _state(), TIMEOUT)
        assert member.recv_checkpoint(0, server.metadata(), 5, TIMEOUT)["torchft"]["step"] == 4
        for client in (outsider, anonymous):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                client.recv_checkpoint(0, server.metadata(), 5, TIMEOUT)
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP: nothing
            urllib.request.urlopen(server.metadata().replace("https", "http") + "5", timeout=5)
        silent.close()
    finally:
        for transport in (server, member, outsider, anonymous):
            transport.shutdown()
