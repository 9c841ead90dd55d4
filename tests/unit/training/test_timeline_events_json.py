"""Measured pipeline events cross the pp group as JSON (:mod:`meshtrain.training.timeline_report`):
every action kind, with and without a peer, comes back as the same event."""

from __future__ import annotations

import json

from meshtrain.parallel.pipeline.schedule import Action, ActionKind
from meshtrain.training.timeline_report import (
    event_from_json,
    event_to_json,
    measured_bubble,
    stage_times_from,
)


def test_events_round_trip_through_json():
    events = [(rank, Action(kind, microbatch=3, stage=1,
                            peer=2 if kind.is_send or kind.is_recv else None), 0.5 + rank, 1.25)
              for rank, kind in enumerate(ActionKind)]
    sent = json.loads(json.dumps([event_to_json(e) for e in events]))
    back = [event_from_json(e) for e in sent]
    assert back == events
    assert all(isinstance(action, Action) for _, action, _, _ in back)
    assert measured_bubble(back, 2) == measured_bubble(events, 2)


def test_stage_times_take_whole_and_split_backwards_together():
    """1F1B with early gradient sends runs whole B and split I + W on one rank: b is the mean
    of every I and every B less the mean W; a rank of whole B's alone keeps b = B."""
    K = ActionKind
    events = [(1, Action(K.F, 0, 1), 0.0, 2.0), (1, Action(K.B, 0, 1), 2.0, 7.0),
              (1, Action(K.F, 1, 1), 7.0, 9.0), (1, Action(K.B, 1, 1), 9.0, 14.0),
              (1, Action(K.F, 2, 1), 14.0, 16.0), (1, Action(K.I, 2, 1), 16.0, 20.0),
              (1, Action(K.W, 2, 1), 20.0, 22.0),
              (0, Action(K.F, 0, 0), 0.0, 1.0), (0, Action(K.B, 0, 0), 3.0, 6.0)]
    stage0, stage1 = stage_times_from(events, 2)
    assert (stage1.f, stage1.w) == (2.0, 2.0)
    assert stage1.b == (3.0 + 3.0 + 4.0) / 3  # B 5 - W 2, twice, and I 4
    assert (stage0.f, stage0.b, stage0.w) == (1.0, 3.0, 0.0)
