"""The pipeline action model: what one pipeline rank does, in order, as plain data.

A :class:`Schedule` is one ordered list of :class:`Action` per pipeline-parallel rank plus the
placement of the model's stages (chunks) on ranks. The same lists are checked
(:mod:`.checker`), timed (:mod:`.simulator`), executed by the runtime and drawn
(:mod:`.timeline`); nothing downstream branches on the schedule's name.

Conventions (the executor relies on them):

* ``Action.stage`` is always a *global* stage index in ``[0, pp * virtual_stages)`` held by the
  rank whose list contains the action. For compute actions it is the stage computed; for
  communication it is the stage on *this* rank that produces (send) or consumes (recv) the data:

  - ``SEND_ACT(mb, s)`` on ``rank(s)`` sends the output of stage ``s`` to ``peer = rank(s+1)``;
    it matches ``RECV_ACT(mb, s+1)`` on ``rank(s+1)`` with ``peer = rank(s)``.
  - ``SEND_GRAD(mb, s)`` on ``rank(s)`` sends the gradient w.r.t. the input of stage ``s`` to
    ``peer = rank(s-1)``; it matches ``RECV_GRAD(mb, s-1)`` on ``rank(s-1)``.

* Data between two stages on the same rank is handed over in memory: no send/recv action.
* Consecutive send/recv actions form one exchange, posted together; see :mod:`.message_order`
  for the semantics (NCCL's) that :func:`add_communication` places them for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ActionKind(enum.Enum):
    """What an :class:`Action` does."""

    F = "F"                  # forward of one micro-batch through one stage
    B = "B"                  # full backward: gradients w.r.t. the input and the weights
    I = "I"                  # noqa: E741  backward w.r.t. the input only (zero-bubble split)
    W = "W"                  # backward w.r.t. the weights only, deferred (zero-bubble split)
    SEND_ACT = "SEND_ACT"    # post the stage's output activation to the next stage's rank
    RECV_ACT = "RECV_ACT"    # wait for the previous stage's output activation
    SEND_GRAD = "SEND_GRAD"  # post the gradient w.r.t. the stage's input to the previous rank
    RECV_GRAD = "RECV_GRAD"  # wait for the gradient w.r.t. the stage's output

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        """True for SEND_ACT and SEND_GRAD."""
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        """True for RECV_ACT and RECV_GRAD."""
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
K = ActionKind


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of micro-batch ``microbatch`` on global stage ``stage``.

    ``peer`` is the pipeline rank on the other side of a send/recv and ``None`` for compute.
    ``str(action)`` is compact: ``F3@s1``, ``SEND_ACT3@s1->2``, ``RECV_GRAD3@s1<-2``.
    """

    kind: ActionKind
    microbatch: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.microbatch}@s{self.stage}"
        if self.kind.is_send:
            text += f"->{self.peer}"
        elif self.kind.is_recv:
            text += f"<-{self.peer}"
        return text


