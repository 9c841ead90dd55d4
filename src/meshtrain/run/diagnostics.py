"""Failure diagnostics: each rank's recent collectives on disk, and one summary for the job.

Every worker of a multi-process run keeps ``RUN_DIR/diagnostics/rank{N}.json`` up to date
(:class:`RankMonitor`): a background thread rewrites it atomically whenever the rank's comm log
changed (at most every few seconds), and the worker writes it a last time when it fails, with the
error and its traceback. A rank stuck anywhere, in a collective or outside one, so leaves behind
what it last did: axis, op, shape, call site, step and a per-axis sequence number.

When a worker fails, the launcher (:func:`explain_failure`) reads every rank's file and prints
one message: for a killed worker the rank and signal; for a collective timeout a hang summary
(:func:`hang_summary`): every rank of a group issues the group's collectives in the same order, so
a rank waiting in collective #k of an axis is waiting for the group's ranks whose count on that
axis is below k. Ranks that are waited for and wait for nobody are the ones that did not arrive.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from meshtrain.config import ConfigError
from meshtrain.errors import CollectiveMismatchError, NonFiniteError, RunFailure

DIR_NAME = "diagnostics"
LAUNCHED_ENV = "MESHTRAIN_LAUNCHED"
"""Set to 1 for workers that meshtrain's own launcher spawned (it prints the summary)."""

# Which failure explains a job best when several ranks failed (lower = more likely the cause).
KIND_PRIORITY = {"config": 0, "mismatch": 1, "nonfinite": 1, "failure": 1, "error": 2,
                 "timeout": 3, "peer_lost": 4}
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "socket closed", "end of file", "eof")


def diagnostics_dir(run_dir: str | Path) -> Path:
    """``RUN_DIR/diagnostics``."""
    return Path(run_dir) / DIR_NAME


def interval_for(timeout_s: float) -> float:
    """How often a rank's file is refreshed: well inside the collective timeout."""
    return max(0.2, min(5.0, timeout_s / 10))


def classify(error: BaseException) -> str:
    """``config``, ``mismatch``, ``nonfinite``, ``failure``, ``timeout``, ``peer_lost`` or
    ``error`` (anything else: most likely a bug, worth its traceback)."""
    if isinstance(error, ConfigError):
        return "config"
    if isinstance(error, CollectiveMismatchError):
        return "mismatch"
    if isinstance(error, NonFiniteError):
        return "nonfinite"
    if isinstance(error, RunFailure):
        return "failure"
    text = str(error).lower()
    if isinstance(error, (RuntimeError, TimeoutError)):
        if "timed out" in text or "timeout" in text:
            return "timeout"
        if any(marker in text for marker in _PEER_LOST):
            return "peer_lost"
    return "error"


# ----------------------------------------------------------------------------- one rank's file


