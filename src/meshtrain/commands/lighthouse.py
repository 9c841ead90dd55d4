"""``meshtrain lighthouse``: the torchft lighthouse that fault-tolerant replica groups join.

Every replica group of a ``parallel.replica_fault_tolerance`` run (docs/diloco.md, "Groups that
fail alone") asks this server, at each sync, which groups are alive; it answers with a quorum of
the groups that asked (:mod:`meshtrain.training.diloco.replica_ft`). One lighthouse serves one run;
it holds no training state, so it can be restarted between syncs.

It listens on ``127.0.0.1:29510`` unless ``--bind`` says otherwise. Anyone who reaches it can
join quorums (and so feed a group the state it heals from), read the dashboard and kill groups
from it, so a ``--bind`` beyond loopback needs ``--tls-dir DIR`` (a site directory of
``meshtrain keys new``): the lighthouse itself then listens on an ephemeral loopback port, and a
mutual-TLS forwarder (:mod:`meshtrain.host.tls_forward`) on the ``--bind`` address lets through
only connections that present a certificate of the run's CA (every group sets
``parallel.tls_dir``). ``--insecure`` serves anyone instead, with a warning on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

from meshtrain.config import ConfigError
from meshtrain.host.loopback import LOOPBACK, is_loopback, split_address

DEFAULT_BIND = f"{LOOPBACK}:29510"


def add_lighthouse_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain lighthouse``."""
    parser.add_argument("--bind", default=DEFAULT_BIND,
                        help=f"address to listen on, HOST:PORT (default {DEFAULT_BIND}: this "
                             "machine only; port 0 = any free port). Beyond loopback it needs "
                             "--tls-dir or --insecure")
    parser.add_argument("--tls-dir", metavar="DIR",
                        help="answer only parties holding a certificate of the run's CA, over "
                             "mutual TLS: a site directory made by `meshtrain keys new` (every "
                             "group then sets parallel.tls_dir)")
    parser.add_argument("--insecure", action="store_true",
                        help="listen beyond loopback without credentials: anyone who reaches "
                             "the port can join quorums and kill groups (trusted networks only)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="fewest groups a quorum may have when its members change "
                             "(default 1: one surviving group goes on alone)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000,
                        help="how long a quorum waits for groups that are alive but have not "
                             "asked yet (default 60000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="silence after which a group counts as dead (default 5000)")


def serve(args: argparse.Namespace, ready: threading.Event | None = None) -> int:
    """Run the lighthouse until SIGINT or SIGTERM; prints its address on stdout first."""
    os.environ.setdefault("RUST_LOG", "warn")  # RUST_LOG=info: every quorum it forms
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise ConfigError("meshtrain lighthouse needs torchft, which is not installed: "
                          "pip install 'meshtrain[ft]' (or pip install torchft).") from None
    if args.min_replicas < 1:
        raise ConfigError(f"--min-replicas {args.min_replicas} must be at least 1.")
    for name in ("join_timeout_ms", "heartbeat_timeout_ms"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a "
                              "positive number of milliseconds.")
    host, port, credentials = _listening_plan(args)
    try:
        server = LighthouseServer(bind=f"{LOOPBACK}:0" if credentials else args.bind,
                                  min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as error:  # a bad or busy address
        raise ConfigError(f"cannot listen on --bind {args.bind}: {error}; give a free "
                          "HOST:PORT (port 0 picks one).") from None
    forwarder = None
    port = split_address(server.address())[1]
    if credentials is not None:
        from meshtrain.host.tls_forward import serve_tls

        try:
            forwarder = serve_tls((host, split_address(args.bind)[1]), (LOOPBACK, port),
                                  credentials.server_context(), name="lighthouse")
        except OSError as error:
            server.shutdown()
            raise ConfigError(f"cannot listen on --bind {args.bind}: {error.strerror or error}; "
                              "give a free HOST:PORT (port 0 picks one).") from None
        port = forwarder.address[1]
    address = f"http://{_advertised_host(host)}:{port}"
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"TORCHFT_LIGHTHOUSE={address}", flush=True)
    how = ("mutual TLS, certificates of the run's CA only" if credentials is not None
           else "no authentication" if args.insecure and not is_loopback(host)
           else "this machine only")
    print(f"meshtrain lighthouse: serving on {args.bind} ({how}); start each replica group "
          f"with --set parallel.lighthouse={address}"
          + (" and its site's parallel.tls_dir" if credentials is not None else "")
          + " (Ctrl-C stops)", file=sys.stderr, flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    if forwarder is not None:
        forwarder.close()
    server.shutdown()
    return 0


def _listening_plan(args: argparse.Namespace):
    """``(host, port, credentials or None)`` of ``--bind``; refuses (ConfigError) a bind beyond
    loopback without ``--tls-dir`` or ``--insecure``, and warns loudly for ``--insecure``."""
    try:
        host, port = split_address(args.bind)
    except ValueError as error:
        raise ConfigError(f"--bind {args.bind}: {error}; give HOST:PORT, e.g. "
                          f"{DEFAULT_BIND}.") from None
    tls_dir, insecure = getattr(args, "tls_dir", None), getattr(args, "insecure", False)
    if tls_dir and insecure:
        raise ConfigError("--tls-dir and --insecure contradict each other: --tls-dir answers "
                          "certificate holders only, --insecure anyone; give one.")
    if tls_dir:
        from meshtrain.host.credentials import SiteCredentials

        return host, port, SiteCredentials.load(tls_dir, "--tls-dir")
    if is_loopback(host):
        return host, port, None
    if not insecure:
        raise ConfigError(f"--bind {args.bind} listens beyond this machine, and anyone who "
                          "reaches the lighthouse can join the run's quorums, feed a healing "
                          "group its state and kill groups: give --tls-dir DIR (a site "
                          "directory of `meshtrain keys new DIR --sites N`; every group then "
                          "sets parallel.tls_dir) to answer only the run's certificate holders, "
                          "or --insecure on a trusted network; or bind 127.0.0.1 when every "
                          "group runs on this machine.")
    print(f"meshtrain lighthouse: WARNING: --insecure: listening on {args.bind} without "
          "authentication or encryption. Anyone who can reach this port can join the run's "
          "quorums (and so hand a healing group the state it loads), read the dashboard and "
          "kill replica groups. Use --tls-dir (meshtrain keys new) unless this network is "
          "trusted.", file=sys.stderr, flush=True)
    return host, port, None


def _advertised_host(host: str) -> str:
    """The host groups reach the lighthouse at: this machine's name for a wildcard bind."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
