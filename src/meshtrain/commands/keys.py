"""``meshtrain keys new DIR --sites N``: the credentials of a run whose replica groups meet across
a network (mutual TLS between sites; docs/diloco.md, "Across nodes and sites").

It writes a certificate authority for this run alone and one certificate per site, signed by it
(layout and key types: :mod:`meshtrain.host.credentials`). Copy ``DIR/site-K`` to site K only,
and point that site's ``parallel.tls_dir`` (or the lighthouse's ``--tls-dir``) at it; keep
``DIR/ca`` (the CA's private key) off the training machines. An existing ``DIR`` is never
overwritten (exit status 2).
"""

from __future__ import annotations

import argparse
import sys


def add_keys_options(parser: argparse.ArgumentParser) -> None:
    """The subcommands and options of ``meshtrain keys``."""
    actions = parser.add_subparsers(dest="keys_command", required=True)
    new = actions.add_parser("new", help="make a run CA and one certificate per site")
    new.add_argument("dir", metavar="DIR", help="directory to create (must not exist)")
    new.add_argument("--sites", type=int, required=True,
                     help="number of sites (each runs replica groups or the lighthouse): "
                          "DIR/site-0 .. DIR/site-(N-1)")
    new.add_argument("--days", type=int, default=365,
                     help="how long the certificates are valid (default 365)")


def run_keys(args: argparse.Namespace) -> int:
    """Run ``meshtrain keys new``; returns the exit status (a refusal raises ConfigError)."""
    from meshtrain.host.credentials import CA_DIR, CA_KEY, make_run_credentials

    sites = make_run_credentials(args.dir, args.sites, args.days)
    root = sites[0].parent
    print(f"meshtrain keys: wrote a run CA and {len(sites)} site certificate(s) under {root} "
          f"(valid {args.days} days)", file=sys.stderr)
    for index, site in enumerate(sites):
        print(f"  site {index}: {site}  -> copy to site {index} only and set "
              f"parallel.tls_dir (or meshtrain lighthouse --tls-dir) to that copy",
              file=sys.stderr)
    print(f"  {root / CA_DIR / CA_KEY}: the CA's private key; keep it off the training "
          "machines (it can make new certificates for this run)", file=sys.stderr, flush=True)
    return 0
