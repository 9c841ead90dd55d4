"""``meshtrain lighthouse``: the torchft lighthouse that fault-tolerant replica groups join.

Every replica group of a ``parallel.replica_fault_tolerance`` run (docs/diloco.md, "Groups that
fail alone") asks this server, at each sync, which groups are alive; it answers with a quorum of
the groups that asked (:mod:`meshtrain.training.diloco.replica_ft`). One lighthouse serves one run;
it holds no training state, so it can be restarted between syncs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from meshtrain.config import ConfigError


def add_lighthouse_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain lighthouse``."""
    parser.add_argument("--bind", default="[::]:29510",
                        help="address to listen on, HOST:PORT (default [::]:29510; port 0 = any "
                             "free port)")
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
    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as error:  # a bad or busy address
        raise ConfigError(f"cannot listen on --bind {args.bind}: {error}; give a free "
                          "HOST:PORT (port 0 picks one).") from None
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"TORCHFT_LIGHTHOUSE={server.address()}", flush=True)
    print(f"meshtrain lighthouse: serving on {args.bind}; start each replica group with "
          f"--set parallel.lighthouse={server.address()} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    server.shutdown()
    return 0
