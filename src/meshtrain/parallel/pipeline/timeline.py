"""Draw pipeline timelines: PNG (matplotlib), Chrome trace-event JSON, and plain text.

All three take events as ``(rank, action, start, end)`` tuples — what
:func:`~.simulator.simulate` returns and what the executor measures — so a simulated and a
measured step are drawn the same way. Times are in seconds (the simulator's units are drawn as
seconds) and are shifted so the earliest event starts at 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from meshtrain.parallel.pipeline.schedule import Action, ActionKind, Schedule

Event = tuple[int, Action, float, float]

COLORS = {
    ActionKind.F: "#4c78a8",  # blue
    ActionKind.B: "#54a24b",  # green
    ActionKind.I: "#f58518",  # orange
    ActionKind.W: "#b279a2",  # purple
}
_LEGEND = {ActionKind.F: "F forward", ActionKind.B: "B backward", ActionKind.I: "I backward-input",
           ActionKind.W: "W backward-weight"}


def _from_zero(events: list[Event]) -> list[Event]:
    """Shift measured events (e.g. ``time.perf_counter`` stamps) so the first starts at 0."""
    origin = min((e[2] for e in events), default=0.0)
    return [(r, a, s - origin, e - origin) for r, a, s, e in events]


def plot_timeline(events: Iterable[Event], pp: int, path: str | Path, title: str = "") -> Path:
    """Write a PNG with one row per pipeline rank and one box per F/B/I/W action.

    Boxes are coloured by kind (lighter for a rank's odd chunks, ``stage // pp``) and labelled
    with the micro-batch; communication is not drawn.
    Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = _from_zero([e for e in events if e[1].kind.is_compute])
    end = max((e[3] for e in compute), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(4 + end * 0.25, 40), 1.0 + 0.5 * pp))
    kinds_seen: list[ActionKind] = []
    for rank, action, start, stop in compute:
        width = stop - start
        # a rank's chunks alternate between full and lighter shades (chunk = stage // pp)
        alpha = 1.0 if (action.stage // pp) % 2 == 0 else 0.6
        ax.broken_barh([(start, width)], (rank - 0.4, 0.8), facecolors=COLORS[action.kind],
                       edgecolor="white", linewidth=0.5, alpha=alpha)
        if action.kind not in kinds_seen:
            kinds_seen.append(action.kind)
        if width > end / 120:
            ax.text(start + width / 2, rank, str(action.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_xlabel("time")
    if title:
        ax.set_title(title)
    order = [k for k in COLORS if k in kinds_seen]
    ax.legend(handles=[Patch(color=COLORS[k], label=_LEGEND[k]) for k in order],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def chrome_trace(events: Iterable[Event]) -> dict:
    """The Chrome trace-event document of ``events`` (``ph: "X"``, ``pid`` 0, ``tid`` = rank,
    ``ts``/``dur`` in microseconds); load it in chrome://tracing or Perfetto."""
    trace: list[dict] = []
    ranks: set[int] = set()
    for rank, action, start, stop in _from_zero(list(events)):
        ranks.add(rank)
        trace.append({"name": str(action), "cat": action.kind.value, "ph": "X", "pid": 0,
                      "tid": rank, "ts": start * 1e6, "dur": max(stop - start, 0.0) * 1e6,
                      "args": {"microbatch": action.microbatch, "stage": action.stage,
                               "peer": action.peer}})
    for rank in sorted(ranks):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"pp rank {rank}"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[Event], path: str | Path) -> Path:
    """Write :func:`chrome_trace` of ``events`` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def _label(action: Action, chunk_of: dict[int, int] | None) -> str:
    text = f"{action.kind.value}{action.microbatch}"
    if chunk_of is not None:
        text += "abcdefghijklmnopqrstuvwxyz"[chunk_of[action.stage] % 26]
    return text


def format_events_ascii(events: Sequence[Event], pp: int, unit: float | None = None,
                        chunk_of: dict[int, int] | None = None) -> str:
    """Text timeline: one row per rank, one cell per ``unit`` of time, ``.`` where idle.

    A cell shows kind and micro-batch (``F3``), plus the rank-local chunk letter (``F3a``,
    ``F3b``) when ``chunk_of`` maps stages to chunk indices. ``unit`` defaults to the shortest
    compute action.
    """
    compute = _from_zero([e for e in events if e[1].kind.is_compute and e[3] > e[2]])
    if not compute:
        return "\n".join(f"rank {r}: (idle)" for r in range(pp))
    unit = unit or min(e[3] - e[2] for e in compute)
    cells = int(round(max(e[3] for e in compute) / unit))
    width = max(len(_label(e[1], chunk_of)) for e in compute) + 1
    rows = [["." for _ in range(cells)] for _ in range(pp)]
    for rank, action, start, stop in compute:
        first, last = int(round(start / unit)), int(round(stop / unit))
        for cell in range(first, max(last, first + 1)):
            rows[rank][cell] = _label(action, chunk_of)
    return "\n".join(f"rank {r}: " + "".join(c.rjust(width) for c in row)
                     for r, row in enumerate(rows))


def format_ascii(schedule: Schedule, times=None) -> str:
    """Simulate ``schedule`` (unit costs unless ``times`` given) and draw it as text."""
    from meshtrain.parallel.pipeline.simulator import StageTimes, simulate

    result = simulate(schedule, times if times is not None else StageTimes())
    chunk_of = None
    if schedule.virtual_stages > 1:
        chunk_of = {s: schedule.stages_of(r).index(s)
                    for r in range(schedule.pp) for s in schedule.stages_of(r)}
    return format_events_ascii(result.events, schedule.pp, chunk_of=chunk_of)
