"""Pipeline schedules as data: the five builders, their placement and the static checker."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import ConfigError
from meshtrain.parallel.pipeline import (
    Action,
    ActionKind,
    ScheduleError,
    StageTimes,
    build_schedule,
    check_schedule,
    simulate,
)
from tests.helpers import adjacent_communication

K = ActionKind

CASES = (
    [("gpipe", p, m, 1) for p, m in [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 8)]]
    + [("1f1b", p, m, 1) for p, m in [(1, 1), (1, 4), (2, 1), (3, 2), (4, 4), (4, 9)]]
    + [("interleaved-1f1b", p, m, v)
       for p, m, v in [(1, 2, 2), (2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 4)]]
    + [("zb-h1", p, m, 1) for p, m in [(1, 1), (1, 3), (2, 1), (3, 2), (4, 4), (4, 9)]]
    + [("zb-v", p, m, 2) for p, m in [(1, 1), (1, 3), (2, 1), (3, 2), (4, 5), (4, 8)]]
)


def _ids(case):
    return "{}-p{}-m{}-v{}".format(*case)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_schedule_checks_and_simulates(case):
    name, pp, m, v = case
    schedule = build_schedule(name, pp, m, v)
    assert (schedule.name, schedule.pp, schedule.microbatches, schedule.virtual_stages) == case
    assert schedule.num_stages == pp * v and schedule.last_stage == pp * v - 1
    check_schedule(schedule)
    result = simulate(schedule)
    assert result.makespan > 0 and 0 <= result.bubble_fraction < 1
    split = name.startswith("zb")
    for rank in range(pp):
        kinds = {a.kind for a in schedule.compute_actions(rank)}
        if name == "1f1b" and rank > 0:  # its cool-down backwards split (early gradient sends)
            assert {K.F, K.I, K.W} <= kinds <= {K.F, K.B, K.I, K.W}
        else:
            assert kinds == ({K.F, K.I, K.W} if split else {K.F, K.B})
        for action in schedule.actions[rank]:  # every action works on a chunk of its rank
            assert schedule.stage_to_rank[action.stage] == rank
    if pp == 1:
        assert all(a.kind.is_compute for a in schedule.actions[0])


def test_placements():
    inter = build_schedule("interleaved-1f1b", 4, 4, 3)
    assert inter.stages_of(1) == [1, 5, 9]
    assert inter.stage_to_rank == [s % 4 for s in range(12)]
    zbv = build_schedule("zb-v", 4, 4, 2)
    assert zbv.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    assert zbv.stages_of(0) == [0, 7] and zbv.stages_of(3) == [3, 4]
    # the turn of the V (stages 3 -> 4 on rank 3) is handed over in memory, not sent
    assert not any(a.kind.is_send and a.stage in (3, 4) and a.peer == 3
                   for a in zbv.actions[3])


def test_action_strings_and_communication_placement():
    assert str(Action(K.F, 3, 1)) == "F3@s1"
    assert str(Action(K.SEND_ACT, 3, 1, 2)) == "SEND_ACT3@s1->2"
    assert str(Action(K.RECV_GRAD, 3, 1, 2)) == "RECV_GRAD3@s1<-2"
    schedule = build_schedule("1f1b", 2, 2, early_grad_sends=False)
    assert [str(a) for a in schedule.actions[1]] == [
        "RECV_ACT0@s1<-0", "F0@s1", "RECV_ACT1@s1<-0", "B0@s1", "SEND_GRAD0@s1->0",
        "F1@s1", "B1@s1", "SEND_GRAD1@s1->0"]
    # with early gradient sends the last backward's input gradient leaves before its W
    assert [str(a) for a in build_schedule("1f1b", 2, 2).actions[1]][-4:] == [
        "F1@s1", "I1@s1", "SEND_GRAD1@s1->0", "W1@s1"]
    # a message is received in the exchange of the round it is sent in, even if its consumer
    # (F1 above) comes later; sends are posted right after the compute that produced their data
    acts = schedule.actions[0]
    assert acts[acts.index(Action(K.F, 0, 0)) + 1] == Action(K.SEND_ACT, 0, 0, 1)


def test_1f1b_order_and_peak_memory():
    schedule = build_schedule("1f1b", 4, 8)
    order = [str(a) for a in schedule.compute_actions(1)]
    assert order[:6] == ["F0@s1", "F1@s1", "F2@s1", "B0@s1", "F3@s1", "B1@s1"]
    for pp, m in [(2, 2), (4, 8), (4, 4), (3, 7)]:
        assert simulate(build_schedule("1f1b", pp, m)).peak_inflight == [pp - r for r in range(pp)]
        assert simulate(build_schedule("zb-h1", pp, m)).peak_inflight == \
            [pp - r for r in range(pp)]
        assert simulate(build_schedule("gpipe", pp, m)).peak_inflight == [m] * pp


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (3, 2), (4, 8), (4, 9), (8, 16)])
def test_1f1b_splits_the_backwards_the_previous_rank_waits_for(pp, m):
    """Early gradient sends: the same F/B order as the paper's 1F1B with every backward from
    a rank's last steady one on (its cool-down) split into I, the send, W, on every rank but
    the first; the makespan drops by (p-1)·w where w <= f, never rises, and the peak
    activations stay 1F1B's."""
    plain = build_schedule("1f1b", pp, m, early_grad_sends=False)
    early = build_schedule("1f1b", pp, m)
    check_schedule(early)
    for rank in range(pp):
        whole = [str(a) for a in plain.compute_actions(rank)]
        merged = [str(a).replace("I", "B") for a in early.compute_actions(rank)
                  if a.kind is not K.W]
        assert merged == whole  # the same order of forwards and backwards
        split = [a.microbatch for a in early.compute_actions(rank) if a.kind is K.I]
        warmup = min(pp - rank - 1, m)
        assert split == ([] if rank == 0 else list(range(max(m - warmup - 1, 0), m)))
        acts = early.actions[rank]
        for k in split:  # the gradient is sent between the I and the W
            i, w = acts.index(Action(K.I, k, rank)), acts.index(Action(K.W, k, rank))
            assert w > i + 1 and all(a.kind.is_send for a in acts[i + 1:w])
    assert simulate(early).peak_inflight == simulate(plain).peak_inflight
    for f, b, w in [(1, 1, 1), (1, 2, 1), (2, 1.5, 0.5), (1, 1, 2)]:
        times = StageTimes(f=f, b=b, w=w)
        faster, slower = simulate(early, times).makespan, simulate(plain, times).makespan
        assert slower == pytest.approx((m + pp - 1) * (f + b + w))
        if w <= f:
            assert faster == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b))
        assert faster <= slower + 1e-9


