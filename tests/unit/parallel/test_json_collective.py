"""Object collectives travel as JSON, never pickled (:func:`meshtrain.parallel.comm.gather_json`,
:meth:`~meshtrain.parallel.comm.CountedComm.all_gather_json`): values round-trip between two
gloo ranks, the comm log counts the call as before, the debug check still names each rank's
call, and no pickling object collective is left in the package."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.distributed as dist

import meshtrain
from meshtrain.errors import CollectiveMismatchError
from meshtrain.parallel.comm import CommLog, CountedComm, gather_json
from tests.distributed import run_distributed

PACKAGE = Path(meshtrain.__file__).resolve().parent


def _value(rank: int):
    """Values of different lengths per rank, with what JSON changes (tuples) and keeps."""
    if rank == 0:
        return {"rank": 0, "pair": (1, "two"), "none": None, "ok": True, "x": 1.5, "text": "é😀"}
    return ["rank one", "y" * 5000, [[], {}], -3]


def _round_trips() -> dict:
    rank = dist.get_rank()
    log = CommLog()
    comm = CountedComm("dp", dist.new_group([0, 1]), 2, log)
    gathered = comm.all_gather_json(_value(rank))
    refused = None
    try:
        comm.all_gather_json({"bytes": b"\x00"})  # both ranks: refused before sending
    except TypeError as error:
        refused = str(error)
    return {"gathered": gathered, "world": gather_json([rank, "w"], None, 2),
            "calls": dict(log.calls), "bytes": dict(log.bytes),
            "recent": [(r.op, r.done, r.bus_bytes) for r in log.recent], "refused": refused}


def test_values_round_trip_between_two_ranks_as_json():
    results = run_distributed(2, _round_trips)
    expected = [{"rank": 0, "pair": [1, "two"], "none": None, "ok": True, "x": 1.5,
                 "text": "é😀"}, _value(1)]
    for rank, result in enumerate(results):
        assert result["gathered"] == expected, rank
        assert result["world"] == [[0, "w"], [1, "w"]]
        # counted as the object all-gather always was: a call, no bus bytes, done
        assert result["calls"] == {"dp": 1} and result["bytes"] == {"dp": 0}
        assert result["recent"] == [("all_gather_object", True, 0)]  # refused: not issued
        assert "bytes is not JSON serializable" in result["refused"]


def test_one_rank_gets_its_own_value_back_uncounted():
    log = CommLog()
    value = {"pair": (1, 2)}
    assert CountedComm("dp", None, 1, log).all_gather_json(value) == [value]
    assert not log.calls and not log.recent


def _mismatch() -> str:
    rank = dist.get_rank()
    log = CommLog()
    log.debug = True
    comm = CountedComm("dp", dist.new_group([0, 1]), 2, log)
    comm.all_reduce(torch.ones(3))  # the same call on both ranks: checked, then issued
    try:
        comm.all_reduce(torch.ones(1 + rank))
    except CollectiveMismatchError as error:
        return str(error)
    return "no mismatch found"


def test_the_debug_check_still_names_each_ranks_call():
    for message in run_distributed(2, _mismatch):
        assert "collective mismatch on the dp group (ranks 0, 1)" in message, message
        assert "rank 0 calls #2 all_reduce (1,) float32 at" in message
        assert "rank 1 calls #2 all_reduce (2,) float32 at" in message


OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}


def test_no_pickling_object_collective_is_called_in_the_package():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in OBJECT_COLLECTIVES):
                found.add(str(path.relative_to(PACKAGE)))
    assert not found, sorted(found)