@dataclass
class Schedule:
    """A pipeline schedule as data: per-rank ordered action lists and the stage placement.

    ``stage_to_rank[s]`` is the pipeline rank holding global stage ``s``; data flows from stage
    ``s`` to ``s + 1`` in the forward pass and back in the backward pass.
    """

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    stage_to_rank: list[int] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        """Number of model stages (chunks): ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    @property
    def first_stage(self) -> int:
        """The stage that reads the input tokens (always 0)."""
        return 0

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss."""
        return self.num_stages - 1

    @property
    def embedding_ranks(self) -> tuple[int, ...]:
        """The pipeline ranks holding the first and the last stage (one rank when a schedule
        places both on it): where a tied embedding lives."""
        return tuple(sorted({self.rank_of(self.first_stage), self.rank_of(self.last_stage)}))

    def stages_of(self, rank: int) -> list[int]:
        """The global stages (chunks) held by ``rank``, in model order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding global ``stage``."""
        return self.stage_to_rank[stage]

    @property
    def defers_weight_grads(self) -> bool:
        """Whether any rank runs a deferred weight-gradient pass (``W``: the zero-bubble
        schedules, and 1F1B's early gradient sends); only then do the stages' matmuls need the
        deferrable backward."""
        return any(a.kind is ActionKind.W for acts in self.actions for a in acts)

    def compute_actions(self, rank: int) -> list[Action]:
        """``rank``'s F/B/I/W actions in order, without the communication."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def __str__(self) -> str:
        lines = [f"{self.name} pp={self.pp} microbatches={self.microbatches} "
                 f"virtual_stages={self.virtual_stages}"]
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


# A completion key: (what, microbatch, stage). "I" means "gradient w.r.t. the stage input exists"
# and is produced by either a B or an I action.
Key = tuple[str, int, int]


class ScheduleError(ValueError):
    """A pipeline schedule that is incomplete, mismatched or deadlocks."""


def produced_key(action: Action) -> Key:
    """The completion key an action produces once it has run."""
    kind = "I" if action.kind is K.B else action.kind.value
    return (kind, action.microbatch, action.stage)


def dependencies(schedule: Schedule, rank: int, action: Action) -> list[Key]:
    """The completion keys ``action`` on ``rank`` must wait for (the semantics of
    :mod:`.checker`)."""
    mb, s, kind = action.microbatch, action.stage, action.kind
    to_rank = schedule.stage_to_rank
    if kind is K.F:
        if s == schedule.first_stage:
            return []
        return [("F", mb, s - 1) if to_rank[s - 1] == rank else ("RECV_ACT", mb, s)]
    if kind in (K.B, K.I):
        deps: list[Key] = [("F", mb, s)]
        if s != schedule.last_stage:
            deps.append(("I", mb, s + 1) if to_rank[s + 1] == rank else ("RECV_GRAD", mb, s))
        return deps
    if kind is K.W:
        return [("I", mb, s)]
    if kind is K.SEND_ACT:
        return [("F", mb, s)]
    if kind is K.SEND_GRAD:
        return [("I", mb, s)]
    if kind is K.RECV_ACT:
        return [("SEND_ACT", mb, s - 1)]
    return [("SEND_GRAD", mb, s + 1)]  # RECV_GRAD


def standard_placement(pp: int, virtual_stages: int) -> list[int]:
    """Round-robin placement: stage ``s`` on rank ``s % pp`` (rank r holds r, r+pp, r+2pp, ...)."""
    return [s % pp for s in range(pp * virtual_stages)]


def v_placement(pp: int) -> list[int]:
    """The V placement of ZB-V: rank ``r`` holds stages ``r`` and ``2*pp - 1 - r``.

    The first and the last stage are both on rank 0, and stages ``pp-1`` and ``pp`` (the turn of
    the V) are both on rank ``pp-1``, where the activation is handed over without communication.
    """
    return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]


# Costs used to place the exchanges: one unit per F, I and W (a full B is two), the uniform
# costs the builders' orders are designed for.
_PLACEMENT_COST = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


def _reference_times(compute: list[list[Action]], schedule: Schedule) -> list[list[float]]:
    """Start time of every compute action when each starts as soon as its rank is free and its
    inputs exist (transfers free); raises :class:`ScheduleError` if the orders deadlock."""
    pp = schedule.pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    ready: dict[Key, float] = {}
    free = [0.0] * pp
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while len(starts[rank]) < len(compute[rank]):
                act = compute[rank][len(starts[rank])]
                deps = [("F" if d[0] == "RECV_ACT" else "I", d[1],
                         d[2] - 1 if d[0] == "RECV_ACT" else d[2] + 1)
                        if d[0].startswith("RECV") else d
                        for d in dependencies(schedule, rank, act)]
                if any(d not in ready for d in deps):
                    break
                start = max([free[rank], *(ready[d] for d in deps)])
                free[rank] = start + _PLACEMENT_COST[act.kind]
                ready[produced_key(act)] = free[rank]
                starts[rank].append(start)
                progress = True
    stuck = [f"rank {r} at {compute[r][len(starts[r])]}" for r in range(pp)
             if len(starts[r]) < len(compute[r])]
    if stuck:
        raise ScheduleError("inconsistent compute orders, no rank can go on: " + "; ".join(stuck))
    return starts


def add_communication(compute: list[list[Action]], stage_to_rank: list[int]) -> list[list[Action]]:
    """Insert the send/recv actions around per-rank compute orders, correct under NCCL.

    The compute orders are first timed at unit costs (each action starts as soon as its inputs
    exist). Each send goes right after the compute that produces its data, at time ``T``; its
    receive goes on the other rank right after the last compute that *started* before ``T``,
    so it is posted no earlier than needed for that rank's next compute and the data is there
    when that compute starts. Consecutive send/recv actions form one exchange, posted together.
    Hence (see :mod:`.message_order`):

    * between any two ranks the receives come in the order of the sends (sending time), as
      NCCL's untagged, in-order matching needs;
    * every send's receive is posted by a rank that, at ``T``, is already running the compute
      before it, so the lists complete even when every send waits for its receive.

    A receive may thus come some actions before the compute that consumes it. Raises
    :class:`ScheduleError` when the compute orders themselves are inconsistent.
    """
    pp, last = len(compute), len(stage_to_rank) - 1
    schedule = Schedule("", pp, 1, len(stage_to_rank) // pp, [], stage_to_rank)
    starts = _reference_times(compute, schedule)
    after: list[list[list[Action]]] = [[[] for _ in range(len(c) + 1)] for c in compute]
    recvs: list[list[list[tuple[float, Action]]]] = [[[] for _ in range(len(c) + 1)]
                                                     for c in compute]
    for rank, order in enumerate(compute):
        for k, act in enumerate(order):
            mb, s = act.microbatch, act.stage
            if act.kind is K.F and s < last and stage_to_rank[s + 1] != rank:
                send, recv = Action(K.SEND_ACT, mb, s, stage_to_rank[s + 1]), \
                    Action(K.RECV_ACT, mb, s + 1, rank)
            elif act.kind in (K.B, K.I) and s > 0 and stage_to_rank[s - 1] != rank:
                send, recv = Action(K.SEND_GRAD, mb, s, stage_to_rank[s - 1]), \
                    Action(K.RECV_GRAD, mb, s - 1, rank)
            else:
                continue
            sent_at = starts[rank][k] + _PLACEMENT_COST[act.kind]
            after[rank][k + 1].append(send)
            slot = sum(1 for t in starts[send.peer] if t < sent_at)
            recvs[send.peer][slot].append((sent_at, recv))
    result = []
    for rank, order in enumerate(compute):
        out: list[Action] = []
        for k in range(len(order) + 1):
            out += after[rank][k]
            out += [recv for _, recv in sorted(recvs[rank][k], key=lambda x: (x[0], x[1].peer))]
            if k < len(order):
                out.append(order[k])
        result.append(out)
    return result
