"""The five pipeline schedules, built as data: ``build_schedule(name, pp, microbatches, v)``.

Each builder decides the order of the compute actions (F, B or I/W) on every rank;
:func:`~.schedule.add_communication` then places the sends and receives so the lists are correct
under NCCL's ordered, untagged matching and rendezvous sends. Orders follow the papers:

* ``gpipe`` — all forwards, then all backwards (Huang et al. 2019).
* ``1f1b`` — warm-up of ``pp - rank - 1`` forwards, steady one-forward-one-backward, cool-down
  (Narayanan et al. 2021, non-interleaved; PipeDream-Flush). With ``early_grad_sends`` (the
  default) every rank but the first splits the backwards the previous rank waits for at the end
  (the last steady one and the cool-down ones) into ``I``, the gradient's send, then ``W`` at
  once: the same order and activation memory, and each of the ``pp - 1`` hand-overs of the
  cool-down comes a weight-gradient pass earlier (makespan ``m(f+b+w) + (p-1)(f+b)`` for
  ``w <= f``, against ``(m+p-1)(f+b+w)``).
* ``interleaved-1f1b`` — ``virtual_stages`` chunks per rank, round-robin placement, the
  Megatron-LM order (Narayanan et al. 2021, 2.2).
* ``zb-h1`` — 1F1B with the backward split into ``I`` and ``W``; rank ``r`` defers its ``W`` by
  ``r`` micro-batches so they fill the cool-down (Qi et al. 2024, ZB-H1): same activation memory
  as 1F1B, bubble ``(p-1)/(3m+p-1)`` when ``f = b = w``.
* ``zb-v`` — two chunks per rank in a V (rank ``r`` holds stages ``r`` and ``2p-1-r``), I/W split,
  ordered by a unit-time list scheduler (see :func:`_zb_v_orders`) in the spirit of Qi et al.
  2024's ZB-V: at most ``2p`` chunk activations per rank (1F1B's peak) and at most ``2p`` deferred
  ``W`` per rank.
"""

from __future__ import annotations

from collections.abc import Callable

from meshtrain.config import ConfigError
from meshtrain.config.layout import PP_SCHEDULES
from meshtrain.config.layout_rules import check_interleaved_microbatches
from meshtrain.parallel.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    add_communication,
    standard_placement,
    v_placement,
)

K = ActionKind
Orders = list[list[Action]]


def _f(mb: int, stage: int) -> Action:
    return Action(K.F, mb, stage)


def _b(mb: int, stage: int) -> Action:
    return Action(K.B, mb, stage)


def _gpipe_orders(pp: int, m: int) -> Orders:
    return [[_f(i, r) for i in range(m)] + [_b(i, r) for i in range(m)] for r in range(pp)]


def _one_f_one_b(warmup: int, total: int, fwd: Callable[[int], list[Action]],
                 bwd: Callable[[int], list[Action]]) -> list[Action]:
    """warm-up forwards, then (forward, backward) pairs, then the remaining backwards."""
    warmup = min(warmup, total)
    order: list[Action] = []
    for k in range(warmup):
        order += fwd(k)
    for k in range(total - warmup):
        order += fwd(warmup + k) + bwd(k)
    for k in range(total - warmup, total):
        order += bwd(k)
    return order


def _1f1b_orders(pp: int, m: int, early_grad_sends: bool) -> Orders:
    """1F1B; with ``early_grad_sends``, rank ``r > 0`` runs backward ``k`` as ``I`` then ``W``
    for the micro-batches from its last steady backward on (``k >= m - warmup - 1``): the
    previous rank is idle until that gradient arrives."""
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)

        def bwd(k: int, r: int = r, first_split: int = m - warmup - 1) -> list[Action]:
            if early_grad_sends and r > 0 and k >= first_split:
                return [Action(K.I, k, r), Action(K.W, k, r)]
            return [_b(k, r)]

        orders.append(_one_f_one_b(warmup, m, lambda k, r=r: [_f(k, r)], bwd))
    return orders


