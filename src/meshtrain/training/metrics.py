"""Step metrics: ``RUN_DIR/metrics.jsonl`` (rank 0), a progress display, and the run's
experiment trackers (``train.loggers``: TensorBoard, W&B, MLflow;
:mod:`meshtrain.training.trackers`).

Every line of ``metrics.jsonl`` is one optimizer step with at least ``step, loss, grad_norm, lr,
tokens, step_time_s, tokens_per_s, mfu, comm_bytes, mem, energy_j, energy_total_j,
energy_source``: the job's joules (all ranks) of the step, their running total and ``nvml`` or
``estimate`` (:mod:`meshtrain.training.energy`). ``mfu`` is null where the device's peak
FLOP/s is unknown: it is never guessed. ``mem.peak_bytes`` is ``torch.cuda.max_memory_allocated``
on CUDA and the process's peak resident set size (the kernel's ``VmHWM``) on CPU.
``compute_s`` and ``wait_s`` split rank 0's step time into work and time in collectives;
``straggler`` is ``{rank, excess_s, factor}``, the rank whose compute most exceeded the other
ranks' median, or null for one process (:mod:`meshtrain.training.straggler`). A step that scored
``train.eval_tasks`` has ``tasks``: ``{task: {metric: value}}``
(:mod:`meshtrain.training.harness.scorer`).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Dense bf16 tensor-core peaks (no sparsity), by substring of the CUDA device name.
BF16_PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("A10G", 70e12), ("L4", 121e12),
)


def device_peak_flops(device: torch.device, precision: str, override_tflops: float) -> float | None:
    """Peak dense FLOP/s of one device for MFU, or None when unknown (then MFU is null)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak, or on CPU the kernel's resident
    high-water mark (``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` where /proc is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsWriter:
    """Writes one JSON line per step and shows progress; used on the logging rank only."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, trackers=None):
        """``trackers``: a :class:`~meshtrain.training.trackers.Trackers` that gets every row
        too (and, through :meth:`final_weights` and :meth:`close`, how the run ended)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if start_step > 0 and self.path.is_file():
            # Resuming at ``start_step``: drop lines of steps after it (logged by a run that died
            # before its next checkpoint), so the file reads steps 1..N exactly once.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.resumed_energy_j = 0.0
        """The running energy total of the last kept line (resuming), else 0."""
        if start_step > 0 and self.path.is_file():
            lines = self.path.read_text().splitlines()
            if lines:
                self.resumed_energy_j = float(json.loads(lines[-1]).get("energy_total_j", 0.0))
        self.file = self.path.open("a" if start_step > 0 else "w")
        self.total_steps = total_steps
        self.start_time = time.time()
        self.trackers = trackers
        self.finished = False
        self.progress = None
        if sys.stderr.isatty():  # every human-readable line of a run goes to stderr
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               status="")
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` and update the display."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        status = (f"loss {record['loss']:.4f}  gnorm {record['grad_norm']:.3f}  "
                  f"lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s")
        if "eval_loss" in record:
            status += f"  eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.2f})"
        for task, scores in record.get("tasks", {}).items():  # its first metric
            status += "".join(f"  {task} {name} {value:.4g}"
                              for name, value in list(scores.items())[:1])
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        else:
            print(f"step {record['step']:>5}/{self.total_steps}  {status}",
                  file=sys.stderr, flush=True)
        if self.trackers is not None:
            self.trackers.log_row(record)

    def final_weights(self, path: Path | None) -> None:
        """The run trained to its last step and wrote its final weights to ``path``."""
        self.finished = True
        if self.trackers is not None and path is not None:
            self.trackers.log_final_weights(Path(path).resolve())

    def close(self) -> None:
        """Flush and close everything; the trackers' runs end as finished (after
        :meth:`final_weights`), failed (an exception is on its way) or stopped early."""
        if self.progress is not None:
            self.progress.stop()
        self.file.close()
        if self.trackers is not None:
            failed = sys.exc_info()[0] is not None
            self.trackers.close("FAILED" if failed else "FINISHED" if self.finished
                                else "KILLED")
