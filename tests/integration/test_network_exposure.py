"""Nothing of meshtrain's is open to the network unless asked; across a network, mutual TLS.

Real processes, their listening sockets read from /proc (tests/listening.py):

- ``meshtrain lighthouse`` with no ``--bind`` listens on 127.0.0.1:29510 and nowhere else;
- ``--bind 0.0.0.0:0`` without ``--tls-dir`` or ``--insecure`` exits 2 naming both; with
  ``--insecure`` it listens there and warns on stderr; with ``--tls-dir`` only the TLS forwarder
  listens beyond loopback (torchft's server is on an ephemeral loopback port), and a plain HTTP
  GET of the status page, a plain POST of the kill button, TLS without a certificate and TLS
  with another CA's certificate get no byte back, while TLS with a certificate of the run's CA
  gets the status page;
- ``meshtrain keys new`` writes private files and refuses to overwrite;
- a local ``meshtrain train --nproc 2``, sampled while its workers are held at step 3 (the
  test-only ``hold`` fault), listens on loopback only (the launcher's store, the workers' gloo)
  and its workers have ``GLOO_SOCKET_IFNAME=lo`` and ``NCCL_SOCKET_IFNAME=lo``;
- a replica group whose lighthouse is on another machine is refused with exit 2 before any
  worker starts, unless ``parallel.tls_dir`` or ``parallel.insecure_network`` is set;
- two fault-tolerant groups on this machine, each reaching a ``--tls-dir`` lighthouse through
  its TLS forwarder, finish with identical weights (their syncs worked) while every listener of
  theirs (store, manager server, heal transport, gloo) is on loopback.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain import faults
from tests.integration.test_cli import TINY, meshtrain_many
from tests.listening import (
    environ_of,
    is_loopback_address,
    listening,
    proc_available,
    process_tree,
)

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None
pytestmark = pytest.mark.skipif(not proc_available(), reason="needs Linux /proc")
needs_ft = pytest.mark.skipif(not (HAS_TORCHFT and HAS_CRYPTOGRAPHY),
                              reason="needs torchft and cryptography (pip install -e '.[dev]')")
FAR = "203.0.113.7:29510"  # TEST-NET-3: an address of another machine, never this one's
FT = ["--set", "parallel.replica_fault_tolerance=true", "--set", "parallel.replicas=2"]


def _env(fault: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for name in (faults.ENV_VAR, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHFT_LIGHTHOUSE"):
        env.pop(name, None)
    if fault:
        env[faults.ENV_VAR] = fault
    return env


def _start(args: list[str], log: Path, fault: str = "", **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshtrain", *args],
                            env={**_env(fault), **extra_env}, cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


TLS_HOST = "127.0.0.2"
"""The fault-tolerant groups' advertised address (MESHTRAIN_FT_HOST) in the TLS test: a loopback
address other than 127.0.0.1, where their servers listen behind the TLS fronts."""


def _answers_in_the_clear(host: str, port: int) -> bytes:
    """What a plain TCP client gets back for an HTTP request to ``host:port`` (b"": nothing)."""
    try:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"GET /status HTTP/1.0\r\n\r\n")
            return sock.recv(4096)
    except OSError:
        return b""


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _address_in(log: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    """The ``TORCHFT_LIGHTHOUSE=`` address a lighthouse printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("TORCHFT_LIGHTHOUSE="):
                return line.split("=", 1)[1]
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"no address in {log}")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _non_loopback(found: dict) -> dict:
    return {where: pids for where, pids in found.items() if not is_loopback_address(where[0])}


