"""Dynamic expert placement: every K steps, re-place hot experts across expert-parallel ranks.

**Placement.** Each MoE layer has ``E`` expert *slots*; slot ``s`` lives on ep rank
``s // (E/ep)`` at local index ``s % (E/ep)`` of the layer's ``[E/ep, ...]`` expert parameters. A
:class:`LayerPlacement` says which expert sits in each slot (a permutation; identity at start,
i.e. the contiguous split of :mod:`meshtrain.parallel.expert.apply`). The experts module reorders
its expert-sorted rows into slot order before the dispatch all-to-all and back after the combine
(a gather, differentiable), so every expert still sees the same rows in the same order and
computes bitwise the same outputs and gradients: **placement never changes the numbers**, only
which rank does the work (loss parity with one process is unaffected).

**Rebalancing** (``parallel.ep_rebalance_every = K``, 0 = off). Each step's per-expert token
counts, already reduced over the global batch by :class:`~meshtrain.training.moe_stats.
MoEStepStats` (every dp rank and micro-batch, then every pipeline stage), are summed over a
window; after every K-th step :func:`plan_placement` computes a new placement per layer from
the window, identically on every rank (the counts are global, the algorithm deterministic):
longest-processing-time greedy, heaviest expert first onto the least-loaded rank with a free
slot (ties: the expert's current rank, then the lowest), then the new rank groups are relabelled
to overlap the old ones as much as possible, and experts that stay on a rank keep their local
index. A layer's placement changes only if its busiest rank's load strictly falls. Moving
(:mod:`meshtrain.parallel.expert.move`) is fully general — any permutation, across ZeRO-1/2
shard boundaries — so the planner is not restricted to "same local index" swaps.

**Why re-placement, not replication.** Replicating a hot expert would split one expert's tokens
over ranks, but its gradient would then have to be reduced over a group that changes with the
placement, which the flat, fixed edp buckets cannot express. Re-placement keeps every expert on
exactly one ep rank, so buckets, gradient reduction, ZeRO sharding and the gradient norm are
untouched. Its limit: a rank's load cannot fall below its hottest expert's.

**Layout-free state.** Checkpoints store full logical tensors in canonical expert order: the
checkpoint writer cuts expert parameters into per-expert boxes through the placement (read from
the parameters' sharding records, :meth:`~meshtrain.parallel.sharding.ParamSharding.expert_rows`),
and the final-weights gather reorders the rows it gathers over ep, so a checkpoint loads into any
layout, with or without placement. The placements and the current window are saved in the
checkpoint's metadata (:meth:`ExpertPlacer.state_dict`); resuming at the same ``ep`` moves the
experts back to the saved placement (so the run continues exactly), at another ``ep`` it starts
from the identity, keeping the window.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.config.layout_rules import check_expert_degree
from meshtrain.model.moe import layer_index
from meshtrain.parallel.expert.move import move_expert_state
from meshtrain.parallel.state import shardings_of


class LayerPlacement:
    """Which expert sits in each of one MoE layer's ``E`` slots, and this rank's share."""

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int):
        check_expert_degree(ep_size, experts=num_experts)  # ValueError when they do not split
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.local = num_experts // ep_size
        self.slots = list(range(num_experts))

    @property
    def slots(self) -> list[int]:
        """Slot -> expert (a permutation of ``range(E)``)."""
        return self._slots

    @slots.setter
    def slots(self, value: list[int]) -> None:
        value = [int(e) for e in value]
        if sorted(value) != list(range(self.num_experts)):
            raise ValueError(f"a placement must be a permutation of range({self.num_experts}), "
                             f"got {value}")
        self._slots = value
        self.identity = value == list(range(self.num_experts))

    def local_experts(self) -> list[int]:
        """The experts of this rank's local indices, in order (rows of its expert params)."""
        first = self.ep_rank * self.local
        return self._slots[first:first + self.local]


def rank_loads(loads, slots: list[int], ep: int) -> list[float]:
    """Tokens each ep rank's experts receive under placement ``slots`` (``loads`` per expert)."""
    local = len(slots) // ep
    return [float(sum(float(loads[e]) for e in slots[r * local:(r + 1) * local]))
            for r in range(ep)]


