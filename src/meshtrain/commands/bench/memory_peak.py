"""Peak resident memory of every training worker, measured from outside meshtrain.

``measure_train_peaks(overrides, nproc)`` runs ``meshtrain train --nproc N`` in a subprocess and
reports each worker's ``VmHWM`` (the kernel's resident high-water mark from ``/proc/PID/status``),
never meshtrain's own counters. Two sources are combined, per worker:

- the launcher's process tree is polled every few milliseconds and each worker's ``VmHWM`` read;
- a ``sitecustomize`` module put first on the workers' ``PYTHONPATH`` registers an exit hook that
  reads ``/proc/self/status`` as the worker ends, so a peak in the final save is not missed.

The figure kept is the larger of the two (``VmHWM`` only grows, so both are lower bounds of the
same number). Workers are told apart from the launcher by the ``RANK`` variable torch's elastic
launcher sets. ``python -m meshtrain.commands.bench.memory_peak`` prints the dp 8 ZeRO-3 figures at
about 85M parameters minus a tiny model's run (other layouts by name, among them an MoE model on 4
processes at ZeRO-2 and ZeRO-3).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HOOK = '''
import atexit, json, os
def _record_vmhwm():
    out = os.environ.get("MESHTRAIN_VMHWM_DIR")
    rank = os.environ.get("RANK")
    if not out or rank is None or os.environ.get("LOCAL_WORLD_SIZE") is None:
        return
    with open("/proc/self/status") as f:
        kb = [int(line.split()[1]) for line in f if line.startswith("VmHWM:")][0]
    with open(os.path.join(out, "rank%s.%d.json" % (rank, os.getpid())), "w") as f:
        json.dump({"rank": int(rank), "pid": os.getpid(), "vmhwm_bytes": kb * 1024}, f)
atexit.register(_record_vmhwm)
'''

#: ~85M parameters (dim 768, 12 layers, ffn 2048) and a tiny model whose run is the baseline.
LARGE_MODEL = ["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.ffn_dim=2048",
               "model.n_kv_heads=0"]
TINY_MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64",
              "model.n_kv_heads=0"]
#: Two fp32 steps, a checkpoint at step 1, the final save; small batches keep it short.
RUN = ["train.steps=2", "train.global_batch=8", "train.seq_len=32", "train.precision=fp32",
       "train.warmup_steps=1", "train.log_every=1", "checkpoint.every=1", "train.device=cpu"]


def _status_kb(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def _environ_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if b"RANK" not in env or b"LOCAL_WORLD_SIZE" not in env:
        return None
    return int(env[b"RANK"])


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def measure_train_peaks(overrides: list[str], nproc: int, run_dir: Path,
                        timeout_s: float = 1200.0, poll_s: float = 0.02) -> dict:
    """Run ``meshtrain train --nproc nproc`` with ``--set`` overrides; return per-rank VmHWM bytes.

    Returns ``{"peaks": [bytes per rank], "wall_s": float}``; raises ``RuntimeError`` when the
    run fails or a rank's peak was never seen.
    """
    run_dir = Path(run_dir)
    hook_dir = Path(tempfile.mkdtemp(prefix="meshtrain-hook-"))
    out_dir = run_dir / "vmhwm"
    out_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_HOOK)
    env = dict(os.environ, MESHTRAIN_VMHWM_DIR=str(out_dir),
               PYTHONPATH=os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH"))
                                          if p))
    cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(nproc),
           "--run-dir", str(run_dir / "run"), "--set", f"checkpoint.dir={run_dir / 'ckpt'}"]
    for item in overrides:
        cmd += ["--set", item]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    polled: dict[int, int] = {}
    ranks: dict[int, int] = {}
    while proc.poll() is None:
        if time.monotonic() - start > timeout_s:
            proc.kill()
            raise RuntimeError(f"meshtrain train ran past {timeout_s} s")
        for pid in _descendants(proc.pid):
            if pid not in ranks:
                rank = _environ_rank(pid)
                if rank is None:
                    continue
                ranks[pid] = rank
            kb = _status_kb(pid, "VmHWM")
            if kb is not None:
                polled[ranks[pid]] = max(polled.get(ranks[pid], 0), kb * 1024)
        time.sleep(poll_s)
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"meshtrain train failed ({proc.returncode}):\n{log[-4000:]}")
    peaks = dict(polled)
    for path in out_dir.glob("rank*.json"):
        rec = json.loads(path.read_text())
        peaks[rec["rank"]] = max(peaks.get(rec["rank"], 0), rec["vmhwm_bytes"])
    missing = [r for r in range(nproc) if r not in peaks]
    if missing:
        raise RuntimeError(f"no VmHWM seen for ranks {missing}")
    return {"peaks": [peaks[r] for r in range(nproc)], "wall_s": time.monotonic() - start}


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set ``values`` in this process's environment (a launched run inherits it), then restore
    it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure_peaks(overrides: list[str], nproc: int, run_dir: Path,
                  env: dict[str, str] | None = None) -> dict:
    """:func:`measure_train_peaks` with ``env`` added to the run's environment; ``--nproc 1``
    trains in the launched process itself, which the tree poll does not see as a worker, so it
    is marked rank 0 (without ``WORLD_SIZE`` it is still no torchrun job) and the exit hook
    records its peak."""
    extra = dict(env or {})
    if nproc == 1:
        extra.update(RANK="0", LOCAL_WORLD_SIZE="1")
    with _environment(extra):
        return measure_train_peaks(overrides, nproc, run_dir)


def excess_over_tiny(layout: list[str], nproc: int, work: Path) -> dict:
    """Per-rank VmHWM of the ~85M model minus the tiny model's run, same layout and schedule."""
    tiny = measure_train_peaks(TINY_MODEL + RUN + layout, nproc, Path(work) / "tiny")
    large = measure_train_peaks(LARGE_MODEL + RUN + layout, nproc, Path(work) / "large")
    return {"tiny": tiny["peaks"], "large": large["peaks"],
            "excess": [a - b for a, b in zip(large["peaks"], tiny["peaks"], strict=True)],
            "wall_s": tiny["wall_s"] + large["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    """Print per-rank excess peaks (MiB) for the layouts named on the command line."""
    moe = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_dim=512"]
    layouts = {"dp8-z3": ["parallel.dp=8", "parallel.zero=3"],
               "dp8-z0": ["parallel.dp=8", "parallel.zero=0"],
               "dp8-z1": ["parallel.dp=8", "parallel.zero=1"],
               "dp8-z2": ["parallel.dp=8", "parallel.zero=2"],
               "tp2pp2dp2-z1": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                                "parallel.zero=1", "parallel.microbatches=2"],
               "pp2dp4-z2": ["parallel.pp=2", "parallel.dp=4", "parallel.zero=2",
                             "parallel.microbatches=2"],
               "pp2dp4-z3": ["parallel.pp=2", "parallel.dp=4", "parallel.zero=3",
                             "parallel.microbatches=2"],
               # the same model with 8 experts of width 512 in every block, on 4 processes
               "moe-dp4ep2-z2": [*moe, "parallel.dp=4", "parallel.ep=2", "parallel.zero=2"],
               "moe-dp4ep2-z3": [*moe, "parallel.dp=4", "parallel.ep=2", "parallel.zero=3"]}
    names = (argv if argv is not None else sys.argv[1:]) or ["dp8-z3"]
    unknown = [name for name in names if name not in layouts]
    if unknown:
        print(f"unknown layout {', '.join(unknown)}; known: {', '.join(layouts)}",
              file=sys.stderr)
        return 2
    mib = 2**20
    for name in names:
        nproc = 4 if name.startswith("moe-") else 8
        with tempfile.TemporaryDirectory() as work:
            r = excess_over_tiny(layouts[name], nproc, Path(work))
        print(json.dumps({"layout": name, "wall_s": round(r["wall_s"], 1),
                          "tiny_mib": [round(b / mib) for b in r["tiny"]],
                          "large_mib": [round(b / mib) for b in r["large"]],
                          "excess_mib": [round(b / mib) for b in r["excess"]]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
