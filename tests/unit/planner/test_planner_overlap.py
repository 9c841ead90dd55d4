"""The overlap model (meshtrain.planner.cost.overlap) against event-by-event simulations of the
runtime's schedules, and the estimate's per-axis ``overlap`` table.

The closed forms are checked against a direct simulation of one comm queue (collectives run one
after another in issue order) beside the compute that issues and waits for them, over a grid of
comm/compute ratios and piece counts: exact for the bucketed reduction, within one piece's
communication for ZeRO-3 (whose backward interleaves two kinds of collectives on the queue).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.overlap import OVERLAP_AXES, bucketed_exposed, zero3_exposed
from meshtrain.planner.cost.workload import (
    MEGATRON_2021,
    MEGATRON_2021_TORCH_DDP,
    MEGATRON_CORE_2024,
    MESHTRAIN,
    Workload,
)
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import OVERLAP_CONTENTION, PROFILES
from meshtrain.replan.auto import BUILTIN_CPU


class CommQueue:
    """One process group's collectives: each starts when issued and the previous one is done."""

    def __init__(self):
        self.free_at = 0.0

    def issue(self, now: float, seconds: float) -> float:
        """Issue a collective at ``now``; returns when it completes."""
        self.free_at = max(self.free_at, now) + seconds
        return self.free_at


def simulate_buckets(comm: float, window: float, pieces: int) -> float:
    """Exposed seconds: bucket k's reduction issued when ``k/pieces`` of backward is done."""
    queue, done = CommQueue(), 0.0
    for k in range(1, pieces + 1):
        done = queue.issue(k * window / pieces, comm / pieces)
    return max(done - window, 0.0)


def simulate_zero3(gather: float, reduce: float, forward: float, backward: float,
                   units: int) -> float:
    """Exposed seconds of one micro-batch as zero3.ParameterGatherer schedules it: forward
    gathers unit i (waits), prefetches i + 1, computes; backward gathers unit i (waits),
    prefetches i - 1, computes, reduce-scatters i; the micro-batch ends when the last
    reduce-scatter is done."""
    g, r, f, b = gather / units, reduce / units, forward / units, backward / units
    queue, now, ready = CommQueue(), 0.0, {}
    ready[0] = queue.issue(now, g)
    for i in range(units):
        now = max(now, ready[i])
        if i + 1 < units:
            ready[i + 1] = queue.issue(now, g)
        now += f
    ready = {units - 1: queue.issue(now, g)}
    end = now
    for i in reversed(range(units)):
        now = max(now, ready[i])
        if i > 0:
            ready[i - 1] = queue.issue(now, g)
        now += b
        end = queue.issue(now, r)
    return max(end, now) - (forward + backward)


GRID = list(itertools.product((0.01, 0.3, 0.9, 1.0, 1.5, 4.0), (1, 2, 5, 32)))
"""(comm / compute, pieces)."""


@pytest.mark.parametrize(("ratio", "pieces"), GRID)
def test_bucketed_reduction_matches_the_simulated_queue(ratio, pieces):
    window = 2.0
    assert bucketed_exposed(ratio * window, window, pieces) == pytest.approx(
        simulate_buckets(ratio * window, window, pieces), abs=1e-12)


@pytest.mark.parametrize(("ratio", "units"), GRID)
def test_zero3_prefetch_matches_the_simulated_schedule_within_one_unit(ratio, units):
    forward, backward = 1.0, 2.0
    gather, reduce = ratio * forward, ratio * forward * 2  # fp32 gradients, bf16 weights
    simulated = simulate_zero3(gather, reduce, forward, backward, units)
    assert zero3_exposed(gather, reduce, forward, backward, units) == pytest.approx(
        simulated, abs=(gather + reduce) / units + 1e-12)


def _llama_8b_fsdp(profile: str, traits=MESHTRAIN, zero: int = 3, microbatches: int = 1,
                   contention: float | None = None):
    model = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_dim=14336, mlp="swiglu")
    layout = Layout(dp=8, zero=zero, microbatches=microbatches,
                    activation_checkpointing="selective")
    hardware = PROFILES[profile]
    if contention is not None:
        hardware = dataclasses.replace(hardware, overlap_contention=contention)
    return estimate(Workload(model, 8192, 16 * microbatches, "bf16", traits), layout,
                    Cluster(hardware, 8, 8))


def test_overlap_table_adds_up_and_only_dp_overlaps():
    model = ModelConfig(vocab_size=51200, dim=4096, n_layers=8, n_heads=32, ffn_dim=16384,
                        mlp="gelu")
    layout = Layout(dp=4, tp=4, pp=2, microbatches=8, sequence_parallel=True)
    result = estimate(Workload(model, 2048, 64), layout, Cluster(PROFILES["h100-80g"], 32, 8))
    table, breakdown = result["overlap"], result["breakdown"]
    assert tuple(table) == OVERLAP_AXES
    for axis, entry in table.items():
        assert entry["overlapped_s"] + entry["exposed_s"] == pytest.approx(entry["total_s"])
        if axis != "dp":  # blocking collectives / transfers the receiver waits for
            assert entry["overlapped_s"] == 0.0
    assert table["dp"]["total_s"] == pytest.approx(breakdown["dp_comm_total_s"])
    assert table["dp"]["exposed_s"] == pytest.approx(breakdown["dp_comm_exposed_s"])
    assert table["tp"]["exposed_s"] > 0 and table["pp"]["exposed_s"] > 0


