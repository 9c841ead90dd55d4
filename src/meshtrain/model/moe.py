"""Mixture-of-Experts feed-forward (single-device semantics).

An :class:`MoE` layer routes each token to ``top_k`` of ``moe_experts`` experts and adds an
optional always-on shared expert. Routing (:meth:`MoE.route`) and expert compute
(:meth:`MoE.compute_experts`) are separate methods; expert parallelism replaces only the
``experts`` module (:mod:`meshtrain.parallel.expert`), which receives the assignments already sorted
by expert and capped at capacity, dispatches them with an all-to-all, runs the local experts and
combines them back, so routing, capacity and gating are the same code under every layout.

Capacity (``moe_capacity_factor``): with a factor ``c > 0`` capacity is decided per **routing
group**: ``G`` consecutive positions of one sequence (``moe_capacity_group``; 0 = the whole
sequence). An expert accepts at most ``ceil(c * G * k / E)`` assignments of one group's ``G``
tokens; the assignments after those, in the order of their tokens' positions in the sequence (and
of ``k`` within a token), are dropped and counted. A group never spans two sequences, so which
assignments are dropped is the same however the sequences are split over data-parallel ranks,
micro-batches, pipeline stages and expert-parallel ranks; tensor parallelism routes whole
(gathered) sequences, and under context parallelism a group must lie inside one of a rank's
sequence chunks (validation checks that ``G`` divides ``seq_len / (2 cp)``). A forward whose
sequence is not a multiple of ``G`` long (generation) gives its last group a capacity from its
own size. ``0`` = dropless.

Node-limited routing (``moe_groups``, ``moe_max_groups``; DeepSeek-V3): the experts, in id
order, form ``moe_groups`` equal groups; each token first keeps the ``moe_max_groups`` groups whose
two best selection scores sum highest, then takes its top-k among their experts only. With
``parallel.ep = moe_groups`` a group is one ep rank's experts, so a token's assignments go to at
most ``moe_max_groups`` ep ranks. The groups are part of the model, not of the layout: every
layout routes alike. Dense first blocks (``moe_first_dense``) are plain feed-forward blocks.

Load balancing (``config.moe_balance``):

* ``"aux-loss"``: the Switch-Transformer auxiliary loss ``coef * E * sum_i f_i * P_i`` is stored
  in ``last_stats["aux_loss"]`` for the trainer to add to the objective, averaged over the step's
  micro-batches and data-parallel ranks. ``f_i`` is the fraction of the assignments that chose
  expert ``i`` and ``P_i`` the mean router probability of expert ``i``, over the tokens that
  ``config.moe_balance_scope`` names (:mod:`meshtrain.model.moe_balance`): one forward's
  (``micro-batch``, the reference's micro-batch in ``meshtrain verify``), each sequence's
  (``sequence``), or, for ``f``, the whole step's (``global-batch``: :attr:`MoE.global_load`, the
  step's per-expert assignments over every micro-batch and rank, which the trainer provides, or
  which the layer sums over :attr:`MoE.batch_comm` in its forward). Under tensor parallelism
  every tp rank routes the *whole* micro-batch (sequence parallelism first gathers the
  sequence), so the statistics already cover the tokens the tp ranks share and need no further
  reduction (each expert-parallel rank routes its own micro-batch, so ep changes nothing here).
* ``"bias"``: DeepSeek-V3 auxiliary-loss-free balancing: a per-expert ``expert_bias`` is added to
  the scores for *selection only*, and nudged by :meth:`MoE.update_bias` after each step from the
  load of the **global batch** (every micro-batch of every data-parallel rank).
* ``"none"``: neither.

Statistics: ``last_stats`` holds the last forward's; :meth:`MoE.pop_step_stats` returns the sums
since the previous call (the trainer's per-step window). Forwards re-run inside backward by
activation checkpointing are not counted twice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.feed_forward import FeedForward, MLPActivation
from meshtrain.model.grouped_gemm import ExpertGroups
from meshtrain.model.moe_balance import (
    balance,
    forward_balance_stats,
    selection_probs,
    sequence_counts,
)
from meshtrain.model.weight_grad import grouped_expert_matmul


class GroupedExperts(nn.Module):
    """``E`` independent MLPs stored as 3-D parameters.

    ``w1`` [E, dim, hidden] (gate for swiglu, up for gelu), ``w3`` [E, dim, hidden] (swiglu
    only) and ``w2`` [E, hidden, dim]. The number of experts is read from ``w1``, so an
    expert-parallel rank may hold just its local slice.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, mlp: str = "swiglu"):
        super().__init__()
        self.act = MLPActivation(mlp)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        if mlp == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    @property
    def num_experts(self) -> int:
        """Experts held by this module."""
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run tokens ``x`` [N, dim], grouped by expert, through their experts.

        ``counts[e]`` (a LongTensor [E] on ``x``'s device) is the number of consecutive rows of
        ``x`` that belong to expert ``e`` (``sum(counts) == N``). Each of the three products is
        one grouped GEMM over all experts (:mod:`meshtrain.model.grouped_gemm`); an expert
        without rows still gets a (zero) gradient.
        """
        groups = ExpertGroups(counts)
        h = grouped_expert_matmul(x, self.w1, groups)
        if self.act.mlp == "swiglu":
            h = self.act(h, grouped_expert_matmul(x, self.w3, groups))
        else:
            h = self.act(h)
        return grouped_expert_matmul(h, self.w2, groups)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing a block's dense feed-forward.

    Submodules: ``router`` (``nn.Linear(dim, E)``), ``experts`` (:class:`GroupedExperts`), and,
    with ``moe_shared_experts > 0``, ``shared_experts`` (:class:`FeedForward` of hidden size
    ``config.shared_ffn_dim``) and, with ``moe_shared_gate``, ``shared_gate``
    (``nn.Linear(dim, 1)``: the shared output is scaled by ``sigmoid(shared_gate(x))``).
    Buffer ``expert_bias`` [E] (fp32, persistent).

    After every forward, ``last_stats`` holds ``tokens_per_expert`` (LongTensor [E], assignments
    before capacity dropping), ``dropped`` (LongTensor scalar), ``aux_loss`` (scalar, in the
    autograd graph, already multiplied by ``moe_aux_coef``; zero unless balance is aux-loss) and
    the forward's balance numbers ``balance_*``
    (:func:`~meshtrain.model.moe_balance.forward_balance_stats`, detached).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.moe_experts
        self.top_k = config.moe_top_k
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"moe_top_k must be between 1 and moe_experts={self.num_experts} (got {self.top_k})"
            )
        self.score_func = config.moe_score
        self.norm_topk = config.moe_norm_topk
        self.balance = config.moe_balance
        self.balance_scope = config.moe_balance_scope
        self.aux_coef = config.moe_aux_coef
        self.bias_rate = config.moe_bias_rate
        self.capacity_factor = config.moe_capacity_factor
        self.capacity_group = config.moe_capacity_group
        self.num_groups = config.moe_groups
        self.max_groups = config.moe_max_groups if config.moe_max_groups < config.moe_groups else 0
        hidden = config.expert_ffn_dim
        self.router = nn.Linear(config.dim, self.num_experts, bias=False)
        self.experts = GroupedExperts(self.num_experts, config.dim, hidden, config.mlp)
        self.shared_experts = None
        self.shared_gate = None
        if config.moe_shared_experts > 0:
            self.shared_experts = FeedForward(config.dim, config.shared_ffn_dim, config.mlp)
            if config.moe_shared_gate:
                self.shared_gate = nn.Linear(config.dim, 1, bias=False)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts), persistent=True)
        self.last_stats: dict[str, torch.Tensor] = {}
        self._step_stats: dict[str, torch.Tensor] = {}
        self.record_step_stats = True
        """False while evaluating: forwards then leave the step's load statistics alone."""
        self.sequence_comm = None
        """The ranks that each hold part of every sequence of this micro-batch (context
        parallelism; a :class:`~meshtrain.parallel.comm.CountedComm`), over which the aux loss's
        statistics are summed so it is the whole micro-batch's; None = this rank has it all."""
        self.batch_comm = None
        """``global-batch`` scope: the ranks whose tokens make up the step's batch with this
        rank's (dp × cp), over which the first training forward of a step sums its counts into
        :attr:`global_load` (one all-reduce); None = this forward's tokens are the whole batch."""
        self.global_load: torch.Tensor | None = None
        """``global-batch`` scope: the step's assignments per expert over every micro-batch and
        rank (before capacity dropping), set by the trainer before the step's forwards (or by
        the first forward over :attr:`batch_comm`), cleared when the step starts."""
        self.load_tally: torch.Tensor | None = None
        """When a LongTensor [E], every forward adds its assignments per expert to it (the
        trainer's routing pre-pass)."""

    def _check_sequence_split(self, seq_len: int | None) -> None:
        """Under context parallelism a rank holds two chunks of each sequence: capacity groups
        must lie inside one chunk (validation refuses other configs before a run starts)."""
        split = self.sequence_comm is not None and self.sequence_comm.active
        if not split or self.capacity_factor <= 0 or seq_len is None:
            return
        chunk = seq_len // 2
        if not self.capacity_group or chunk % self.capacity_group:
            raise ValueError(
                f"moe_capacity_group = {self.capacity_group} does not divide this rank's sequence "
                f"chunk of {chunk} tokens (context parallelism)")

    def reset_buffers(self) -> None:
        """Zero the selection bias (fp32) and forget the last statistics."""
        with torch.no_grad():
            self.expert_bias = torch.zeros(
                self.num_experts, device=self.expert_bias.device, dtype=torch.float32
            )
        self.last_stats = {}
        self._step_stats = {}

    def route(self, x: torch.Tensor, seq_len: int | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Choose experts for tokens ``x`` [T, dim] (whole sequences of ``seq_len`` tokens;
        None = one sequence).

        Router logits and scores are computed in fp32; scores are ``softmax`` over experts or an
        independent ``sigmoid`` each (``config.moe_score``). Experts are selected by top-k of
        ``scores + expert_bias`` (the bias steers selection only). Gate weights are the unbiased
        scores of the chosen experts, renormalised to sum to 1 (``moe_norm_topk``, the default)
        for sigmoid, and for softmax when ``top_k > 1``; with softmax and ``top_k == 1`` the
        gate is the raw probability (Switch Transformer), which is what gives the router its
        gradient. With ``moe_norm_topk = False`` the gates are the raw scores (Qwen-MoE's
        ``norm_topk_prob = false``).

        With node-limited routing (``moe_max_groups``) the selection is restricted to each
        token's best groups first (:meth:`limit_to_groups`).

        Returns ``indices`` [T, k] (long), ``weights`` [T, k] (fp32) and a stats dict with
        ``tokens_per_expert`` [E], ``aux_loss`` (scalar) and ``balance`` (this forward's
        :func:`~meshtrain.model.moe_balance.forward_balance_stats`).
        """
        logits = F.linear(x.float(), self.router.weight.float())
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        biased = scores.detach() + self.expert_bias.float()
        if self.max_groups:
            biased = self.limit_to_groups(biased)
        indices = torch.topk(biased, self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk and (self.score_func == "sigmoid" or self.top_k > 1):
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        tokens_per_expert = count_values(indices.flatten(), self.num_experts)
        if self.load_tally is not None:
            self.load_tally += tokens_per_expert
        probs = selection_probs(scores, self.score_func)
        stats = {
            "tokens_per_expert": tokens_per_expert,
            "aux_loss": self.aux_loss(scores, tokens_per_expert, indices, seq_len),
            "balance": forward_balance_stats(probs, indices, tokens_per_expert, seq_len,
                                             self.num_experts),
        }
        return indices, weights, stats

    def limit_to_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Node-limited routing (DeepSeek-V3): the ``E`` experts form ``moe_groups`` groups of
        consecutive ids; each token keeps the ``moe_max_groups`` groups with the largest sum of
        their two best selection scores ``biased`` [T, E] (one score when a group has one
        expert), and the experts of the other groups become unselectable (``-inf``)."""
        tokens = biased.shape[0]
        per_group = self.num_experts // self.num_groups
        grouped = biased.view(tokens, self.num_groups, per_group)
        best = torch.topk(grouped, min(2, per_group), dim=-1).values.sum(dim=-1)
        chosen = torch.topk(best, self.max_groups, dim=-1).indices
        keep = torch.zeros(tokens, self.num_groups, dtype=torch.bool, device=biased.device)
        keep.scatter_(1, chosen, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)

    def aux_loss(self, scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                 indices: torch.Tensor | None = None, seq_len: int | None = None,
                 ) -> torch.Tensor:
        """Switch-Transformer balance loss ``coef * E * sum_i f_i * P_i`` at the layer's scope
        (0 unless aux-loss; :mod:`meshtrain.model.moe_balance`).

        ``f_i``: fraction of the assignments that chose expert ``i`` (before capacity dropping;
        no gradient); ``P_i``: mean over tokens of expert ``i``'s router probability (sigmoid
        scores are first normalised to sum to 1 per token). Minimal (= coef) when both are
        uniform. ``micro-batch``: over this forward's ``T`` tokens (``tokens_per_expert``);
        ``sequence``: per sequence of ``seq_len`` tokens (``indices`` [T, k]), averaged over
        the sequences; ``global-batch``: ``f`` of the step's whole batch (:attr:`global_load`)
        with this forward's share of ``P``, so that the step's average over its micro-batches
        is the global-batch loss. Under context parallelism counts are summed over the ranks
        that hold parts of the same sequences, and each rank's ``P`` is its share of the
        sum, so the ranks' losses add up to the whole micro-batch's.
        """
        if self.balance != "aux-loss" or scores.shape[0] == 0:
            return scores.sum() * 0.0
        probs = selection_probs(scores, self.score_func)
        split = self.sequence_comm is not None and self.sequence_comm.active
        share = self.sequence_comm.size if split else 1  # ranks holding parts of a sequence
        if self.balance_scope == "sequence":
            local = seq_len or scores.shape[0]
            counts = sequence_counts(indices, local, self.num_experts)
            if split:
                self.sequence_comm.all_reduce(counts)
            prob_sums = probs.reshape(counts.shape[0], local, self.num_experts).sum(dim=1)
            losses = balance(counts, prob_sums, local * share, self.num_experts)
            return self.aux_coef * losses.mean()
        if self.balance_scope == "global-batch":
            counts = self.step_load(tokens_per_expert)
        else:
            counts = tokens_per_expert
            if split:
                counts = counts.clone()
                self.sequence_comm.all_reduce(counts)
        return self.aux_coef * balance(counts, probs.sum(dim=0), scores.shape[0] * share,
                                       self.num_experts)

    def step_load(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The step's assignments per expert (``global-batch`` scope): :attr:`global_load` when
        known; else this forward's counts summed over :attr:`batch_comm` (one all-reduce, kept
        in :attr:`global_load` for the rest of the step, e.g. a recomputation in backward);
        without a ``batch_comm``, this forward's own counts (its tokens are the batch)."""
        if self.global_load is not None:
            return self.global_load
        if self.batch_comm is None:
            return tokens_per_expert
        load = tokens_per_expert.clone()
        self.batch_comm.all_reduce(load)
        self.global_load = load
        return load

    def capacity(self, num_tokens: int) -> int:
        """Assignments one expert accepts from a routing group of ``num_tokens`` tokens:
        ``ceil(factor * T * k / E)``; 0 means unlimited."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def capacity_keep(self, indices: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Which of the ``T * k`` flattened assignments ``indices`` [T, k] survive capacity.

        The ``T`` tokens are whole sequences of ``seq_len`` positions each, in position order.
        Each sequence is cut into routing groups of ``G`` consecutive positions
        (``moe_capacity_group``, 0 = ``seq_len``; a last, shorter group when ``G`` does not
        divide ``seq_len``); within a group, an expert keeps its first :meth:`capacity` ``(group
        size)`` assignments by position (then by ``k``). Returns a bool mask [T * k].
        """
        num_tokens, k = indices.shape
        device = indices.device
        group = min(self.capacity_group or seq_len, seq_len)
        per_sequence = -(-seq_len // group)
        token = torch.arange(num_tokens, device=device)
        position = token % seq_len
        group_id = (token // seq_len) * per_sequence + position // group
        group_len = torch.clamp(seq_len - (position // group) * group, max=group)
        cap = torch.ceil(self.capacity_factor * group_len.double() * k / self.num_experts)
        key = (group_id.repeat_interleave(k) * self.num_experts + indices.reshape(-1))
        order = torch.argsort(key, stable=True)
        groups = -(-num_tokens // seq_len) * per_sequence
        counts = count_values(key, groups * self.num_experts)
        start = torch.cumsum(counts, 0) - counts
        sorted_key = key[order]
        rank = torch.arange(order.numel(), device=device) - start[sorted_key]
        keep = torch.empty(order.numel(), dtype=torch.bool, device=device)
        keep[order] = rank < cap.repeat_interleave(k)[order]
        return keep

    def compute_experts(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every token of ``x`` [T, dim] through its chosen experts and combine them.

        ``x`` holds whole sequences of ``seq_len`` tokens (None: one sequence of ``T``), which
        capacity groups follow (:meth:`capacity_keep`). Assignments over capacity are dropped
        and contribute nothing; the rest are sorted by expert (stably, so within an expert they
        keep the flattened token order), pushed through :class:`GroupedExperts` (one grouped
        GEMM per product), scaled by their gate weights and summed back per token with
        ``index_add``.

        Returns ``(output [T, dim] in x's dtype, dropped)`` with ``dropped`` a LongTensor scalar.
        """
        num_tokens, k = indices.shape
        flat_expert = indices.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        if self.capacity_factor > 0 and num_tokens:
            keep = self.capacity_keep(indices, seq_len or num_tokens)
            dropped = (~keep).sum()
            # The one read to the host of this path: how many assignments survive.
            order = order[keep[order]]
            counts = count_values(flat_expert, self.num_experts, keep.long())
        else:
            counts = count_values(flat_expert, self.num_experts)
        token_index = order // k
        expert_out = self.experts(x[token_index], counts)
        gate = weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros(num_tokens, x.shape[-1], device=x.device, dtype=torch.float32)
        combined.index_add_(0, token_index, expert_out.float() * gate)
        return combined.to(x.dtype), dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MoE feed-forward to ``x`` [..., dim] and record ``last_stats``."""
        flat = x.reshape(-1, x.shape[-1])
        seq_len = x.shape[-2] if x.dim() >= 3 else None
        indices, weights, stats = self.route(flat, seq_len)
        self._check_sequence_split(seq_len)
        out, dropped = self.compute_experts(flat, indices, weights, seq_len)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        self.last_stats = {
            "tokens_per_expert": stats["tokens_per_expert"],
            "dropped": dropped,
            "aux_loss": stats["aux_loss"],
            **{f"balance_{key}": value for key, value in stats["balance"].items()},
        }
        if self.record_step_stats and not recomputing_in_backward():
            self._accumulate(self.last_stats)
        return out.view_as(x)

    @torch.no_grad()
    def _accumulate(self, stats: dict[str, torch.Tensor]) -> None:
        current = {"tokens_per_expert": stats["tokens_per_expert"].detach().long(),
                   "dropped": stats["dropped"].detach().long(),
                   "aux_loss": stats["aux_loss"].detach().float(),
                   "forwards": torch.ones((), dtype=torch.long, device=self.expert_bias.device),
                   **{key: value for key, value in stats.items()
                      if key.startswith("balance_")}}
        if not self._step_stats:
            self._step_stats = current
        else:
            self._step_stats = {k: self._step_stats[k] + v.to(self._step_stats[k].device)
                                for k, v in current.items()}

    def pop_step_stats(self) -> dict[str, torch.Tensor]:
        """Sums since the last call over every forward: ``tokens_per_expert`` [E] (before capacity
        dropping), ``dropped``, ``aux_loss`` (detached), ``forwards`` and the balance numbers
        ``balance_prob_sum`` [E], ``balance_tokens``, ``balance_micro_batch``,
        ``balance_sequence_sum``, ``balance_sequences``
        (:func:`~meshtrain.model.moe_balance.forward_balance_stats`); then start afresh."""
        device = self.expert_bias.device
        zero = torch.zeros((), device=device)
        stats = self._step_stats or {
            "tokens_per_expert": torch.zeros(self.num_experts, dtype=torch.long, device=device),
            "dropped": torch.zeros((), dtype=torch.long, device=device),
            "aux_loss": zero,
            "forwards": torch.zeros((), dtype=torch.long, device=device),
            "balance_prob_sum": torch.zeros(self.num_experts, device=device),
            **{f"balance_{key}": zero for key in ("tokens", "micro_batch", "sequence_sum",
                                                   "sequences")},
        }
        self._step_stats = {}
        return stats

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing step: ``bias += rate * sign(mean(load) - load)``.

        ``load`` [E] is the tokens each expert received (summed over whatever window the caller
        chooses, e.g. one optimizer step across all ranks). Under-loaded experts move up.
        """
        load = load.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)


def count_values(values: torch.Tensor, size: int,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """How often each of ``0 .. size-1`` occurs in ``values`` (LongTensor [size]; each
    occurrence counted ``weights`` times when given). ``torch.bincount`` would read the
    largest value to the host to size its result; the size is known here, so this does not."""
    ones = torch.ones_like(values) if weights is None else weights
    return torch.zeros(size, dtype=torch.long, device=values.device).scatter_add_(0, values, ones)


def recomputing_in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. when a forward is an activation-checkpoint
    recomputation (its routing repeats one already counted)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def layer_index(module_name: str) -> int:
    """The block number in a module name such as ``layers.3.moe.experts`` (``3``)."""
    parts = module_name.split(".")
    return int(parts[parts.index("layers") + 1])


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` module in ``model``, in module order."""
    return [module for module in model.modules() if isinstance(module, MoE)]
