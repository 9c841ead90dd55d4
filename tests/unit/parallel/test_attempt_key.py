"""The workers' store prefix reads torch elastic's rendezvous round from the agent's store
(:func:`meshtrain.parallel.mesh._attempt_key`) without a general unpickler: a real
``_RendezvousState`` gives its round, a planted state runs nothing and falls back to the restart
count."""

from __future__ import annotations

import base64
import datetime
import os
import pickle

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from meshtrain.host.safe_unpickle import DisallowedGlobal, restricted_loads
from meshtrain.parallel.mesh import RENDEZVOUS_GLOBALS, _attempt_key

KEY = "torch.rendezvous.job"


class _Calls:
    """Pickles as a call of ``target(*args)``: what a planted state does."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _state(round_: int) -> _RendezvousState:
    """A rendezvous state as a running job holds it: participants, waiting and redundant nodes,
    heartbeats and a deadline (aware datetimes)."""
    now = datetime.datetime.now(datetime.UTC)
    state = _RendezvousState()
    state.round, state.complete, state.deadline = round_, True, now + datetime.timedelta(1)
    first, second = _NodeDesc("node-a", 100, 0), _NodeDesc("node-b", 200, 1)
    state.participants = {first: 0, second: 1}
    state.wait_list = {_NodeDesc("node-c", 300, 0)}
    state.redundancy_list = {second}
    state.last_heartbeats = {first: now, second: now}
    return state


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    return dist.HashStore()


def _put(store, value) -> None:
    """What torch's c10d rendezvous backend writes: base64 of the pickled state."""
    store.set(KEY, base64.b64encode(pickle.dumps(value)))


def test_a_real_state_gives_its_round(store):
    assert _attempt_key(store) == "attempt_2"  # no state yet: the restart count
    _put(store, _state(7))
    assert _attempt_key(store) == "round_7"
    back = restricted_loads(pickle.dumps(_state(7)), RENDEZVOUS_GLOBALS)
    assert back.participants.keys() == _state(7).participants.keys()
    assert back.wait_list == {_NodeDesc("node-c", 300, 0)}


def test_a_planted_state_runs_nothing_and_falls_back(store, tmp_path):
    marker = tmp_path / "ran"
    state = _state(7)
    state.closed = _Calls(os.system, f"touch {marker}")  # inside an otherwise real state
    _put(store, state)
    assert _attempt_key(store) == "attempt_2"
    assert not marker.exists()
    with pytest.raises(DisallowedGlobal, match="posix.system"):
        restricted_loads(pickle.dumps(state), RENDEZVOUS_GLOBALS)
    pickle.loads(pickle.dumps(state))  # the payload is armed: a plain unpickler runs it
    assert marker.exists()


@pytest.mark.parametrize("value", [{"round": 9}, [1, 2], b"x", "round_9"])
def test_anything_but_a_rendezvous_state_falls_back(store, value):
    _put(store, value)
    assert _attempt_key(store) == "attempt_2"


def test_garbage_in_the_store_falls_back(store):
    store.set(KEY, b"not base64 of a pickle!")
    assert _attempt_key(store) == "attempt_2"


def test_the_state_torchs_c10d_backend_writes_gives_its_round(monkeypatch):
    """A real rendezvous through torch's c10d backend (what torchrun's agent runs): the state it
    stores reads back with the admitted globals only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "5")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seconds = datetime.timedelta(seconds=1)
    handler = DynamicRendezvousHandler.from_backend(
        run_id="job", store=store, backend=C10dRendezvousBackend(store, "job"), min_nodes=1,
        max_nodes=1, local_addr="127.0.0.1",
        timeout=RendezvousTimeout(join=20 * seconds, last_call=seconds / 20, close=5 * seconds))
    try:
        handler.next_rendezvous()
        assert _attempt_key(store) == f"round_{handler._state_holder.state.round}"
    finally:
        handler.shutdown()