def _interleaved_orders(pp: int, m: int, v: int) -> Orders:
    """Megatron-LM's interleaved order: micro-batches in groups of ``pp``, chunk by chunk."""

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        mb = (k // (pp * v)) * pp + k % pp
        return (chunk if forward else v - 1 - chunk), mb

    orders = []
    for r in range(pp):
        def fwd(k: int, r: int = r) -> list[Action]:
            chunk, mb = chunk_and_mb(k, True)
            return [_f(mb, chunk * pp + r)]

        def bwd(k: int, r: int = r) -> list[Action]:
            chunk, mb = chunk_and_mb(k, False)
            return [_b(mb, chunk * pp + r)]

        warmup = 2 * (pp - r - 1) + (v - 1) * pp
        orders.append(_one_f_one_b(warmup, m * v, fwd, bwd))
    return orders


def _zb_h1_orders(pp: int, m: int) -> Orders:
    """1F1B's F/I order; after the I of micro-batch k, rank r runs the W of micro-batch k - r."""
    orders = []
    for r in range(pp):
        lag = r
        warmup = min(pp - r - 1, m)
        order = [_f(k, r) for k in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                order.append(_f(warmup + k, r))
            order.append(Action(K.I, k, r))
            if k - lag >= 0:
                order.append(Action(K.W, k - lag, r))
                next_w = k - lag + 1
        order += [Action(K.W, k, r) for k in range(next_w, m)]
        orders.append(order)
    return orders


def _zb_v_orders(pp: int, m: int) -> Orders:
    """List-schedule the V placement in unit time steps (f = b = w = 1 per chunk).

    Whenever rank r is free it starts, in this priority: the oldest deferred W if ``2p`` are
    pending; else a ready I (oldest micro-batch, the later chunk first); else a ready F (the
    later chunk first, then the oldest micro-batch) if activation memory allows — below ``2p``
    live chunk activations, and below ``2p - 1`` to open a new micro-batch on the first chunk,
    which keeps a slot for the second chunk; else the oldest pending W; else it idles.
    """
    n, last, memory = 2 * pp, 2 * pp - 1, 2 * pp
    done_at: dict[tuple[ActionKind, int, int], int] = {}  # (kind, mb, stage) -> end time

    def finished(kind: ActionKind, mb: int, stage: int, now: int) -> bool:
        return done_at.get((kind, mb, stage), now + 1) <= now

    busy_until = [0] * pp
    orders: Orders = [[] for _ in range(pp)]
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (mb, stage) awaiting W
    live = [0] * pp  # chunk activations held (F done, I not yet)
    next_f = [[0, 0] for _ in range(pp)]  # next micro-batch to forward, per chunk
    next_i = [[0, 0] for _ in range(pp)]  # next micro-batch to backward, per chunk
    remaining, now = 3 * n * m, 0
    while remaining:
        for r in range(pp):
            if busy_until[r] > now:
                continue
            fwd, bwd = [], []
            for chunk, s in enumerate((r, last - r)):
                mb = next_f[r][chunk]
                limit = memory - 1 if chunk == 0 else memory
                if mb < m and live[r] < limit and (s == 0 or finished(K.F, mb, s - 1, now)):
                    fwd.append((-chunk, mb, chunk, s))
                mb = next_i[r][chunk]
                if (mb < m and finished(K.F, mb, s, now)
                        and (s == last or finished(K.I, mb, s + 1, now))):
                    bwd.append((mb, -chunk, chunk, s))
            if len(deferred[r]) >= memory or (deferred[r] and not fwd and not bwd):
                kind, (mb, s) = K.W, deferred[r].pop(0)
            elif bwd:
                kind, (mb, _, chunk, s) = K.I, min(bwd)
                next_i[r][chunk] += 1
                live[r] -= 1
                deferred[r].append((mb, s))
            elif fwd:
                kind, (_, mb, chunk, s) = K.F, min(fwd)
                next_f[r][chunk] += 1
                live[r] += 1
            else:
                continue
            orders[r].append(Action(kind, mb, s))
            done_at[(kind, mb, s)] = now + 1
            busy_until[r] = now + 1
            remaining -= 1
        now += 1
        if now > 6 * n * m + 4 * n:  # pragma: no cover - the policy always progresses
            raise RuntimeError(f"zb-v list scheduler stalled for pp={pp} microbatches={m}")
    return orders


def _validate(name: str, pp: int, m: int, v: int) -> None:
    if name not in PP_SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; valid: {', '.join(PP_SCHEDULES)}")
    for value, what in ((pp, "pp"), (m, "microbatches"), (v, "virtual_stages")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{what} must be an integer >= 1, got {value!r}")
    if name in ("gpipe", "1f1b", "zb-h1") and v != 1:
        raise ConfigError(f"schedule {name} places one stage per rank and needs virtual_stages = "
                          f"1 (got {v}); use interleaved-1f1b for several chunks per rank, or "
                          "zb-v for two")
    if name == "interleaved-1f1b":
        if v < 2:
            raise ConfigError(f"interleaved-1f1b needs virtual_stages >= 2 chunks per rank (got "
                              f"{v}); with one chunk use 1f1b")
        check_interleaved_microbatches(pp, m)
    if name == "zb-v" and v != 2:
        raise ConfigError(f"zb-v places exactly two chunks per rank in a V and needs "
                          f"virtual_stages = 2 (got {v})")


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   early_grad_sends: bool = True) -> Schedule:
    """Build the named schedule for ``pp`` ranks, ``microbatches`` micro-batches per step and
    ``virtual_stages`` chunks per rank; raise :class:`ConfigError` for an invalid combination.
    ``early_grad_sends``: 1F1B splits its cool-down backwards on every rank but the first (see
    the module docstring); False gives the paper's order of whole backwards.

    ``gpipe``, ``1f1b`` and ``zb-h1`` need ``virtual_stages = 1``; ``interleaved-1f1b`` needs
    ``virtual_stages >= 2`` and ``microbatches % pp == 0``; ``zb-v`` needs ``virtual_stages = 2``.
    """
    _validate(name, pp, microbatches, virtual_stages)
    m, v = microbatches, virtual_stages
    placement = v_placement(pp) if name == "zb-v" else standard_placement(pp, v)
    if name == "gpipe":
        orders = _gpipe_orders(pp, m)
    elif name == "1f1b":
        orders = _1f1b_orders(pp, m, early_grad_sends)
    elif name == "interleaved-1f1b":
        orders = _interleaved_orders(pp, m, v)
    elif name == "zb-h1":
        orders = _zb_h1_orders(pp, m)
    else:
        orders = _zb_v_orders(pp, m)
    return Schedule(name=name, pp=pp, microbatches=m, virtual_stages=v,
                    actions=add_communication(orders, placement), stage_to_rank=placement)


def forward_only(schedule: Schedule) -> Schedule:
    """The forward passes of ``schedule``'s placement alone (evaluation): each rank forwards its
    stages in increasing order, every micro-batch through one stage before the next, with
    communication placed as for training. Checked for NCCL's message order and rendezvous sends
    (the backward-completeness rules of :func:`check_schedule` do not apply)."""
    from meshtrain.parallel.pipeline.message_order import check_message_order, check_unbuffered

    orders = [[_f(mb, s) for s in schedule.stages_of(rank) for mb in range(schedule.microbatches)]
              for rank in range(schedule.pp)]
    result = Schedule(name=f"{schedule.name}-forward", pp=schedule.pp,
                      microbatches=schedule.microbatches,
                      virtual_stages=schedule.virtual_stages,
                      actions=add_communication(orders, schedule.stage_to_rank),
                      stage_to_rank=schedule.stage_to_rank)
    check_message_order(result)
    check_unbuffered(result)
    return result


def default_virtual_stages(name: str) -> int:
    """The chunks per rank a schedule uses when none are given: 2 for interleaved-1f1b and zb-v,
    else 1."""
    return 2 if name in ("interleaved-1f1b", "zb-v") else 1
