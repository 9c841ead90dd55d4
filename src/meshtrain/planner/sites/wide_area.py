"""Sites joined by a wide-area link: how a cluster description says so, and what it costs.

A cluster may be split into ``sites``: groups of whole nodes, each site's fabric as the profile
describes it (NVLink inside a node, InfiniBand / RoCE between nodes), the sites joined by one
wide-area link each (``wan_gbps`` gigabits per second per site, as links are sold, and
``wan_latency_ms`` one way). Ranks fill the sites in order (site ``i`` holds ranks
``i · gpus_per_site`` to ``(i + 1) · gpus_per_site − 1``), as :mod:`meshtrain.parallel.mesh` numbers
them with the replica groups outermost, so one DiLoCo replica group per site keeps each group's
own traffic on its site's fabric.

Pricing (:meth:`meshtrain.planner.hardware.profile.Cluster.group_bandwidth` calls
:func:`wan_bandwidth`): a group whose ranks span sites, ``k`` of them in each site, moves its
collective's bus bytes across the site's link (a ring over the group crosses the link once each
way, whatever ``k``; NCCL's several rings split the same bytes). Every rank of a site is in one
such group of the same axis and they run at once, so ``gpus_per_site / k`` groups share the
link: each gets ``wan · k / gpus_per_site`` of it, never more than the fabric's own rate. Each
latency-bound step of the collective waits for the slowest hop, the wide-area latency.
"""

from __future__ import annotations

import argparse
import dataclasses

from meshtrain.config import ConfigError


@dataclasses.dataclass(frozen=True)
class WideArea:
    """The sites of a cluster and the wide-area link that joins them."""

    sites: int
    wan_gbps: float
    """Bandwidth of each site's wide-area link, gigabits per second (1 Gb/s = 0.125 GB/s)."""
    wan_latency_ms: float = 0.0
    """One-way latency of the wide-area link, milliseconds."""

    @property
    def bytes_per_s(self) -> float:
        """Each site link's bandwidth in bytes per second."""
        return self.wan_gbps * 1e9 / 8

    def to_dict(self) -> dict:
        """JSON form (``estimate --json``'s ``wide_area.sites`` ...)."""
        return dataclasses.asdict(self)


def add_site_options(parser: argparse.ArgumentParser) -> None:
    """``--sites``, ``--nodes-per-site``, ``--wan-gbps`` and ``--wan-latency-ms``."""
    parser.add_argument("--sites", type=int, default=None, metavar="S",
                        help="split the nodes evenly into S sites joined by a wide-area link "
                             "(default 1: one site)")
    parser.add_argument("--nodes-per-site", type=int, default=None, metavar="N",
                        help="nodes in each site (instead of, or agreeing with, --sites)")
    parser.add_argument("--wan-gbps", type=float, default=None, metavar="GBIT",
                        help="bandwidth of each site's wide-area link in gigabits per second "
                             "(needed with more than one site)")
    parser.add_argument("--wan-latency-ms", type=float, default=None, metavar="MS",
                        help="one-way latency of the wide-area link, ms (default 0)")


def wide_area_from_options(nodes: int, gpus_per_node: int, sites: int | None,
                           nodes_per_site: int | None, wan_gbps: float | None,
                           wan_latency_ms: float | None) -> WideArea | None:
    """The :class:`WideArea` the site options describe for ``nodes`` nodes (None: one site);
    :class:`ConfigError` naming the option and what would be valid otherwise."""
    if sites is not None and sites < 1:
        raise ConfigError(f"--sites {sites} must be at least 1.")
    if nodes_per_site is not None and nodes_per_site < 1:
        raise ConfigError(f"--nodes-per-site {nodes_per_site} must be at least 1.")
    if nodes_per_site is not None:
        if nodes % nodes_per_site:
            raise ConfigError(f"--nodes-per-site {nodes_per_site} does not divide the "
                              f"{nodes} nodes ({gpus_per_node} GPUs each); valid: "
                              f"{_divisors_text(nodes)}.")
        if sites is not None and sites * nodes_per_site != nodes:
            raise ConfigError(f"--sites {sites} × --nodes-per-site {nodes_per_site} = "
                              f"{sites * nodes_per_site} nodes, but the cluster has {nodes}; "
                              "give one of the two, or both agreeing.")
        sites = nodes // nodes_per_site
    sites = sites or 1
    if nodes % sites:
        raise ConfigError(f"--sites {sites} does not split the {nodes} nodes ({gpus_per_node} "
                          f"GPUs each) evenly; valid: {_divisors_text(nodes)}, or "
                          "--nodes-per-site.")
    if wan_gbps is not None and not wan_gbps > 0:
        raise ConfigError(f"--wan-gbps {wan_gbps:g} must be a positive bandwidth in Gb/s.")
    if wan_latency_ms is not None and not wan_latency_ms >= 0:
        raise ConfigError(f"--wan-latency-ms {wan_latency_ms:g} must be at least 0.")
    if sites == 1:
        if wan_gbps is not None or wan_latency_ms is not None:
            raise ConfigError("--wan-gbps / --wan-latency-ms describe the link between sites; "
                              "give --sites (at least 2) or --nodes-per-site as well.")
        return None
    if wan_gbps is None:
        raise ConfigError(f"--sites {sites}: give --wan-gbps, the bandwidth of each site's "
                          "wide-area link in Gb/s (e.g. 10).")
    return WideArea(sites, wan_gbps, wan_latency_ms or 0.0)


def _divisors_text(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def gpus_per_site(wan: WideArea, gpus: int) -> int:
    """Ranks (GPUs) in each site."""
    return gpus // wan.sites


def members_per_site(wan: WideArea, gpus: int, size: int, stride: int) -> int:
    """How many members of a group (``size`` ranks, ``stride`` apart) share one site."""
    per_site = gpus_per_site(wan, gpus)
    if stride >= per_site:
        return 1
    return max(1, min(size, per_site // stride))


def spans_sites(wan: WideArea | None, gpus: int, size: int, stride: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart crosses the wide-area link."""
    if wan is None or size <= 1:
        return False
    return members_per_site(wan, gpus, size, stride) < size


def wan_bandwidth(wan: WideArea, gpus: int, size: int, stride: int) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, per-step latency in s) a site-spanning group gets on the
    wide-area link (see the module doc: the link shared by every such group of the site)."""
    k = members_per_site(wan, gpus, size, stride)
    share = wan.bytes_per_s * k / gpus_per_site(wan, gpus)
    return share, wan.wan_latency_ms * 1e-3