def test_fsdp_prefetch_hides_most_of_the_traffic_on_gpus_but_not_the_first_gather():
    dp = _llama_8b_fsdp("h100-80g", contention=0.0)["overlap"]["dp"]
    assert dp["overlapped_s"] > 0.8 * dp["total_s"]
    assert dp["exposed_s"] > 0  # the first unit's gather and the last reduce-scatter


def test_hidden_traffic_still_costs_the_profiles_contention_of_its_time():
    free = _llama_8b_fsdp("h100-80g", contention=0.0)
    charged = _llama_8b_fsdp("h100-80g")
    contention = PROFILES["h100-80g"].overlap_contention
    assert contention == OVERLAP_CONTENTION > 0
    hidden = free["overlap"]["dp"]["overlapped_s"]
    assert charged["overlap"]["dp"]["exposed_s"] == pytest.approx(
        free["overlap"]["dp"]["exposed_s"] + contention * hidden)
    assert charged["step_time_s"] == pytest.approx(free["step_time_s"] + contention * hidden)
    assert (charged["overlap_contention"], free["overlap_contention"]) == (contention, 0.0)
    # Tensor-parallel traffic pipelined with the GEMMs (Transformer Engine's overlap) likewise.
    model = ModelConfig(vocab_size=51200, dim=4096, n_layers=4, n_heads=32, ffn_dim=16384,
                        mlp="gelu")
    layout = Layout(tp=8, sequence_parallel=True)
    tp = {}
    for value in (0.0, contention):
        hardware = dataclasses.replace(PROFILES["h100-80g"], overlap_contention=value)
        tp[value] = estimate(Workload(model, 2048, 8, "bf16", MEGATRON_CORE_2024), layout,
                             Cluster(hardware, 8, 8))["overlap"]["tp"]
    assert tp[0.0]["overlapped_s"] > 0
    assert tp[contention]["exposed_s"] == pytest.approx(
        tp[0.0]["exposed_s"] + contention * tp[0.0]["overlapped_s"])
    # A CPU hides nothing, so there is nothing to charge.
    assert BUILTIN_CPU.overlap_contention == 0.0
    cpu = estimate(Workload(model, 2048, 8), Layout(dp=2), Cluster(BUILTIN_CPU, 2, 2))
    assert cpu["overlap_contention"] == 0.0 and cpu["overlap"]["dp"]["overlapped_s"] == 0.0


def test_stacks_and_cpus_that_do_not_overlap_expose_everything():
    megatron = _llama_8b_fsdp("h100-80g", MEGATRON_2021)["overlap"]["dp"]
    assert megatron["overlapped_s"] == 0.0 and megatron["total_s"] > 0
    model = ModelConfig(vocab_size=264, dim=256, n_layers=4, n_heads=8, ffn_dim=704)
    cpu = estimate(Workload(model, 128, 16, "fp32"), Layout(dp=2, zero=3),
                   Cluster(BUILTIN_CPU, 2, 2))["overlap"]["dp"]
    assert cpu["overlapped_s"] == 0.0 and cpu["total_s"] > 0


def test_zero2_hides_behind_every_micro_batch_zero1_behind_the_last_only():
    """Same model and micro-batch, 8 micro-batches: ZeRO-2 moves 8x the gradient bytes but has
    8 backwards to hide them; ZeRO-1 reduces once, during the last backward."""
    zero1 = _llama_8b_fsdp("h100-80g", zero=1, microbatches=8)["overlap"]["dp"]
    zero2 = _llama_8b_fsdp("h100-80g", zero=2, microbatches=8)["overlap"]["dp"]
    assert zero2["total_s"] > 4 * zero1["total_s"]
    assert zero2["overlapped_s"] > 4 * zero1["overlapped_s"]


def test_megatron_torch_ddp_reduces_every_micro_batch_under_a_pipeline_only():
    """Megatron-LM's pipeline schedules never enter DDP's ``no_sync``: with a pipeline, its
    torch-DDP stack reduces the gradients once per micro-batch; without one, once per step (its
    no-pipeline schedule does use ``no_sync``), as its local-DDP stack always does."""
    model = ModelConfig(vocab_size=51200, dim=4096, n_layers=32, n_heads=32, ffn_dim=16384,
                        mlp="gelu")
    cluster = Cluster(PROFILES["a100-80g"], 64, 8)

    def dp_total(traits, pp, microbatches):
        layout = Layout(dp=64 // (2 * pp), tp=2, pp=pp, microbatches=microbatches,
                        activation_checkpointing="full")
        return estimate(Workload(model, 2048, 512, "bf16", traits), layout,
                        cluster)["overlap"]["dp"]["total_s"]

    pipelined = [dp_total(MEGATRON_2021_TORCH_DDP, 4, m) for m in (8, 16)]
    assert pipelined[1] == pytest.approx(2 * pipelined[0], rel=1e-9)
    flat = [dp_total(MEGATRON_2021_TORCH_DDP, 1, m) for m in (8, 16)]
    assert flat[1] == pytest.approx(flat[0], rel=1e-9)
    local = [dp_total(MEGATRON_2021, 4, m) for m in (8, 16)]
    assert local[1] == pytest.approx(local[0], rel=1e-9)
