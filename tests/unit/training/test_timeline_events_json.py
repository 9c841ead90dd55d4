"""Measured pipeline events cross the pp group as JSON (:mod:`meshtrain.training.timeline_report`):
every action kind, with and without a peer, comes back as the same event."""

from __future__ import annotations

import json

from meshtrain.parallel.pipeline.schedule import Action, ActionKind
from meshtrain.training.timeline_report import event_from_json, event_to_json, measured_bubble


def test_events_round_trip_through_json():
    events = [(rank, Action(kind, microbatch=3, stage=1,
                            peer=2 if kind.is_send or kind.is_recv else None), 0.5 + rank, 1.25)
              for rank, kind in enumerate(ActionKind)]
    sent = json.loads(json.dumps([event_to_json(e) for e in events]))
    back = [event_from_json(e) for e in sent]
    assert back == events
    assert all(isinstance(action, Action) for _, action, _, _ in back)
    assert measured_bubble(back, 2) == measured_bubble(events, 2)