def rank_snapshot(mesh, status: str, error: BaseException | None = None) -> dict:
    """What rank ``mesh.rank`` is doing: its groups, per-axis counts and recent collectives."""
    log = mesh.comm_log
    seq, p2p = dict(log.seq), dict(log.p2p_seq)
    recent = [dataclasses.asdict(record) for record in list(log.recent)]
    axes = {axis: {"ranks": mesh.group_ranks(axis), "seq": seq.get(axis, 0),
                   "p2p_seq": p2p.get(axis, 0)}
            for axis in mesh.comms if mesh.size(axis) > 1}
    axes["world"] = {"ranks": list(range(mesh.world_size)), "seq": seq.get("world", 0),
                     "p2p_seq": 0}
    snap = {"rank": mesh.rank, "world_size": mesh.world_size, "host": socket.gethostname(),
            "pid": os.getpid(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "status": status, "step": log.step, "time": time.time(), "axes": axes,
            "recent": recent}
    if error is not None:
        snap.update(kind=classify(error), error=f"{type(error).__name__}: {error}",
                    traceback="".join(traceback.format_exception(error)))
    return snap


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` so that a reader never sees half a file; errors are swallowed (diagnostics
    must never be what breaks a run)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
    except OSError:
        pass


class RankMonitor:
    """Keeps ``RUN_DIR/diagnostics/rank{N}.json`` current from a daemon thread."""

    def __init__(self, mesh, run_dir: str | Path, interval_s: float):
        self.mesh = mesh
        self.path = diagnostics_dir(run_dir) / f"rank{mesh.rank}.json"
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._final = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshtrain-diagnostics",
                                        daemon=True)

    def start(self) -> RankMonitor:
        """Write the first snapshot and start refreshing it."""
        self._write("running")
        self._thread.start()
        return self

    def _signature(self) -> tuple:
        log = self.mesh.comm_log
        last = log.recent[-1] if log.recent else None
        return (log.step, sum(log.seq.values()), sum(log.p2p_seq.values()), id(last),
                None if last is None else last.done)

    def _loop(self) -> None:
        seen = None
        while not self._stop.wait(self.interval_s):
            try:
                signature = self._signature()
                if signature != seen:
                    self._write("running")
                    seen = signature
            except RuntimeError:  # the log changed while being read: next round
                continue

    def _write(self, status: str, error: BaseException | None = None) -> None:
        with self._lock:
            if self._final:
                return
            self._final = status != "running"
            write_json_atomic(self.path, rank_snapshot(self.mesh, status, error))

    def finish(self, error: BaseException | None = None) -> None:
        """Stop refreshing and write the final state (``done``, or ``error`` with ``error``)."""
        self._stop.set()
        self._write("done" if error is None else "error", error)


def load_snapshots(run_dir: str | Path, run_id: str | None = None) -> dict[int, dict]:
    """Every readable ``rank*.json`` under ``RUN_DIR/diagnostics`` of the latest restart attempt
    (and of ``run_id``, if given)."""
    snaps: dict[int, dict] = {}
    for path in sorted(diagnostics_dir(run_dir).glob("rank*.json")):
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if run_id and snap.get("run_id") not in (run_id, ""):
            continue
        snaps[int(snap["rank"])] = snap
    latest = max((s.get("attempt", 0) for s in snaps.values()), default=0)
    return {r: s for r, s in snaps.items() if s.get("attempt", 0) == latest}


def clear(run_dir: str | Path) -> None:
    """Remove the rank files of an earlier run in this run dir (before starting workers)."""
    for path in diagnostics_dir(run_dir).glob("rank*.json"):
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the summary


def describe_record(rec: dict) -> str:
    """``dp #12 all_reduce (1,) float32 at trainer.py:97 (step 2)``."""
    peer = rec.get("peer")
    where = "" if peer is None else f" {'to' if rec['op'] == 'send' else 'from'} rank {peer}"
    return (f"{rec['axis']} #{rec['seq']} {rec['op']}{where} {tuple(rec['shape'])} "
            f"{rec['dtype'].removeprefix('torch.')} at {rec['site']} (step {rec['step']})")


def _newest(snap: dict) -> dict | None:
    return snap["recent"][-1] if snap.get("recent") else None


def _count(snap: dict, axis: str) -> int:
    return snap["axes"].get(axis, {}).get("seq", 0)


def _waits(snapshots: dict[int, dict]) -> dict[int, tuple[dict, list[int]]]:
    """For each rank inside a collective: (that collective, the ranks it is waiting for).

    A rank is inside its newest collective when that call has not returned, or when members of
    its group have not issued it yet (NCCL calls return at once; the wait is on the device).
    """
    waits = {}
    for rank, snap in snapshots.items():
        rec = _newest(snap)
        if rec is None:
            continue
        if rec.get("peer") is not None:
            if rec.get("done") is not True:
                waits[rank] = (rec, [rec["peer"]])
            continue
        group = snap["axes"].get(rec["axis"], {}).get("ranks", [])
        behind = [other for other in group if other != rank and (
            other not in snapshots or _count(snapshots[other], rec["axis"]) < rec["seq"])]
        if behind or rec.get("done") is not True:
            waits[rank] = (rec, behind)
    return waits


def _rank_line(rank: int, snapshots: dict[int, dict], waits: dict, run_dir: str) -> str:
    snap = snapshots.get(rank)
    if snap is None:
        return (f"rank {rank}: no diagnostics ({Path(run_dir) / DIR_NAME}/rank{rank}.json missing:"
                f" killed before writing, or on a node without this run dir)")
    if rank in waits:
        rec, behind = waits[rank]
        target = f" for rank(s) {', '.join(map(str, behind))}" if behind else ""
        return f"rank {rank}: waiting in {describe_record(rec)}{target}"
    rec = _newest(snap)
    last = describe_record(rec) if rec else "none yet"
    return (f"rank {rank}: not in a collective (step {snap.get('step', 0)}); its last "
            f"collective: {last}")


def hang_summary(snapshots: dict[int, dict], world_size: int, run_dir: str = "RUN_DIR") -> str:
    """One paragraph naming the rank(s) that did not arrive, then one line per rank."""
    waits = _waits(snapshots)
    waited_for = sorted({other for _, behind in waits.values() for other in behind})
    absent = [r for r in waited_for if not waits.get(r, (None, []))[1]] or waited_for
    lines = []
    for culprit in absent:
        waiters = sorted(r for r, (_, behind) in waits.items() if culprit in behind)
        recs = {describe_record(waits[r][0]) for r in waiters}
        who = (f"rank {waiters[0]} waits" if len(waiters) == 1
               else f"ranks {', '.join(map(str, waiters))} wait")
        lines.append(f"rank {culprit} did not arrive at {' / '.join(sorted(recs))}, where "
                     f"{who}.")
    if not absent and waits:
        lines.append("every rank arrived at the collective it waits in, yet it did not finish "
                     "(ranks called different collectives, or a network fault); rerun with "
                     "train.debug_collectives = true to find the first mismatch.")
    if not waits:
        lines.append("no rank reports waiting in a collective.")
    shown = sorted(set(range(world_size)) if world_size <= 16
                   else set(absent) | set(list(waits)[:8]))
    lines += [f"  {_rank_line(r, snapshots, waits, run_dir)}" for r in shown]
    if len(shown) < world_size:
        lines.append(f"  ... {world_size - len(shown)} more rank(s)")
    lines.append(f"Each rank's last collectives: {Path(run_dir) / DIR_NAME}/rank*.json")
    return "\n".join(lines)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def explain_failure(exit_codes: dict[int, int], messages: dict[int, str], run_dir: str | Path,
                    world_size: int, timeout_s: float) -> tuple[int, str]:
    """The exit status (1, or 2 for a config error found by a worker) and ONE message for a
    failed job, from the workers' exit codes, error-file messages and diagnostics files."""
    # The launcher stops the surviving workers with SIGTERM: those are consequences, not causes.
    stopping = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP}
    killed = sorted(rank for rank, code in exit_codes.items() if code < 0 and code not in stopping)
    if killed and all(exit_codes[r] == -signal.SIGABRT for r in killed):
        snaps = load_snapshots(run_dir)
        if any(behind for _, behind in _waits(snaps).values()):
            ranks = ", ".join(map(str, killed))
            return 1, (f"worker rank(s) {ranks} aborted (SIGABRT), as NCCL's watchdog does when a "
                       f"collective exceeds train.collective_timeout_s = {timeout_s:g} s: "
                       + hang_summary(snaps, world_size, str(run_dir)))
    if killed:
        hint = " (out of memory, or killed from outside?)" if any(
            exit_codes[r] == -signal.SIGKILL for r in killed) else ""
        if len(killed) == 1:
            what = f"worker rank {killed[0]} was killed by {_signal_name(exit_codes[killed[0]])}"
        else:
            what = "workers " + ", ".join(f"rank {r} ({_signal_name(exit_codes[r])})"
                                          for r in killed) + " were killed"
        return 1, f"{what}{hint}; the other workers were stopped."
    snaps = load_snapshots(run_dir)
    failed = [s for s in snaps.values() if s.get("status") == "error"]
    if failed:
        cause = min(failed, key=lambda s: (KIND_PRIORITY.get(s.get("kind"), 2), s["time"]))
        kind, rank = cause.get("kind"), cause["rank"]
        if kind == "timeout":
            return 1, (f"a collective timed out after {timeout_s:g} s "
                       f"(train.collective_timeout_s): "
                       + hang_summary(snaps, world_size, str(run_dir)))
        if kind == "config":
            return 2, cause["error"].split(": ", 1)[-1]
        if kind == "error":
            return 1, (f"worker rank {rank} failed: {cause['error']}\n"
                       + cause.get("traceback", "").rstrip())
        return 1, f"worker rank {rank} failed: {cause['error'].split(': ', 1)[-1]}"
    if exit_codes and all(code in stopping for code in exit_codes.values()):
        rank = min(exit_codes)
        return 1, (f"worker rank {rank} was stopped by {_signal_name(exit_codes[rank])} from "
                   f"outside meshtrain.")
    errored = [r for r, code in exit_codes.items() if code not in stopping] or list(exit_codes)
    rank = min(errored) if errored else 0
    code = exit_codes.get(rank, 1)
    detail = messages.get(rank, "")
    if code == 2:
        return 2, detail.split(": ", 1)[-1] or f"worker rank {rank} refused its configuration"
    return 1, f"worker rank {rank} failed with exit code {code}" + (f": {detail}" if detail else "")


def report_from_worker(mesh, run_dir: str | Path, interval_s: float, timeout_s: float) -> None:
    """Under torchrun/SLURM (no meshtrain launcher): after a collective timeout, the lowest
    timed-out rank that can see the others' files prints the hang summary."""
    time.sleep(2 * interval_s + 0.5)  # let the other ranks' last snapshots land
    snaps = load_snapshots(run_dir)
    timed_out = [r for r, s in snaps.items() if s.get("kind") == "timeout"]
    if timed_out and min(timed_out) != mesh.rank:
        return
    print(f"meshtrain: a collective timed out after {timeout_s:g} s "
          f"(train.collective_timeout_s): " + hang_summary(snaps, mesh.world_size, str(run_dir)),
          file=sys.stderr, flush=True)