def test_zb_v_memory_is_bounded_by_1f1b_peak():
    for pp, m in [(2, 8), (4, 8), (4, 13)]:
        schedule = build_schedule("zb-v", pp, m, 2)
        assert max(simulate(schedule).peak_inflight) <= 2 * pp  # chunk activations, 1F1B's p
        for rank in range(pp):
            deferred = peak = 0
            for a in schedule.compute_actions(rank):
                deferred += (a.kind is K.I) - (a.kind is K.W)
                peak = max(peak, deferred)
            assert peak <= 2 * pp


@pytest.mark.parametrize("name, pp, m, v, message", [
    ("pipedream", 2, 2, 1, "valid: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v"),
    ("1f1b", 0, 2, 1, "pp must be an integer >= 1"),
    ("1f1b", 2, 0, 1, "microbatches must be an integer >= 1"),
    ("1f1b", 2, 4, 2, "needs virtual_stages = 1"),
    ("gpipe", 2, 4, 3, "needs virtual_stages = 1"),
    ("zb-h1", 2, 4, 2, "needs virtual_stages = 1"),
    ("interleaved-1f1b", 2, 4, 1, "needs virtual_stages >= 2"),
    ("interleaved-1f1b", 4, 6, 2, "divisible by pp"),
    ("zb-v", 2, 4, 1, "virtual_stages = 2"),
    ("zb-v", 2, 4, 3, "virtual_stages = 2"),
])
def test_invalid_combinations_are_config_errors(name, pp, m, v, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(name, pp, m, v)


def _replace(schedule, rank, actions):
    lists = [list(a) for a in schedule.actions]
    lists[rank] = actions
    return dataclasses.replace(schedule, actions=lists)


def test_dropped_backward_is_rejected():
    schedule = build_schedule("1f1b", 2, 3, early_grad_sends=False)
    acts = [a for a in schedule.actions[1] if a != Action(K.B, 2, 1)]
    with pytest.raises(ScheduleError,
                       match=r"rank 1: micro-batch 2 on stage 1 is never backwarded"):
        check_schedule(_replace(schedule, 1, acts))


def test_missing_w_and_duplicate_forward_are_rejected():
    schedule = build_schedule("zb-h1", 2, 2)
    acts = [a for a in schedule.actions[0] if a != Action(K.W, 1, 0)]
    with pytest.raises(ScheduleError, match="has I1@s0 but no W1@s0"):
        check_schedule(_replace(schedule, 0, acts))
    acts = list(schedule.actions[0]) + [Action(K.F, 0, 0)]
    with pytest.raises(ScheduleError, match="F0@s0 appears 2 times"):
        check_schedule(_replace(schedule, 0, acts))


def test_backward_before_forward_is_rejected():
    schedule = build_schedule("gpipe", 1, 2)
    acts = [Action(K.B, 0, 0), Action(K.F, 0, 0), Action(K.F, 1, 0), Action(K.B, 1, 0)]
    with pytest.raises(ScheduleError, match=r"rank 0 action #0 B0@s0: backward before"):
        check_schedule(_replace(schedule, 0, acts))


def test_swapped_send_and_recv_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    acts = list(schedule.actions[0])
    send = acts.index(Action(K.SEND_ACT, 0, 0, 1))
    recv = acts.index(Action(K.RECV_GRAD, 0, 0, 1))
    # wait for micro-batch 0's gradient before sending its activation: rank 1 can never reply
    acts.insert(send, acts.pop(recv))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        check_schedule(_replace(schedule, 0, acts))
    text = str(info.value)
    assert "rank 0 blocked at action #1 RECV_GRAD0@s0<-1 waiting for SEND_GRAD0@s1" in text
    assert "rank 1 blocked at action #0 RECV_ACT0@s1<-0 waiting for SEND_ACT0@s0" in text


def test_inconsistent_compute_orders_deadlock():
    schedule = build_schedule("gpipe", 2, 2)
    acts = list(schedule.actions[0])  # rank 0 waits for gradient 1 before sending activation 1
    acts.insert(acts.index(Action(K.F, 1, 0)), acts.pop(acts.index(Action(K.RECV_GRAD, 1, 0, 1))))
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(_replace(schedule, 0, acts))


def _adjacent_communication(schedule):
    """The schedule's compute with gloo-only communication placement (tests.helpers)."""
    compute = [schedule.compute_actions(r) for r in range(schedule.pp)]
    return dataclasses.replace(schedule, actions=adjacent_communication(compute,
                                                                        schedule.stage_to_rank))


def test_swapped_messages_between_a_pair_are_rejected():
    """ZB-V at pp 2 with receives placed right before their consumers: rank 0 sends ACT2
    before GRAD0 while rank 1 receives GRAD0 first; under NCCL (untagged, in order) the two
    same-shaped tensors would be swapped silently."""
    with pytest.raises(ScheduleError) as info:
        check_schedule(_adjacent_communication(build_schedule("zb-v", 2, 4, 2)))
    text = str(info.value)
    assert "messages from rank 0 to rank 1 are out of order" in text
    assert "SEND_ACT2@s0->1" in text and "micro-batch 2" in text
    assert "RECV_GRAD0@s2<-0" in text and "micro-batch 0" in text
    # rank 1 forwarding micro-batch 1 before 0 (tags would sort this out; NCCL cannot)
    schedule = build_schedule("gpipe", 2, 2)
    acts = list(schedule.actions[1])
    a, b = acts.index(Action(K.RECV_ACT, 0, 1, 0)), acts.index(Action(K.RECV_ACT, 1, 1, 0))
    acts[a:a + 2], acts[b:b + 2] = acts[b:b + 2], acts[a:a + 2]
    with pytest.raises(ScheduleError, match=r"rank 0's message #1, SEND_ACT0@s0->1 .* rank 1's "
                                            r"receive #1, RECV_ACT1@s1<-0"):
        check_schedule(_replace(schedule, 1, acts))


def test_sends_that_wait_for_their_receives_deadlock():
    """Interleaved 1F1B with unbatched sends: both neighbours send first and wait."""
    with pytest.raises(ScheduleError, match="deadlock when sends wait for their receives") as e:
        check_schedule(_adjacent_communication(build_schedule("interleaved-1f1b", 2, 4, 2)))
    assert "rank 0 blocked in the exchange" in str(e.value)
    assert "rank 1 blocked in the exchange" in str(e.value)
    # gloo's semantics (tagged, buffered sends) accept these same lists
    from meshtrain.parallel.pipeline.checker import execution_order

    list(execution_order(_adjacent_communication(build_schedule("interleaved-1f1b", 2, 4, 2))))


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-v", 2),
                                     ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                     ("interleaved-1f1b", 4)])
