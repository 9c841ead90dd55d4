"""``ParallelMesh``: the one topology object, passed explicitly to everything that communicates.

Ranks are laid out with **replica groups outermost, then pp, and tp innermost**::

    rank = replica_rank * inner + ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

(``inner = dp × cp × tp × pp``, the ranks of one replica group) so that each DiLoCo replica group
(``replicas``, docs/diloco.md) is a block of consecutive ranks running the whole inner layout, and

so tensor-parallel peers are neighbours (on one node, on the fastest links), context-parallel
peers (who exchange keys and values in every attention layer) come next, and pipeline stages are
furthest apart. The ``cp`` ranks of one data-parallel replica read the same sequences and each
holds its part of every sequence, so they take part in the gradient reduction like data-parallel
ranks: ``dp_cp`` is the group of all ``dp × cp`` ranks with the same (pp, tp) coordinates (as
torchtitan's ``dp_shard_cp``), over which gradients are reduced and ZeRO shards its states; its
collectives are counted as ``dp`` traffic. It equals ``dp`` when ``cp = 1``.

Expert parallelism is its own factorisation of the ``dp × tp`` ranks of one pipeline stage (and
one cp rank), independent of attention's (Megatron's "parallel folding"). Those ranks are numbered
``dp_tp_rank = dp_rank · tp + tp_rank`` (tp innermost, as the global order); ``ep`` consecutive
ones form an expert group (``ep_rank = dp_tp_rank mod ep``), and the ``dp · tp / ep`` ranks
holding the same experts form the ``edp`` group (expert-data-parallel, ``edp_rank = dp_tp_rank //
ep``); expert gradients are reduced over ``edp_cp`` (``edp`` × ``cp``). ``ep`` must divide
``dp · tp`` and either divide ``tp`` or be a multiple of it, so an expert group is a slice of one
tp group or a run of whole tp groups. With ``tp = 1`` this is the plain split of the dp ranks;
with ``tp > 1`` an expert group spans tp ranks, each tp rank holding other experts and computing
its own share of the tokens (:mod:`meshtrain.parallel.expert.apply`). The ``dp_tp`` group (every
``dp × tp`` rank of a stage and cp rank) is the one expert re-placement moves state over.

A tied embedding (``model.tie_embeddings``) under pipeline parallelism is held by the pipeline
ranks of the first and of the last stage (``tied_pp_ranks``, from the schedule): the ``tied``
group joins them for every (dp, cp, tp) coordinate, and its all-reduce sums the two stages'
gradients of the shared matrix (counted as ``pp`` traffic). Every other rank is a group of one.

The ``replica`` group joins the ranks with the same inner coordinates in every replica group
(each holds the same shard of the model), over which DiLoCo averages pseudo-gradients; every other
axis's groups stay inside one replica group. With ``replicas = 1`` it has one rank. A replica
group that runs as a job of its own (``parallel.replica_fault_tolerance``, ``replica_group`` given)
has a world of its inner layout only: its ``replica`` group is itself, and the other groups are
reached through torchft instead (:mod:`meshtrain.training.diloco.replica_ft`).

The mesh owns every process group (none are module-level globals), the counted collectives of
each axis (:mod:`meshtrain.parallel.comm`), and the per-axis random-number streams.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshtrain.config.layout_rules import check_expert_degree, world_size
from meshtrain.parallel.comm import CommLog, CountedComm

COUNTED_AS = {"dp_cp": "dp", "edp_cp": "edp", "tied": "pp", "dp_tp": "dp",
              "replica_sync": "replica"}
"""Groups whose collectives are counted under another axis's name in ``comm_bytes``: gradient
reduction over dp × cp is data-parallel traffic (``cp`` counts only the key/value exchange); the
tied embedding's gradient sum between the first and last stage is pipeline traffic; expert
re-placement's moves over ``dp_tp`` are data-parallel traffic; DiLoCo's background exchange
(``replica_sync``) is replica traffic."""

OWN_GROUPS = ("replica_sync",)
"""Axes whose process groups are never shared with another axis of the same members: DiLoCo's
overlapped pseudo-gradient exchange runs in the background on ``replica_sync``, so that the
per-step reductions over ``replica`` do not queue behind it."""

STARTUP_TIMEOUT_S = 60.0
"""Least time to wait for every worker to join, whatever ``train.collective_timeout_s`` is."""


class ParallelMesh:
    """Degrees, coordinates, groups, counted comms and RNG streams of one process."""

    def __init__(self, *, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                 rank: int = 0, device: torch.device | str = "cpu", seed: int = 0,
                 timeout_s: float | None = None, tied_pp_ranks: Iterable[int] = (),
                 replicas: int = 1, replica_group: int | None = None):
        """``timeout_s`` bounds every collective of the axis groups (``train.collective_timeout_s``;
        None = torch's default). Sub-groups do not inherit the world group's timeout.
        ``tied_pp_ranks``: the pipeline ranks holding a tied embedding (those of the first and
        the last stage; empty = none), which form the ``tied`` groups. ``replica_group``: this
        world is that one of the ``replicas`` groups alone (a separate job; ``rank`` is then
        the rank inside the group); None = the world holds every group."""
        check_expert_degree(ep, dp, tp)
        if cp < 1:
            raise ValueError(f"cp = {cp} must be at least 1")
        if replicas < 1:
            raise ValueError(f"replicas = {replicas} must be at least 1")
        self.dp, self.tp, self.pp, self.ep, self.cp = dp, tp, pp, ep, cp
        self.replicas = replicas
        self.inner_size = world_size(dp, tp, pp, cp)
        """Ranks of one replica group (its inner layout's world)."""
        self.group_alone = replica_group is not None
        """This world is one replica group of a fault-tolerant run (the others are other jobs)."""
        if self.group_alone and not 0 <= replica_group < replicas:
            raise ValueError(f"replica_group {replica_group} outside replicas = {replicas}")
        self.world_size = world_size(dp, tp, pp, cp, 1 if self.group_alone else replicas)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        self.rank = rank
        self.tied_pp_ranks = tuple(sorted(set(tied_pp_ranks)))
        if any(not 0 <= p < pp for p in self.tied_pp_ranks):
            raise ValueError(f"tied_pp_ranks {self.tied_pp_ranks} outside pp = {pp}")
        self.device = torch.device(device)
        self.seed = seed
        self.timeout_s = timeout_s
        self.replica_rank = replica_group if self.group_alone else rank // self.inner_size
        inner = rank % self.inner_size
        self.tp_rank = inner % tp
        self.cp_rank = (inner // tp) % cp
        self.dp_rank = (inner // (tp * cp)) % dp
        self.pp_rank = inner // (tp * cp * dp)
        self.dp_tp_rank = self.dp_rank * tp + self.tp_rank
        """This rank's place among the ``dp × tp`` ranks of its stage (the expert factorisation's
        numbering, and its place in the ``dp_tp`` group)."""
        self.ep_rank = self.dp_tp_rank % ep
        self.edp_rank = self.dp_tp_rank // ep
        self.edp = dp * tp // ep
        """Ranks of the ``edp`` group: the ``dp × tp`` ranks of a stage holding the same experts."""
        self.dp_cp_rank = self.dp_rank * cp + self.cp_rank
        """This rank's place in its ``dp_cp`` group (gradient reduction, ZeRO shard index)."""
        self.edp_cp_rank = self.edp_rank * cp + self.cp_rank
        """This rank's place in its ``edp_cp`` group (expert gradients)."""
        self.comm_log = CommLog()
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._group_ranks: dict[str, list[int]] = {}
        self._build_groups()
        self.comms = {axis: CountedComm(COUNTED_AS.get(axis, axis), self._groups[axis],
                                        len(self._group_ranks[axis]), self.comm_log)
                      for axis in self._groups}
        # The whole world, on the default group (its timeout is the start-up one, at least 60 s):
        # the trainer's one small per-step all-gather of rank timings and stop requests.
        world = dist.group.WORLD if dist.is_initialized() and self.world_size > 1 else None
        self._groups["world"] = world
        self._group_ranks["world"] = list(range(self.world_size))
        self.comms["world"] = CountedComm("world", world, self.world_size, self.comm_log)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_environment(cls, *, dp: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                         seed: int = 0, device: torch.device | str = "cpu",
                         timeout_s: float | None = None,
                         tied_pp_ranks: Iterable[int] = (), replicas: int = 1,
                         replica_group: int | None = None) -> ParallelMesh:
        """Build the mesh for this process; the default process group must already exist
        when the world has more than one rank. ``tied_pp_ranks``, ``replica_group``: see the
        constructor."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        groups = 1 if replica_group is not None else replicas
        if world != world_size(dp, tp, pp, cp, groups):
            raise ValueError(f"world size {world} != replicas × dp × cp × tp × pp = "
                             f"{groups} × {dp} × {cp} × {tp} × {pp}")
        return cls(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, rank=rank, device=device, seed=seed,
                   timeout_s=timeout_s, tied_pp_ranks=tied_pp_ranks, replicas=replicas,
                   replica_group=replica_group)

    def coords_to_rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0,
                       replica_rank: int | None = None) -> int:
        """Global rank of the process at the given coordinates (in this rank's replica group
        unless ``replica_rank`` is given)."""
        replica = self.replica_rank if replica_rank is None else replica_rank
        if self.group_alone:  # the world is this group alone: its ranks start at 0
            replica = 0
        return (replica * self.inner_size
                + ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank)

    def _axis_members(self) -> dict[str, list[list[int]]]:
        """Every group of every axis, as lists of global ranks: each inner axis's groups of
        every replica group, then the ``replica`` groups."""
        groups: dict[str, list[list[int]]] = {}
        if self.group_alone:
            groups = self._inner_members(0)
            groups["replica"] = [[i] for i in range(self.inner_size)]
            groups["replica_sync"] = groups["replica"]
            return groups
        for replica in range(self.replicas):
            for axis, members in self._inner_members(replica).items():
                groups.setdefault(axis, []).extend(members)
        groups["replica"] = [[g * self.inner_size + i for g in range(self.replicas)]
                             for i in range(self.inner_size)]
        groups["replica_sync"] = [list(members) for members in groups["replica"]]
        return groups

    def _inner_members(self, replica: int) -> dict[str, list[list[int]]]:
        """The inner axes' groups of replica group ``replica``, as lists of global ranks."""
        def r(p, d, t, c):
            return self.coords_to_rank(p, d, t, c, replica)

        pp, dp, tp, ep, cp, edp = self.pp, self.dp, self.tp, self.ep, self.cp, self.edp
        outer = [(p, c, t) for p in range(pp) for c in range(cp) for t in range(tp)]
        groups: dict[str, list[list[int]]] = {
            "tp": [[r(p, d, t, c) for t in range(tp)]
                   for p in range(pp) for d in range(dp) for c in range(cp)],
            "cp": [[r(p, d, t, c) for c in range(cp)]
                   for p in range(pp) for d in range(dp) for t in range(tp)],
            "dp": [[r(p, d, t, c) for d in range(dp)] for p, c, t in outer],
            "dp_cp": [[r(p, d, t, c) for d in range(dp) for c in range(cp)]
                      for p in range(pp) for t in range(tp)],
            "pp": [[r(p, d, t, c) for p in range(pp)]
                   for d in range(dp) for c in range(cp) for t in range(tp)],
            "dp_tp": [[r(p, x // tp, x % tp, c) for x in range(dp * tp)]
                      for p in range(pp) for c in range(cp)],
            "ep": [[r(p, (x0 + e) // tp, (x0 + e) % tp, c) for e in range(ep)]
                   for p in range(pp) for c in range(cp) for x0 in range(0, dp * tp, ep)],
            "edp": [[r(p, (e + k * ep) // tp, (e + k * ep) % tp, c) for k in range(edp)]
                    for p in range(pp) for c in range(cp) for e in range(ep)],
            "edp_cp": [[r(p, (e + k * ep) // tp, (e + k * ep) % tp, c)
                        for k in range(edp) for c in range(cp)]
                       for p in range(pp) for e in range(ep)],
        }
        tied = self.tied_pp_ranks
        groups["tied"] = [[r(p, d, t, c) for p in tied]
                          for d in range(dp) for c in range(cp) for t in range(tp)] if tied else []
        groups["tied"] += [[r(p, d, t, c)] for p in range(pp) if p not in tied
                           for d in range(dp) for c in range(cp) for t in range(tp)]
        return groups

    def _build_groups(self) -> None:
        import datetime

        distributed = dist.is_initialized() and self.world_size > 1
        timeout = (None if self.timeout_s is None
                   else datetime.timedelta(seconds=self.timeout_s))
        built: dict[tuple, dist.ProcessGroup | None] = {}
        for axis, member_lists in self._axis_members().items():
            mine = next(m for m in member_lists if self.rank in m)
            self._group_ranks[axis] = mine
            self._groups[axis] = None
            key = tuple(map(tuple, member_lists))
            if not distributed or all(len(m) == 1 for m in member_lists):
                continue
            if key in built and axis not in OWN_GROUPS:  # e.g. edp == dp when ep == 1
                self._groups[axis] = built[key]
                continue
            # new_group is collective over the whole world: every rank creates every group
            # (groups of one rank, e.g. the middle stages' tied group, are not created).
            for members in member_lists:
                if len(members) == 1:
                    continue
                group = dist.new_group(members, timeout=timeout)
                if self.rank in members:
                    self._groups[axis] = group
                    built.setdefault(key, group)

    # ---------------------------------------------------------------- queries
    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of ``axis`` for this rank (None when the axis has one rank)."""
        return self._groups[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``."""
        return list(self._group_ranks[axis])

    def comm(self, axis: str) -> CountedComm:
        """Counted collectives along ``axis``."""
        return self.comms[axis]

    def size(self, axis: str) -> int:
        """Degree of ``axis`` as seen by this rank."""
        return len(self._group_ranks[axis])

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 writes metrics and files."""
        return self.rank == 0

    # ---------------------------------------------------------------- RNG streams
    def rng_seed(self, stream: str, vary_along: Iterable[str] = ()) -> int:
        """A seed for the random stream ``stream`` that is equal on ranks whose coordinates agree
        on every axis in ``vary_along`` and differs where they do not.

        E.g. dropout inside a tensor-parallel region uses ``vary_along=("dp", "pp")``: identical
        across tp ranks (they hold pieces of the same activations), different across replicas.
        """
        coords = {"pp": self.pp_rank, "dp": self.dp_rank, "tp": self.tp_rank,
                  "ep": self.ep_rank, "edp": self.edp_rank, "cp": self.cp_rank,
                  "replica": self.replica_rank}
        parts = [f"{self.seed}", stream] + [f"{a}={coords[a]}" for a in sorted(vary_along)]
        digest = hashlib.sha256("/".join(parts).encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def generator(self, stream: str, vary_along: Iterable[str] = ()) -> torch.Generator:
        """A ``torch.Generator`` on this mesh's device seeded by :meth:`rng_seed`."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.rng_seed(stream, vary_along))
        return gen

    # ---------------------------------------------------------------- lifecycle
    def barrier(self) -> None:
        """Synchronise every rank (no-op for a single process); logged on the ``world`` axis."""
        if dist.is_initialized() and self.world_size > 1:
            entry = self.comm_log.record("world", "barrier", (), torch.uint8, 0, self.world_size)
            dist.barrier()
            entry.done = True


def init_distributed(device: torch.device, timeout_s: float = 600.0,
                     dry_run: tuple[int, int] | None = None) -> None:
    """Join the process group described by the environment (torchrun's RANK/WORLD_SIZE/...).

    gloo on CPU, NCCL on CUDA. A world of one needs no process group and gets none.
    ``timeout_s`` (``train.collective_timeout_s``) bounds every collective of every group: a
    rank left waiting longer raises (gloo) or is aborted by NCCL's watchdog, instead of hanging.
    Joining (and the world group, used only for barriers) waits at least
    :data:`STARTUP_TIMEOUT_S`, since workers may start seconds apart; the axis groups that carry
    training's collectives get ``timeout_s`` itself (:class:`ParallelMesh`).

    ``dry_run = (rank, world)`` (:mod:`meshtrain.commands.dry_run`): join torch's *fake* process
    group as that rank instead (no peers, nothing moved; it serves the meta device too).
    """
    import datetime

    if dry_run is not None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        devices = dist.Backend.backend_capability[dist.Backend.FAKE]
        if "meta" not in devices:  # so that pipeline sends/receives of meta tensors dispatch
            devices.append("meta")
        dist.init_process_group("fake", rank=dry_run[0], world_size=dry_run[1],
                                store=FakeStore())
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
    extra = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch elastic's agent keeps one store for every restart of the workers and does not
        # separate attempts in it: a restarted worker would read the failed attempt's keys
        # (refused connections, barriers that never complete). Give each attempt its own prefix.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        extra = {"store": dist.PrefixStore(f"meshtrain/{_attempt_key(store)}", store),
                 "rank": int(os.environ["RANK"]), "world_size": world}
    dist.init_process_group(backend=backend, timeout=timeout, **extra)


def _attempt_key(store) -> str:
    """A name for this start of the workers that every worker of it agrees on.

    The restart count alone is not one: a node that joins a running job (``--nnodes MIN:MAX``)
    restarts the workers without counting a restart, and the joining agent counts from 0. So the
    c10d rendezvous round, read from the rendezvous state in the agent's store (a new round for
    every start of the workers, the same for all of them), is used when it can be read; else the
    restart count."""
    import base64

    from meshtrain.host.safe_unpickle import restricted_loads

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        key = f"torch.rendezvous.{run_id}"
        try:
            if store.check([key]):
                # bytes from the network: read with torch's state classes only, never a plain
                # unpickler (a planted state would run what it names)
                state = restricted_loads(base64.b64decode(store.get(key)), RENDEZVOUS_GLOBALS,
                                         f"the rendezvous state {key} in the agent's store")
                if type(state).__name__ == "_RendezvousState":
                    return f"round_{int(state.round)}"
        except Exception:  # another backend, another torch's state, or refused: fall back
            pass
    return f"attempt_{attempt}"


_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
RENDEZVOUS_GLOBALS = frozenset({
    (_RDZV, "_RendezvousState"), (_RDZV, "_NodeDesc"),
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
    ("builtins", "set"), ("builtins", "frozenset"),
})
"""What torch's c10d dynamic rendezvous pickles into its state (``_RendezvousState``: the round,
``_NodeDesc`` participants in dicts and sets, deadlines and heartbeats as aware datetimes), as
its default pickle protocol spells them: the only globals :func:`_attempt_key` admits."""


def shutdown_distributed() -> None:
    """Leave the process group cleanly (safe to call when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()
