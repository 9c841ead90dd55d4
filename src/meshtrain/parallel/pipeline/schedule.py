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
* Sends are non-blocking (posted and buffered); a recv blocks until the matching send is posted.
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

    def stages_of(self, rank: int) -> list[int]:
        """The global stages (chunks) held by ``rank``, in model order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding global ``stage``."""
        return self.stage_to_rank[stage]

    def compute_actions(self, rank: int) -> list[Action]:
        """``rank``'s F/B/I/W actions in order, without the communication."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def __str__(self) -> str:
        lines = [f"{self.name} pp={self.pp} microbatches={self.microbatches} "
                 f"virtual_stages={self.virtual_stages}"]
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


def standard_placement(pp: int, virtual_stages: int) -> list[int]:
    """Round-robin placement: stage ``s`` on rank ``s % pp`` (rank r holds r, r+pp, r+2pp, ...)."""
    return [s % pp for s in range(pp * virtual_stages)]


def v_placement(pp: int) -> list[int]:
    """The V placement of ZB-V: rank ``r`` holds stages ``r`` and ``2*pp - 1 - r``.

    The first and the last stage are both on rank 0, and stages ``pp-1`` and ``pp`` (the turn of
    the V) are both on rank ``pp-1``, where the activation is handed over without communication.
    """
    return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]


def add_communication(compute: list[list[Action]], stage_to_rank: list[int]) -> list[list[Action]]:
    """Insert the send/recv actions around per-rank compute orders.

    Each recv goes right before the compute that consumes it and each send right after the
    compute that produces it. With non-blocking sends this cannot deadlock unless the compute
    orders themselves are inconsistent (which :func:`~.checker.check_schedule` detects).
    """
    last = len(stage_to_rank) - 1
    result: list[list[Action]] = []
    for rank, order in enumerate(compute):
        out: list[Action] = []
        for act in order:
            mb, s = act.microbatch, act.stage
            if act.kind is ActionKind.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    out.append(Action(ActionKind.RECV_ACT, mb, s, stage_to_rank[s - 1]))
                out.append(act)
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_ACT, mb, s, stage_to_rank[s + 1]))
            elif act.kind in (ActionKind.B, ActionKind.I):
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_GRAD, mb, s, stage_to_rank[s + 1]))
                out.append(act)
                if s > 0 and stage_to_rank[s - 1] != rank:
                    out.append(Action(ActionKind.SEND_GRAD, mb, s, stage_to_rank[s - 1]))
            else:
                out.append(act)
        result.append(out)
    return result