# ---------------------------------------------------------------- the lighthouse


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed")
def test_the_lighthouse_listens_on_loopback_by_default(tmp_path):
    with socket.socket() as probe:  # the default port must be free for this test
        if probe.connect_ex(("127.0.0.1", 29510)) == 0:
            pytest.skip("something already listens on 127.0.0.1:29510")
    proc = _start(["lighthouse"], tmp_path / "lighthouse.log")
    try:
        address = _address_in(tmp_path / "lighthouse.log", proc)
        found = listening(process_tree(proc.pid))
    finally:
        _stop(proc)
    assert address == "http://127.0.0.1:29510"
    assert ("127.0.0.1", 29510) in found, found
    assert not _non_loopback(found), found


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed")
def test_an_insecure_lighthouse_listens_where_asked_and_says_so(tmp_path):
    log = tmp_path / "lighthouse.log"
    proc = _start(["lighthouse", "--bind", "0.0.0.0:0", "--insecure"], log)
    try:
        port = _port(_address_in(log, proc))
        found = listening(process_tree(proc.pid))
        time.sleep(0.5)  # the warning is printed before the address; let it reach the log
    finally:
        _stop(proc)
    assert ("0.0.0.0", port) in found, found
    text = " ".join(log.read_text().split())
    assert "WARNING: --insecure: listening on 0.0.0.0:0 without authentication" in text, text


