"""What a run opens to the network, refused before any worker starts unless it is protected.

A run on one machine listens on loopback only (:mod:`meshtrain.run.launch`). Fault-tolerant
replica groups (``parallel.replica_fault_tolerance``) meet through a torchft lighthouse, and each
group's rank 0 serves a manager, a store and every rank a heal transport that the *other* groups
must reach. When the lighthouse is on this machine (a loopback address), so are the other
groups, and all of those listen on loopback. When it is elsewhere, the run is **multi-site**:
its control plane crosses a network, where anyone who reaches those ports could join the
quorums, stall or kill the groups, or hand a healing group the state it loads. So a multi-site
run needs ``parallel.tls_dir`` (a site directory of ``meshtrain keys new``: mutual TLS with the
lighthouse) or, on a trusted network, ``parallel.insecure_network = true``.
"""

from __future__ import annotations

import os

from meshtrain.config import Config, ConfigError
from meshtrain.host.ft_network import FT_HOST_ENV
from meshtrain.host.loopback import is_loopback, split_address


def lighthouse_is_local(address: str) -> bool:
    """True when the lighthouse ``address`` (``HOST:PORT`` or ``http://HOST:PORT``) is a loopback
    address of this machine (a name counts when all its addresses are loopback)."""
    try:
        host, _ = split_address(address, default_port=0)
    except ValueError:
        return False
    return is_loopback(host)


def check_tls_host(host: str) -> None:
    """With ``parallel.tls_dir``: ``MESHTRAIN_FT_HOST`` names the address this group's TLS
    fronts listen on and advertise (its store and manager server themselves listen on
    ``127.0.0.1`` behind them, at the same ports, so it cannot be that address)."""
    import socket

    if not host:
        raise ConfigError(
            f"parallel.tls_dir needs {FT_HOST_ENV}: the address this group's store, torchft "
            "manager server and heal transport are reached at over mutual TLS (its address "
            "between the sites, e.g. a WireGuard or private address, docs/security.md; on one "
            "machine 127.0.0.2).")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        raise ConfigError(f"{FT_HOST_ENV} = {host!r} does not resolve to an address of this "
                          "machine; give this group's address between the sites.") from None
    if "127.0.0.1" in addresses:
        raise ConfigError(
            f"{FT_HOST_ENV} = {host!r} is 127.0.0.1, where this group's servers listen behind "
            "their TLS fronts; give its address between the sites (on one machine 127.0.0.2).")


def validate_network_exposure(config: Config) -> None:
    """Refuse (ConfigError) a fault-tolerant group whose lighthouse is on another machine unless
    ``parallel.tls_dir`` holds a site's credentials (with ``MESHTRAIN_FT_HOST``,
    :func:`check_tls_host`) or ``parallel.insecure_network`` is set; check the ``tls_dir`` files
    whenever it is given."""
    par = config.parallel
    if par.tls_dir:
        from meshtrain.host.credentials import SiteCredentials

        SiteCredentials.load(par.tls_dir, "parallel.tls_dir")
    if not par.replica_fault_tolerance:
        return
    if par.tls_dir:
        check_tls_host(os.environ.get(FT_HOST_ENV, ""))
        return
    address = par.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address or lighthouse_is_local(address) or par.insecure_network:
        return
    raise ConfigError(
        f"parallel.lighthouse = {address!r} is not on this machine, so this replica group's "
        "control plane (lighthouse, manager, store, heal transport) crosses a network where "
        "anyone reaching its ports could join the quorums, stall or kill the groups, or feed a "
        "healing group its state. Set parallel.tls_dir to this site's directory from "
        "`meshtrain keys new DIR --sites N` (and run `meshtrain lighthouse --tls-dir`), or "
        "parallel.insecure_network = true on a trusted network; with every group on this "
        "machine, use a loopback lighthouse (127.0.0.1).")
