"""Listening on this machine only (meshtrain.host.loopback, meshtrain.host.ft_network) and the
refusal of a multi-site run without credentials (meshtrain.validation.network).

Checked through /proc: a loopback store, torchft's heal transport and manager server as
meshtrain builds them listen on 127.0.0.1 and nowhere else, while torch's and torchft's own
defaults (what they replace) listen on every interface; the heal transport still serves a
state on loopback; and a group's plan is loopback for a loopback lighthouse, and otherwise
reaches the lighthouse through a TLS forwarder when given a site directory.
"""

from __future__ import annotations

import datetime
import importlib.util
import os

import pytest

from meshtrain.config import ConfigError, load_config
from meshtrain.host import loopback
from meshtrain.validation.network import lighthouse_is_local, validate_network_exposure
from tests.listening import listening, proc_available

needs_proc = pytest.mark.skipif(not proc_available(), reason="needs Linux /proc")
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed")


def _mine() -> dict[tuple[str, int], set[int]]:
    return listening([os.getpid()])


def _where(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    return {address for address, bound in _mine() if bound == port}


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:29510", ("127.0.0.1", 29510)),
    ("http://lh-host:29510", ("lh-host", 29510)),
    ("https://[::1]:80/status", ("::1", 80)),
    ("[::]:0", ("::", 0)),
    ("0.0.0.0:7", ("0.0.0.0", 7)),
])
def test_split_address(text, expected):
    assert loopback.split_address(text) == expected


@pytest.mark.parametrize("text", ["lh-host", "host:port", "host:70000"])
def test_split_address_refuses_a_malformed_one(text):
    with pytest.raises(ValueError):
        loopback.split_address(text)
    assert loopback.split_address("lh-host", default_port=1) == ("lh-host", 1)


@pytest.mark.parametrize(("host", "local"), [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("203.0.113.7", False), ("fd00::2", False), ("no-such-host.invalid", False),
])
def test_is_loopback(host, local):
    assert loopback.is_loopback(host) is local


def test_collectives_interfaces_are_set_only_where_the_user_set_none():
    environ = {}
    assert loopback.keep_collectives_on_loopback(environ) == ["GLOO_SOCKET_IFNAME",
                                                              "NCCL_SOCKET_IFNAME"]
    assert environ == dict.fromkeys(["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"],
                                    loopback.loopback_interface())
    mine = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert loopback.keep_collectives_on_loopback(mine) == ["NCCL_SOCKET_IFNAME"]
    assert mine["GLOO_SOCKET_IFNAME"] == "eth7"


@needs_proc
def test_a_loopback_store_listens_on_loopback_only_where_torchs_does_not():
    import torch.distributed as dist

    store = loopback.loopback_store(world_size=1)
    store.set("key", "value")
    client = dist.TCPStore(loopback.LOOPBACK, store.port, 1, False,
                           datetime.timedelta(seconds=30), wait_for_workers=False)
    assert client.get("key") == b"value"
    assert _where(store.port) == {"127.0.0.1"}
    # what it replaces: torch's server given 127.0.0.1 listens on every interface
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert _where(plain.port) & {"::", "0.0.0.0"}


# ---------------------------------------------------------------- torchft's listeners


@needs_proc
@needs_torchft
def test_the_heal_transport_serves_a_state_on_loopback_only():
    import torch

    from meshtrain.training.diloco.heal_transport import SafeHeal

    timeout = datetime.timedelta(seconds=30)
    sender = SafeHeal(loopback.LOOPBACK, loopback.LOOPBACK, max_bytes=1 << 20)
    receiver = SafeHeal(loopback.LOOPBACK, loopback.LOOPBACK, max_bytes=1 << 20)
    try:
        assert sender.metadata() == f"http://127.0.0.1:{sender.port}/meshtrain-heal/"
        assert _where(sender.port) == {"127.0.0.1"}
        state = {"w": torch.arange(6.0), "step": 3}
        sender.send_checkpoint([1], step=3, state_dict=state, timeout=timeout)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timeout)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    finally:
        sender.shutdown(wait=True)
        receiver.shutdown(wait=True)


@needs_proc
def test_a_store_bound_to_an_address_listens_there_only():
    store = loopback.loopback_store(world_size=1, host="127.0.0.1")
    assert _where(store.port) == {"127.0.0.1"}


@needs_proc
@needs_torchft
def test_the_manager_server_binds_where_told_and_the_default_is_restored():
    import torchft.manager as manager_module
    from torchft._torchft import LighthouseServer

    from meshtrain.host.tls_routes import manager_server_bound_to

    real = manager_module.ManagerServer
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        with manager_server_bound_to("127.0.0.1"):
            assert manager_module.ManagerServer is not real
            server = manager_module.ManagerServer(
                replica_id="probe", lighthouse_addr=lighthouse.address(), hostname="127.0.0.1",
                bind="[::]:0", store_addr="127.0.0.1:1", world_size=1,
                heartbeat_interval=datetime.timedelta(milliseconds=100),
                connect_timeout=datetime.timedelta(seconds=10), quorum_retries=0)
        port = int(server.address().rsplit(":", 1)[1])
        assert _where(port) == {"127.0.0.1"}
        server.shutdown()
    finally:
        lighthouse.shutdown()
    assert manager_module.ManagerServer is real