def _tls(port: int, cert: Path | None, request: bytes) -> bytes:
    """Send ``request`` over TLS (with ``cert``'s site certificate, or none) and read the
    answer; b"" when the lighthouse's forwarder refuses."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the client's trust is not what is tested here
    if cert is not None:
        context.load_cert_chain(str(cert / "cert.pem"), str(cert / "key.pem"))
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as raw, \
                context.wrap_socket(raw) as sock:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                answer += chunk
    except (ssl.SSLError, ConnectionError):
        pass
    return answer


def _plain(port: int, request: bytes) -> bytes:
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionError:
            pass
    return answer


STATUS = b"GET /status HTTP/1.1\r\nHost: lighthouse\r\nConnection: close\r\n\r\n"
KILL = (b"POST /replica/meshtrain_group0/kill HTTP/1.1\r\nHost: lighthouse\r\n"
        b"Content-Length: 0\r\nConnection: close\r\n\r\n")


@needs_ft
def test_a_tls_lighthouse_answers_only_the_runs_certificates(tmp_path):
    made = meshtrain_many(["keys", "new", str(tmp_path / "run"), "--sites", "2"],
                          ["keys", "new", str(tmp_path / "other"), "--sites", "1"])
    assert [r["returncode"] for r in made] == [0, 0], made
    log = tmp_path / "lighthouse.log"
    proc = _start(["lighthouse", "--bind", "0.0.0.0:0", "--tls-dir",
                   str(tmp_path / "run" / "site-0")], log)
    try:
        port = _port(_address_in(log, proc))
        found = listening(process_tree(proc.pid))
        answers = {
            "plain status": _plain(port, STATUS),
            "plain kill": _plain(port, KILL),
            "TLS, no certificate": _tls(port, None, STATUS),
            "TLS, another CA": _tls(port, tmp_path / "other" / "site-0", STATUS),
            "TLS, another CA, kill": _tls(port, tmp_path / "other" / "site-0", KILL),
        }
        granted = _tls(port, tmp_path / "run" / "site-1", STATUS)
        assert proc.poll() is None
    finally:
        _stop(proc)
    # beyond loopback: the forwarder's port alone; torchft's own server is on loopback
    assert list(_non_loopback(found)) == [("0.0.0.0", port)], found
    assert any(is_loopback_address(a) and p != port for a, p in found), found
    assert answers == dict.fromkeys(answers, b""), answers
    assert granted.startswith(b"HTTP/1.1 200") and b"quorum_id" in granted, granted[:300]
    assert "turned away a connection from 127.0.0.1" in log.read_text(), log.read_text()


@needs_ft
def test_refusals_exit_2_before_anything_starts(tmp_path):
    run_dir = tmp_path / "far-group"
    far = [*FT, "--set", f"parallel.lighthouse={FAR}", *TINY]
    results = meshtrain_many(
        ["lighthouse", "--bind", "0.0.0.0:0"],
        ["lighthouse", "--bind", "0.0.0.0:0", "--tls-dir", str(tmp_path / "none"), "--insecure"],
        ["lighthouse", "--bind", "[::]:0", "--tls-dir", str(tmp_path / "none")],
        ["keys", "new", str(tmp_path / "keys"), "--sites", "2"],
        ["keys", "new", str(tmp_path / "keys"), "--sites", "2"],
        ["keys", "new", str(tmp_path / "zero"), "--sites", "0"],
        ["train", "--dry-run", "--world", "1", "--run-dir", str(run_dir), *far],
        ["train", "--nproc", "1", "--run-dir", str(run_dir), *far],
        ["train", "--run-dir", str(run_dir), *far, "--set",
         f"parallel.tls_dir={tmp_path / 'keys'}"],  # the CA's directory, not a site's
    )
    # the CLI wraps its messages, also after a hyphen ("--tls-" / "dir")
    text = [" ".join(r["stderr"].replace("-\n", "-").split()) for r in results]
    codes = [r["returncode"] for r in results]
    assert codes == [2, 2, 2, 0, 2, 2, 2, 2, 2], text
    assert "--tls-dir DIR" in text[0] and "--insecure" in text[0]
    assert "contradict" in text[1]
    assert "none" in text[2] and "not a directory" in text[2]
    assert "already exists" in text[4] and "--sites 0" in text[5]
    for refused in text[6:8]:
        assert f"parallel.lighthouse = '{FAR}' is not on this machine" in refused
        assert "parallel.tls_dir" in refused and "parallel.insecure_network = true" in refused
    assert "lacks ca.pem, cert.pem, key.pem" in text[8]
    assert not run_dir.exists()  # refused before any run file or worker
    modes = {p.relative_to(tmp_path / "keys").as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in (tmp_path / "keys").rglob("*")}
    assert {name: mode for name, mode in modes.items() if name.endswith("key.pem")} == {
        "ca/ca-key.pem": 0o600, "site-0/key.pem": 0o600, "site-1/key.pem": 0o600}
    assert {mode for name, mode in modes.items() if "." not in name} == {0o700}
    assert not (tmp_path / "zero").exists()


@needs_ft
def test_a_far_group_runs_with_insecure_network_or_a_site_directory(tmp_path, monkeypatch):
    """The refusal is about credentials only: the same dry runs pass with either (a site
    directory together with MESHTRAIN_FT_HOST, the address its other listeners keep to)."""
    far = ["train", "--dry-run", "--world", "1", "--run-dir", str(tmp_path / "g"), *FT,
           "--set", f"parallel.lighthouse={FAR}", *TINY]
    site = ["--set", f"parallel.tls_dir={tmp_path / 'keys' / 'site-0'}"]
    monkeypatch.delenv("MESHTRAIN_FT_HOST", raising=False)
    keys, insecure, no_host = meshtrain_many(
        ["keys", "new", str(tmp_path / "keys"), "--sites", "1"],
        [*far, "--set", "parallel.insecure_network=true"], [*far, *site])
    assert [keys["returncode"], insecure["returncode"]] == [0, 0], [keys, insecure]
    assert no_host["returncode"] == 2, no_host["stderr"]
    assert "parallel.tls_dir needs MESHTRAIN_FT_HOST" in " ".join(no_host["stderr"].split())
    monkeypatch.setenv("MESHTRAIN_FT_HOST", "127.0.0.1")  # where the servers sit behind TLS
    taken, = meshtrain_many([*far, *site])
    assert taken["returncode"] == 2 and "is 127.0.0.1" in taken["stderr"], taken["stderr"]
    monkeypatch.setenv("MESHTRAIN_FT_HOST", "127.0.0.2")
    with_host, = meshtrain_many([*far, *site])
    assert with_host["returncode"] == 0, with_host["stderr"]


# ---------------------------------------------------------------- training


def _sample_while_held(procs: list[subprocess.Popen], release: Path, logs: list[Path],
                       ready, seconds: float = 3.0) -> tuple[dict, list[int]]:
    """Every listener of ``procs`` and their descendants, sampled until ``ready(found, pids)``
    and then for ``seconds`` more; then ``release`` is created. Returns (listeners, pids)."""
    found: dict = {}
    pids: set[int] = set()
    deadline, until = time.monotonic() + 240, None
    while until is None or time.monotonic() < until:
        assert time.monotonic() < deadline, "\n".join(p.read_text()[-2000:] for p in logs)
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, log.read_text()[-3000:]
        tree = [pid for proc in procs for pid in process_tree(proc.pid)]
        pids.update(tree)
        for where, holders in listening(tree).items():
            found.setdefault(where, set()).update(holders)
        if until is None and ready(found, tree):
            until = time.monotonic() + seconds
        time.sleep(0.1)
    release.touch()
    return found, sorted(pids)


def test_a_local_run_listens_on_loopback_only(tmp_path):
    release, log = tmp_path / "release", tmp_path / "train.log"
    proc = _start(["train", "--nproc", "2", "--steps", "4", "--run-dir", str(tmp_path / "run"),
                   *TINY, "--set", "train.eval_every=0"], log,
                  fault=f"hold:step=3:file={release}")
    try:
        def workers_listen(found, tree):
            return any(pid != proc.pid for holders in found.values() for pid in holders)

        found, pids = _sample_while_held([proc], release, [log], workers_listen)
        workers = [pid for pid in process_tree(proc.pid) if pid != proc.pid]
        interfaces = {(environ_of(pid).get("GLOO_SOCKET_IFNAME"),
                       environ_of(pid).get("NCCL_SOCKET_IFNAME")) for pid in workers}
        assert proc.wait(240) == 0, log.read_text()[-3000:]
    finally:
        _stop(proc)
    assert not _non_loopback(found), found
    assert any(proc.pid in holders for holders in found.values()), found  # the store
    assert interfaces == {("lo", "lo")}, interfaces


def _logged(run_dir: Path, step: int) -> bool:
    """True once ``run_dir``'s metrics.jsonl has a record of ``step``."""
    path = run_dir / "metrics.jsonl"
    return path.is_file() and f'"step": {step},' in path.read_text()


