"""Peak resident memory measured from outside meshtrain (the kernel's VmHWM of every worker).

The fast test checks the measuring tool itself against a process that allocates a known amount.
The slow tests are the acceptance bound of dp 8 ZeRO-3 at ~85M parameters: every worker's VmHWM
minus the same run's with a tiny model stays within 1.25 x the planner's per-rank model states
(16P/N in fp32) + 64 MiB, over init, two steps, a checkpoint and the final save; and the
planner's per-rank memory estimate agrees with that measured excess within 15 %.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from meshtrain.bench.memory_peak import (
    LARGE_MODEL,
    RUN,
    TINY_MODEL,
    _status_kb,
    excess_over_tiny,
    measure_train_peaks,
)
from meshtrain.config import ModelConfig, load_config
from meshtrain.model.transformer import Transformer
from meshtrain.planner.memory import model_state_bytes, rank_memory
from meshtrain.planner.workload import Workload, stage_layers
from meshtrain.training.tokenizer import tokenizer_vocab_size

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


def _large_params() -> int:
    cfg = {k.split(".", 1)[1].split("=")[0]: int(k.split("=")[1]) for k in LARGE_MODEL}
    model_cfg = ModelConfig(vocab_size=tokenizer_vocab_size("bytes"), **cfg)
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(model_cfg).parameters())


@pytest.fixture(scope="module")
def dp8_zero3_excess(tmp_path_factory) -> dict:
    """One measurement of dp 8 ZeRO-3 at ~85M parameters against the tiny run (~4 minutes on
    2 vCPUs), shared by the tests below."""
    return excess_over_tiny(["parallel.dp=8", "parallel.zero=3"], 8,
                            tmp_path_factory.mktemp("dp8-z3"))


@pytest.mark.slow
def test_dp8_zero3_peak_within_model_state_share(dp8_zero3_excess):
    """Every rank's VmHWM excess over the tiny run is <= 1.25 x 16P/8 + 64 MiB (fp32 states)."""
    params = _large_params()
    bound = 1.25 * sum(model_state_bytes(params, 3, 8, "fp32")) + 64 * MIB
    excess = dp8_zero3_excess["excess"]
    assert max(excess) <= bound, (
        f"excess MiB {[round(b / MIB) for b in excess]} > bound {bound / MIB:.0f} MiB")


@pytest.mark.slow
def test_planner_estimate_agrees_with_the_measured_peak(dp8_zero3_excess):
    """The planner's per-rank memory (states, activations, ZeRO-3 gathered units and gradient
    staging) of the large run minus the tiny run's is within 15 % of every rank's measured
    VmHWM excess."""
    estimate = _planner_total(LARGE_MODEL) - _planner_total(TINY_MODEL)
    for excess in dp8_zero3_excess["excess"]:
        assert abs(excess - estimate) <= 0.15 * excess, (
            f"planner {estimate / MIB:.0f} MiB, measured "
            f"{[round(b / MIB) for b in dp8_zero3_excess['excess']]} MiB")


def _planner_total(model: list[str]) -> float:
    config = load_config(None, model + RUN + ["parallel.dp=8", "parallel.zero=3"])
    config.model.vocab_size = config.model.vocab_size or tokenizer_vocab_size("bytes")
    layout = config.parallel.layout()
    layers = stage_layers(config.model, layout)[0]
    return rank_memory(Workload.from_config(config), layout, 0, layers, 1.0,
                       config.parallel.dp_bucket_mb).total_bytes


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