def plan_placement(loads, slots: list[int], ep: int) -> list[int]:
    """A placement whose busiest rank carries fewer tokens than under ``slots``, or ``slots``.

    Greedy (LPT): experts by decreasing load (ties: lower id) each go to the least-loaded rank
    that still has a free slot (ties: the expert's current rank, then the lowest rank). The rank
    groups are then relabelled greedily to keep as many experts on their rank as possible, and
    experts that stay keep their local index; newcomers fill the free indices in id order.
    Deterministic, so every rank computes the same placement from the same global loads.
    """
    experts = len(slots)
    local = experts // ep
    loads = [float(x) for x in loads]
    old_rank = {e: s // local for s, e in enumerate(slots)}
    old_index = {e: s % local for s, e in enumerate(slots)}
    groups: list[list[int]] = [[] for _ in range(ep)]
    total = [0.0] * ep
    for e in sorted(range(experts), key=lambda e: (-loads[e], e)):
        g = min((g for g in range(ep) if len(groups[g]) < local),
                key=lambda g: (total[g], g != old_rank[e], g))
        groups[g].append(e)
        total[g] += loads[e]
    if max(total) >= max(rank_loads(loads, slots, ep)):
        return list(slots)
    overlap = sorted(((sum(old_rank[e] == r for e in groups[g]), g, r)
                      for g in range(ep) for r in range(ep)), key=lambda t: (-t[0], t[1], t[2]))
    rank_of: dict[int, int] = {}
    for _, g, r in overlap:
        if g not in rank_of and r not in rank_of.values():
            rank_of[g] = r
    new = [-1] * experts
    for g, members in enumerate(groups):
        r = rank_of[g]
        stay = [e for e in members if old_rank[e] == r]
        for e in stay:
            new[r * local + old_index[e]] = e
        free = [i for i in range(local) if new[r * local + i] < 0]
        for i, e in zip(free, sorted(e for e in members if old_rank[e] != r), strict=True):
            new[r * local + i] = e
    return new


class ExpertPlacer:
    """Tracks every MoE layer's placement (all layers, on every rank), reports per-ep-rank load,
    rebalances every ``parallel.ep_rebalance_every`` steps and moves this rank's experts."""

    def __init__(self, model: nn.Module, engine, optimizer, mesh, config):
        self.engine, self.optimizer, self.mesh = engine, optimizer, mesh
        self.every = config.parallel.ep_rebalance_every
        self.ep = mesh.ep
        self.num_experts = config.model.moe_experts
        m = config.model
        self.layer_ids = [i for i in range(m.n_layers) if m.is_moe_layer(i)]
        shardings = shardings_of(model)
        self.local: dict[int, LayerPlacement] = {  # the layers this rank holds experts of
            layer_index(name): shardings[name].expert_placement
            for name, _ in model.named_parameters()
            if shardings[name].expert_placement is not None}
        self.placements = {i: list(range(self.num_experts)) for i in self.layer_ids}
        self.window = torch.zeros(len(self.layer_ids), self.num_experts, dtype=torch.float64)

    @classmethod
    def build(cls, model: nn.Module, engine, optimizer, mesh, config) -> ExpertPlacer | None:
        """A placer when the run is expert-parallel with MoE layers, else None."""
        if mesh.ep <= 1 or not config.model.moe_experts:
            return None
        return cls(model, engine, optimizer, mesh, config)

    def rank_tokens(self, loads: torch.Tensor) -> dict[int, list[float]]:
        """Per layer, the tokens each ep rank's experts got under the current placements
        (``loads``: ``[MoE layers, E]`` per-expert counts)."""
        return {i: rank_loads(loads[row].tolist(), self.placements[i], self.ep)
                for row, i in enumerate(self.layer_ids)}

    def end_step(self, summary: dict, loads: torch.Tensor, step: int) -> None:
        """Account step ``step``'s global per-expert ``loads`` ([MoE layers, E]) and add the
        step's ``ep_*`` metrics to the ``moe`` ``summary`` (in place); after every K-th step
        re-place the experts (a collective over ``dp_tp``)."""
        loads = loads.detach().to("cpu", torch.float64)
        per_rank = self.rank_tokens(loads)
        flat = [x for values in per_rank.values() for x in values]
        summary["ep_max_rank_tokens"] = max(flat, default=0.0)
        summary["ep_mean_rank_tokens"] = sum(flat) / len(flat) if flat else 0.0
        for i, values in per_rank.items():
            summary.setdefault("layers", {}).setdefault(str(i), {})["ep_rank_tokens"] = values
        summary["ep_experts_moved"] = 0
        self.window += loads
        if self.every and step % self.every == 0:
            new = {i: plan_placement(self.window[row].tolist(), self.placements[i], self.ep)
                   for row, i in enumerate(self.layer_ids)}
            summary["ep_experts_moved"] = self.place(new)
            self.window.zero_()

    def place(self, placements: dict[int, list[int]]) -> int:
        """Adopt ``placements`` (layer id -> slot -> expert; layers left out keep theirs),
        moving this rank's expert parameters and optimizer state. A collective over the stage's
        dp × tp ranks (the ``dp_tp`` group, which the expert groups factor): every
        rank must call it with the same placements. Returns the experts (over all layers) that
        changed ep rank."""
        local = self.num_experts // self.ep
        moved, changes = 0, {}
        for i, slots in placements.items():
            slots = [int(e) for e in slots]
            old = self.placements[i]
            if slots == old:
                continue
            old_rank = {e: s // local for s, e in enumerate(old)}
            moved += sum(old_rank[e] != s // local for s, e in enumerate(slots))
            if i in self.local:
                changes[i] = slots
        by_object = {id(self.local[i]): slots for i, slots in changes.items()}
        move_expert_state(self.engine, self.optimizer, self.mesh.comm("dp_tp"),
                          self.mesh.dp_tp_rank, self.ep, by_object)
        for i, slots in placements.items():
            self.placements[i] = [int(e) for e in slots]
            if i in self.local:
                self.local[i].slots = self.placements[i]
        return moved

    def state_dict(self) -> dict:
        """Placements and the current window (JSON-able) for the checkpoint metadata."""
        return {"ep": self.ep, "experts": self.num_experts,
                "placements": {str(i): s for i, s in self.placements.items()},
                "window": {str(i): self.window[row].tolist()
                           for row, i in enumerate(self.layer_ids)}}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the window and, when saved at this ``ep``, move to the saved placements (a
        collective over ``dp_tp``). A checkpoint without placement state leaves the identity."""
        if not state or state.get("experts") != self.num_experts:
            return
        window = state.get("window", {})
        for row, i in enumerate(self.layer_ids):
            if str(i) in window:
                self.window[row] = torch.tensor(window[str(i)], dtype=torch.float64)
        if state.get("ep") == self.ep:
            self.place({i: state["placements"][str(i)] for i in self.layer_ids
                        if str(i) in state.get("placements", {})})
