"""Peak resident memory measured from outside meshtrain (the kernel's VmHWM of every worker).

The fast test checks the measuring tool itself against a process that allocates a known amount.
The slow tests are the acceptance bounds at ~85M parameters, for dp 8 ZeRO-3, for
tp 2 x pp 2 x dp 2 ZeRO-1 and for pp 2 x dp 4 ZeRO-3: every worker's VmHWM minus the same
run's with a tiny model stays within 1.25 x the planner's model states for that rank + 64 MiB,
over init, two steps, two checkpoints and the final save; the planner's per-rank memory
estimate agrees with that measured excess within 15 %; and ZeRO stages 0-3 order as the ZeRO
paper says.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from meshtrain.commands.bench.memory_peak import (
    LARGE_MODEL,
    RUN,
    TINY_MODEL,
    _status_kb,
    excess_over_tiny,
    measure_train_peaks,
)
from meshtrain.config import load_config
from meshtrain.data.tokenizer import tokenizer_vocab_size
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES

MIB = 2**20


def test_vmhwm_reader_sees_a_known_allocation():
    """A child touching 200 MiB shows a VmHWM of at least that much, read from /proc/PID."""
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys,time; b = bytearray(200 * 2**20); b[::4096] = b'x' * "
                              "len(b[::4096]); print('ok', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ok"
        kb = _status_kb(child.pid, "VmHWM")
        assert kb is not None and kb * 1024 >= 200 * MIB
        assert kb * 1024 < 400 * MIB  # an interpreter is far below 200 MiB on its own
    finally:
        child.kill()
        child.wait()
    time.sleep(0.05)
    assert _status_kb(child.pid, "VmHWM") is None  # gone: no stale reading


#: The acceptance layouts: every rank's own share differs (ZeRO-3 over 8, a tp × pp piece with
#: ZeRO-1 over its dp 2, a pipeline stage with ZeRO-3 over its dp 4), so each rank is held to
#: its own stage's planner figures.
ACCEPTANCE = {"dp8-z3": ["parallel.dp=8", "parallel.zero=3"],
              "tp2pp2dp2-z1": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                               "parallel.zero=1", "parallel.microbatches=2"],
              "pp2dp4-z3": ["parallel.pp=2", "parallel.dp=4", "parallel.zero=3",
                            "parallel.microbatches=2"]}


@pytest.fixture(scope="module", params=sorted(ACCEPTANCE))
def measured(request, tmp_path_factory) -> dict:
    """One measurement of a layout at ~85M parameters against the tiny run (1-4 minutes on
    2 vCPUs), shared by the tests below, with the planner's per-rank figures (by stage)."""
    layout = ACCEPTANCE[request.param]
    result = excess_over_tiny(layout, 8, tmp_path_factory.mktemp(request.param))
    large, tiny = _planner_per_rank(LARGE_MODEL, layout), _planner_per_rank(TINY_MODEL, layout)
    result["states"] = [sum(large[s][k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
                        for s in _stage_of_rank(layout)]
    result["estimate"] = [large[s]["total_bytes"] - tiny[s]["total_bytes"]
                          for s in _stage_of_rank(layout)]
    result["name"] = request.param
    return result


def _planner_per_rank(model: list[str], layout: list[str]) -> list[dict]:
    """``meshtrain estimate``'s per-stage memory for the measured run (the same config), without
    a GPU caching allocator's reserve: the CPU run's glibc ``malloc`` is measured as it is."""
    config = load_config(None, model + RUN + layout)
    config.model.vocab_size = config.model.vocab_size or tokenizer_vocab_size("bytes")
    cpu = dataclasses.replace(PROFILES["h100-80g"], allocator_reserve=0.0)
    result = estimate(Workload.from_config(config), config.parallel.layout(),
                      Cluster(cpu, 8, 8))
    return result["per_rank"]


def _stage_of_rank(layout: list[str]) -> list[int]:
    """The pipeline stage of each of the 8 ranks (pp is the outermost mesh dimension)."""
    config = load_config(None, layout)
    per_stage = 8 // config.parallel.pp
    return [rank // per_stage for rank in range(8)]


@pytest.mark.slow
def test_peak_within_model_state_share(measured):
    """Every rank's VmHWM excess over the tiny run is <= 1.25 x its planner model states
    (fp32: 16P/N for ZeRO-3 over 8; 4P + 4P + 8P/2 of its tp × pp piece for ZeRO-1 over dp 2)
    + 64 MiB, over init, two steps, two checkpoints and the final save."""
    for rank, (excess, states) in enumerate(zip(measured["excess"], measured["states"],
                                                strict=True)):
        bound = 1.25 * states + 64 * MIB
        assert excess <= bound, (
            f"{measured['name']} rank {rank}: excess {excess / MIB:.0f} MiB > bound "
            f"{bound / MIB:.0f} MiB (all ranks: {[round(b / MIB) for b in measured['excess']]})")


@pytest.mark.slow
def test_planner_estimate_agrees_with_the_measured_peak(measured):
    """The planner's per-rank memory (states, activations, ZeRO-3 gathered units, gradient
    reduction transients) of the large run minus the tiny run's is within 15 % of every rank's
    measured VmHWM excess."""
    for rank, (excess, est) in enumerate(zip(measured["excess"], measured["estimate"],
                                             strict=True)):
        assert abs(excess - est) <= 0.15 * excess, (
            f"{measured['name']} rank {rank}: planner {est / MIB:.0f} MiB, measured "
            f"{[round(b / MIB) for b in measured['excess']]} MiB")


@pytest.mark.slow
def test_zero_stages_order_as_the_zero_paper_says(tmp_path):
    """At dp 8, every rank's excess falls from ZeRO-0 to 1 to 2 to 3 (Rajbhandari et al.
    2020: each stage partitions one more of optimizer state, gradients, parameters), and
    ZeRO-2 under a pipeline (pp 2 x dp 4) lies between ZeRO-0 and ZeRO-3 at dp 8."""
    excess = {}
    for zero in range(4):
        excess[zero] = excess_over_tiny(["parallel.dp=8", f"parallel.zero={zero}"], 8,
                                        tmp_path / f"z{zero}")["excess"]
    for stage in range(1, 4):
        assert max(excess[stage]) < min(excess[stage - 1]), (
            {z: [round(b / MIB) for b in e] for z, e in excess.items()})
    piped = excess_over_tiny(["parallel.pp=2", "parallel.dp=4", "parallel.zero=2",
                              "parallel.microbatches=2"], 8, tmp_path / "pp2dp4-z2")["excess"]
    assert max(excess[3]) < min(piped) and max(piped) < min(excess[0]), (
        [round(b / MIB) for b in piped])


def test_cpu_peak_bytes_is_the_kernel_high_water_mark():
    """``mem.peak_bytes`` on CPU rises by what a fresh process touches and equals its VmHWM."""
    code = ("import torch; from meshtrain.training.metrics import peak_memory_bytes as p\n"
            "cpu = torch.device('cpu'); a = p(cpu); b = bytearray(128 * 2**20)\n"
            "b[::4096] = b'x' * len(b[::4096]); c = p(cpu)\n"
            "kb = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')]\n"
            "print(a, c, kb[0] * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, vmhwm = map(int, out.stdout.split())
    assert after - before >= 120 * MIB
    assert after == vmhwm


#: pp 2 with 8 MiB activation messages (micro-batch 64 x seq 128 x dim 256, fp32) and little
#: compute per micro-batch, so what the executor keeps per micro-batch shows in VmHWM.
_PIPELINE_RUN = ["model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=256",
                 "model.n_kv_heads=0", "parallel.pp=2", "parallel.pp_schedule=1f1b",
                 "train.steps=1", "train.seq_len=128", "train.precision=fp32",
                 "train.warmup_steps=0", "train.device=cpu", "checkpoint.every=0",
                 "train.eval_every=0"]


@pytest.mark.slow  # a measurement: `make bench`
def test_pipeline_peak_does_not_grow_with_microbatches(tmp_path, monkeypatch):
    """1F1B keeps at most pp micro-batches in flight, so its peak must not grow with the
    micro-batch count: 16 micro-batches of the same size peak within 4 activation messages of 2
    (keeping each micro-batch's received and sent buffers to the end of the step adds ~28).

    Blocks of 1 MiB and more are mapped (``MALLOC_MMAP_THRESHOLD_``), so the peak is what the
    executor keeps alive: under meshtrain's default 32 MiB threshold the heap's fragmentation
    grows with the step's length on its own (docs/parallelism.md, "Memory measured from
    outside")."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    message = 64 * 128 * 256 * 4
    peaks = {}
    for m in (2, 16):
        run = _PIPELINE_RUN + [f"parallel.microbatches={m}", f"train.global_batch={64 * m}"]
        peaks[m] = measure_train_peaks(run, 2, tmp_path / f"m{m}")["peaks"]
    growth = [big - small for big, small in zip(peaks[16], peaks[2], strict=True)]
    assert max(growth) <= 4 * message, (
        f"peak growth from 2 to 16 micro-batches per rank, MiB: "
        f"{[round(g / MIB) for g in growth]} (bound {4 * message / MIB:.0f})")