def test_a_groups_plan_follows_the_lighthouse(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    from meshtrain.host.credentials import make_run_credentials
    from meshtrain.host.ft_network import GroupNetwork

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    local = GroupNetwork.plan("http://127.0.0.1:29510", "", False, 0, 1, announce=False)
    assert (local.local, local.host, local.lighthouse) == (True, "127.0.0.1",
                                                           "http://127.0.0.1:29510")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback.loopback_interface()

    monkeypatch.setenv("MESHTRAIN_FT_HOST", "site-a.example")
    far = GroupNetwork.plan("http://203.0.113.7:29510", "", True, 0, 1, announce=False)
    assert (far.local, far.host, far.forwarder) == (False, "site-a.example", None)
    assert far.bind == "site-a.example" and far.credentials is None  # listens there only
    monkeypatch.delenv("MESHTRAIN_FT_HOST")
    anywhere = GroupNetwork.plan("http://203.0.113.7:29510", "", True, 0, 1, announce=False)
    assert anywhere.bind == ""  # no address chosen: every interface, with a warning
    monkeypatch.setenv("MESHTRAIN_FT_HOST", "site-a.example")

    site = make_run_credentials(tmp_path / "keys", sites=1)[0]
    tls = GroupNetwork.plan("http://203.0.113.7:29510", str(site), False, 0, 1, announce=True)
    try:
        port = tls.forwarder.address[1]
        assert tls.lighthouse == f"http://127.0.0.1:{port}" and tls.forwarder.address[0] == \
            "127.0.0.1"
        assert tls.forwarder.target == ("203.0.113.7", 29510)
    finally:
        tls.close()
    # rank 1 never talks to the lighthouse: no forwarder; its servers sit behind TLS fronts
    # and its connections to other groups go through TLS routes
    import torchft.manager as manager_module

    real = manager_module.ManagerClient
    rank1 = GroupNetwork.plan("http://203.0.113.7:29510", str(site), False, 1, 2,
                              announce=False)
    try:
        assert rank1.forwarder is None and not rank1.local
        assert rank1.served is not None and manager_module.ManagerClient is not real
    finally:
        rank1.close()
    assert manager_module.ManagerClient is real
    # a group spread over machines cannot keep its store on loopback
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not GroupNetwork.plan("http://127.0.0.1:1", "", False, 0, 4, announce=False).local


# ---------------------------------------------------------------- validation


FT = {"parallel": {"replica_fault_tolerance": True, "replicas": 2}}


def _config(**parallel):
    return load_config(None, [f"parallel.{k}={v}" for k, v in
                              {**FT["parallel"], **parallel}.items()])


@pytest.mark.parametrize(("address", "local"), [
    ("127.0.0.1:29510", True), ("http://localhost:1", True), ("http://[::1]:1", True),
    ("203.0.113.7:29510", False), ("http://lh-host.invalid:29510", False), ("", False),
])
def test_lighthouse_is_local(address, local):
    assert lighthouse_is_local(address) is local


def test_a_far_lighthouse_needs_credentials_or_insecure_network(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    from meshtrain.host.credentials import make_run_credentials

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    validate_network_exposure(_config(lighthouse="127.0.0.1:29510"))
    with pytest.raises(ConfigError) as refused:
        validate_network_exposure(_config(lighthouse="203.0.113.7:29510"))
    assert "parallel.tls_dir" in str(refused.value)
    assert "parallel.insecure_network = true" in str(refused.value)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "203.0.113.7:29510")  # the variable counts too
    with pytest.raises(ConfigError):
        validate_network_exposure(_config(lighthouse=""))
    validate_network_exposure(_config(lighthouse="203.0.113.7:1", insecure_network="true"))
    site = make_run_credentials(tmp_path / "keys", sites=1)[0]
    monkeypatch.delenv("MESHTRAIN_FT_HOST", raising=False)
    with pytest.raises(ConfigError, match="MESHTRAIN_FT_HOST"):  # where store and manager go
        validate_network_exposure(_config(lighthouse="203.0.113.7:1", tls_dir=str(site)))
    monkeypatch.setenv("MESHTRAIN_FT_HOST", "10.77.0.2")
    validate_network_exposure(_config(lighthouse="203.0.113.7:1", tls_dir=str(site)))
    with pytest.raises(ConfigError, match="lacks"):
        validate_network_exposure(_config(lighthouse="203.0.113.7:1",
                                          tls_dir=str(tmp_path / "keys")))
