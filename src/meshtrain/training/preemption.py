"""Preemption without loss: SIGTERM or SIGUSR1 stops a run at a step boundary, with a checkpoint.

Schedulers (SLURM, cloud spot instances) send SIGTERM some time before they kill a job, or
SIGUSR1 when asked (``#SBATCH --signal=USR1@120``). meshtrain then:

1. notes the first signal (:class:`StopSignals`, installed by every worker) and carries on with
   the current step;
2. at the end of that step every rank learns, from the small per-step all-gather it already
   makes (:mod:`meshtrain.training.straggler`), whether *any* rank received a signal, so all
   stop after the same step, even when only one rank was signalled;
3. saves a checkpoint of that step (whatever ``checkpoint.every`` says) into ``checkpoint.dir``
   (default ``RUN_DIR/checkpoints``) and writes ``RUN_DIR/preempted.json``;
4. exits with :data:`PREEMPTED_EXIT` (75, ``EX_TEMPFAIL``: "try again"), which
   ``meshtrain train`` passes on, so a wrapper can requeue the job and resume it with
   ``checkpoint.resume = auto``.

A second signal stops the process at once, with ``128 + signal`` (143 for SIGTERM, 138 for
SIGUSR1) and nothing more saved. ``meshtrain train --nproc N`` passes each of these signals on
to its workers as SIGUSR1 (:func:`forward_to_workers`) instead of stopping them: its workers
leave SIGTERM alone, since torch elastic's agent stops workers with SIGTERM (when another worker
failed), and that must still stop them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from meshtrain.errors import RunFailure

PREEMPTED_EXIT = 75
"""Exit status of a run stopped by SIGTERM/SIGUSR1 after saving a checkpoint (``EX_TEMPFAIL``)."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that ask a run to stop at the next step boundary."""
MARKER = "preempted.json"
"""Written to the run dir by rank 0 when a run stopped on a signal: step, signal, checkpoint."""


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Notes the first SIGTERM/SIGUSR1 this process receives; a second one exits at once.

    Use as a context manager around the run; outside the main thread it installs nothing (then
    :attr:`received` stays 0). ``on_first``/``on_second`` are called from the handler
    (the launcher forwards the signal to its workers there); ``exit_on_second`` = False raises
    :class:`StoppedAtOnce` instead of leaving the process with ``os._exit``.
    """

    def __init__(self, on_first=None, on_second=None, exit_on_second: bool = True,
                 quiet: bool = False, signals: tuple = SIGNALS):
        self.signals = signals
        self.received = 0
        """The first signal's number, 0 while none came."""
        self.on_first, self.on_second = on_first, on_second
        self.exit_on_second = exit_on_second
        self.quiet = quiet
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum
            if self.on_first is not None:
                self.on_first(signum)
            return
        if self.on_second is not None:
            self.on_second(signum)
        if not self.quiet:
            print(f"meshtrain: second signal ({signal_name(signum)}): stopping at once, nothing "
                  f"more saved", file=sys.stderr, flush=True)
        if self.exit_on_second:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)
        raise StoppedAtOnce(signum)


class StoppedAtOnce(RunFailure):
    """Raised by :class:`StopSignals` (``exit_on_second = False``) on a second signal; the CLI
    exits with its :attr:`exit_status` (``128 + signal``)."""

    def __init__(self, signum: int):
        super().__init__(f"a second {signal_name(signum)} stopped the run at once; the workers "
                         f"were stopped without saving")
        self.signum = signum
        self.exit_status = 128 + signum


def worker_pids(parent: int | None = None) -> list[int]:
    """Pids of this process's child processes that run ``meshtrain.run.worker`` (Linux /proc)."""
    parent = os.getpid() if parent is None else parent
    children: set[int] = set()
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            children.update(int(pid) for pid in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    found = []
    for pid in sorted(children):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"meshtrain.run.worker" in command:
            found.append(pid)
    return found


def forward_to_workers(signum: int = signal.SIGUSR1) -> list[int]:
    """Send SIGUSR1 (what a launched worker stops on) to every worker this launcher started;
    return their pids. ``signum`` is the signal the launcher received (not forwarded as is)."""
    pids = worker_pids()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    return pids


def marker_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/preempted.json``."""
    return Path(run_dir) / MARKER


def clear_marker(run_dir: str | Path) -> None:
    """Remove a previous run's marker (the launcher, before it starts workers)."""
    marker_path(run_dir).unlink(missing_ok=True)


def write_marker(run_dir: str | Path, info: dict) -> None:
    """Record (rank 0) where the run stopped: ``info`` = ``{"step", "signal", "checkpoint"}``."""
    path = marker_path(run_dir)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({**info, "exit_status": PREEMPTED_EXIT}))
    os.replace(partial, path)


def read_marker(run_dir: str | Path) -> dict | None:
    """The marker of a run that stopped on a signal, or None."""
    try:
        return json.loads(marker_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def summary(info: dict) -> str:
    """One line for the user: where the run stopped and how to go on."""
    return (f"preempted by {info['signal']} after step {info['step']}: checkpoint saved to "
            f"{info['checkpoint']}; exit status {PREEMPTED_EXIT}. Run the same command with "
            f"--set checkpoint.resume=auto to continue.")


def save_on_signal(trainer) -> dict:
    """Every rank agreed to stop after this step on a signal: checkpoint it (whatever
    ``checkpoint.every`` says); returns ``{"step", "signal", "checkpoint"}`` (the trainer's
    ``preempted``)."""
    from meshtrain.checkpoint.manager import checkpoint_root

    name = signal_name(trainer.stop_signal)
    try:
        path = trainer.save_checkpoint_path()
    except OSError as error:
        raise RunFailure(f"{name} received: stopping after step {trainer.step}, but its "
                         f"checkpoint could not be written to "
                         f"{checkpoint_root(trainer.config)}: {error}. Nothing was "
                         f"saved; set checkpoint.dir to a writable directory.") from None
    return {"step": trainer.step, "signal": name, "checkpoint": str(path)}