def test_every_size_is_correct_under_nccl_semantics(name, v):
    """Message order and unbuffered completion (part of check_schedule) for pp 2, 3, 4, 8 and
    micro-batches from pp to 4·pp."""
    for pp in (2, 3, 4, 8):
        for m in range(pp, 4 * pp + 1):
            if name == "interleaved-1f1b" and m % pp:
                continue
            check_schedule(build_schedule(name, pp, m, v))


def test_send_without_recv_and_wrong_peer_are_rejected():
    schedule = build_schedule("1f1b", 3, 2)
    acts = [a for a in schedule.actions[1] if a != Action(K.RECV_ACT, 1, 1, 0)]
    with pytest.raises(ScheduleError, match=r"rank 1 lacks RECV_ACT1@s1<-0, the other half of "
                                            r"SEND_ACT1@s0->1 on rank 0"):
        check_schedule(_replace(schedule, 1, acts))
    acts = [Action(K.SEND_ACT, a.microbatch, a.stage, 2) if a.kind is K.SEND_ACT else a
            for a in schedule.actions[0]]
    with pytest.raises(ScheduleError, match="wrong peer 2: stage 1 is on rank 1"):
        check_schedule(_replace(schedule, 0, acts))
    acts = list(schedule.actions[2]) + [Action(K.SEND_ACT, 0, 2, 0)]
    with pytest.raises(ScheduleError, match="no neighbour stage 3"):
        check_schedule(_replace(schedule, 2, acts))


def test_send_before_its_compute_and_foreign_stage_are_rejected():
    schedule = build_schedule("1f1b", 2, 1)
    acts = list(schedule.actions[0])
    acts.insert(0, acts.pop(acts.index(Action(K.SEND_ACT, 0, 0, 1))))
    with pytest.raises(ScheduleError, match="sent before F0@s0 produced its data"):
        check_schedule(_replace(schedule, 0, acts))
    acts = list(schedule.actions[0]) + [Action(K.F, 0, 1)]
    with pytest.raises(ScheduleError, match="stage 1 is held by rank 1, not rank 0"):
        check_schedule(_replace(schedule, 0, acts))