@needs_ft
@pytest.mark.timeout(400)
def test_fault_tolerant_groups_meet_over_tls_and_listen_on_loopback(tmp_path):
    from meshtrain.host.credentials import make_run_credentials

    sites = make_run_credentials(tmp_path / "keys", sites=3)
    release = tmp_path / "release"
    lighthouse = _start(["lighthouse", "--bind", "127.0.0.1:0", "--tls-dir", str(sites[0]),
                         "--join-timeout-ms", "500", "--heartbeat-timeout-ms", "2000"],
                        tmp_path / "lighthouse.log")
    procs, logs = [lighthouse], [tmp_path / "lighthouse.log"]
    try:
        address = _address_in(logs[0], lighthouse)
        for group in (0, 1):
            logs.append(tmp_path / f"group{group}.log")
            procs.append(_start(
                ["train", "--steps", "4", "--run-dir", str(tmp_path / f"group{group}"), *TINY,
                 *FT, "--set", "parallel.sync_every=2", "--set", "train.eval_every=0",
                 "--set", "train.seq_len=32", "--set", "train.global_batch=4",
                 "--set", "train.log_every=1",
                 "--set", f"parallel.replica_group={group}",
                 "--set", f"parallel.lighthouse={address}",
                 "--set", f"parallel.tls_dir={sites[group + 1]}"],
                logs[-1], fault=f"hold:step=3:file={release}", MESHTRAIN_FT_HOST=TLS_HOST))

        fronts: dict = {}

        def both_synced(found, tree):  # held at step 3: after the first sync (step 2)
            if not all(_logged(tmp_path / f"group{g}", 2) for g in (0, 1)):
                return False
            for where in found:  # while held: every port on the groups' address, in the clear
                if where[0] == TLS_HOST and where not in fronts:
                    fronts[where] = _answers_in_the_clear(*where)
            return True

        found, _ = _sample_while_held(procs, release, logs, both_synced)
        for proc, log in zip(procs[1:], logs[1:], strict=True):
            assert proc.wait(240) == 0, log.read_text()[-3000:]
    finally:
        _stop(*procs)
    assert not _non_loopback(found), found
    # each group's store, manager server and heal transport: TLS fronts on the advertised
    # address, which answer nothing to a client without a run certificate
    assert len(fronts) >= 2 * 3, (fronts, found)
    assert all(answer == b"" for answer in fronts.values()), fronts
    weights = [(tmp_path / f"group{g}" / "final" / "model-00001-of-00001.safetensors")
               .read_bytes() for g in (0, 1)]
    assert weights[0] == weights[1]
    for group in (0, 1):  # both groups in every round
        last = (tmp_path / f"group{group}" / "metrics.jsonl").read_text().splitlines()[-1]
        assert '"groups_present": 2' in last, last
    assert "turned away" not in logs[0].read_text(), logs[0].read_text()
