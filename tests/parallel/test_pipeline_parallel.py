"""Pipeline parallelism on several CPU processes against one process (fp32; tolerances of
meshtrain.commands.verify: 2e-4 on the loss, 1e-3 relative on the gradient norm)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed
from tests.helpers import assert_layouts_match_one_process, tiny_config, train_many

STEPS = 3


def _parity(world: int, cases) -> list[list[dict]]:
    return assert_layouts_match_one_process(world, cases, STEPS)


def test_pp2_every_schedule():
    base = ("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4")
    cases = [tiny_config(*base, f"parallel.pp_schedule={name}", nproc=2)
             for name in ("gpipe", "1f1b", "zb-h1")]
    cases += [tiny_config(*base, f"parallel.pp_schedule={name}", "parallel.virtual_stages=2",
                          nproc=2) for name in ("interleaved-1f1b", "zb-v")]
    cases.append(tiny_config(*base, "parallel.pp_split=1,3", nproc=2))  # uneven, explicit
    # Stages without blocks: the first chunk only the embedding, the last only the head.
    cases.append(tiny_config(*base, "parallel.pp_schedule=interleaved-1f1b",
                             "parallel.virtual_stages=2", "parallel.pp_split=0,2,2,0", nproc=2))
    results = _parity(2, cases)
    assert all(r[0]["comm_bytes"]["pp"] > 0 for r in results)


def test_pp4_1f1b():
    _parity(4, [tiny_config("parallel.pp=4", "parallel.microbatches=4", "model.n_layers=4",
                            nproc=4)])


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]
MOE_AUX = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
           "model.moe_balance=aux-loss", "model.moe_aux_coef=0.5")
WITH_OTHER_AXES = {
    "dp2-zero1": ("parallel.dp=2", "parallel.zero=1"),
    "dp2-zero2": ("parallel.dp=2", "parallel.zero=2"),
    "tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "ep2-moe": ("parallel.dp=2", "parallel.ep=2", *MOE_AUX),
    # recomputation inside I: deferred weight gradients must reach the real parameters
    "dp2-full-checkpointing": ("parallel.dp=2", "parallel.activation_checkpointing=full"),
    "dp2-selective-checkpointing": ("parallel.dp=2",
                                    "parallel.activation_checkpointing=selective"),
}


@pytest.mark.parametrize("axes", list(WITH_OTHER_AXES))
def test_every_schedule_with_another_axis(axes):
    """Each schedule at pp 2 combined with dp/ZeRO, tp + SP, ep or activation checkpointing;
    the suite runs these under NCCL's point-to-point semantics (tests/conftest.py), so message
    order and rendezvous
    sends are exercised with the other axes' collectives interleaved."""
    base = ("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4")
    _parity(4, [tiny_config(*base, *WITH_OTHER_AXES[axes], f"parallel.pp_schedule={name}",
                            f"parallel.virtual_stages={v}", nproc=4) for name, v in SCHEDULES])


@pytest.mark.slow  # make bench: the 4-D MoE test (dp2 ep2 tp2 pp2) runs 8 processes in make test
def test_dp2_tp2_pp2_eight_processes():
    _parity(8, [tiny_config("parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2",
                            "parallel.zero=1", "parallel.sequence_parallel=true", nproc=8)])


def test_measured_timeline_written(tmp_path):
    config = tiny_config("parallel.pp=2", "parallel.microbatches=4", "train.timeline_step=2",
                         run_dir=str(tmp_path), nproc=2)
    run_distributed(2, train_many, [config.to_dict()], 2, timeout=600)
    summary = json.loads((tmp_path / "timeline_summary.json").read_text())
    assert 0 <= summary["measured_bubble_fraction"] < 1
    assert 0 <= summary["simulated_bubble_fraction"] < 1
    trace = json.loads((tmp_path / "timeline.json").read_text())
    # 2 ranks × 4 micro-batches × (F, B); the last backward of rank 1 runs as I and W (1F1B's
    # early gradient send), one event more
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(names) == 2 * 2 * 4 + 1 and {"I3@s1", "W3@s1"} <= set(names)
    assert (tmp_path / "timeline.png").stat().st_size > 0


def count_deferrable_forwards(config_dict: dict) -> dict:
    """One training step; how many linear forwards went through the deferrable function, and
    how many linear layers this rank's stage holds (in all, and inside its blocks)."""
    import meshtrain.model.weight_grad as weight_grad
    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    calls = []
    original = weight_grad._deferrable_linear
    weight_grad._deferrable_linear = lambda *args: calls.append(1) or original(*args)
    try:
        trainer.train_step()
    finally:
        weight_grad._deferrable_linear = original

    def linears(module):
        return sum(isinstance(m, weight_grad.DeferrableLinear) for m in module.modules())

    return {"calls": len(calls), "layers": linears(trainer.model),
            "in_blocks": linears(trainer.model.layers)}


def test_1f1b_runs_only_the_split_micro_batches_through_the_deferrable_layers():
    """1F1B with early gradient sends at pp 2, 4 micro-batches: rank 1 splits only its last
    backward, so one micro-batch's forward (and nothing else) takes the deferrable function;
    rank 0 splits none. Under full checkpointing the recompute of the whole backwards stays
    plain as their forwards were (else the recompute would save other tensors and fail)."""
    for extra in ((), ("parallel.activation_checkpointing=full",)):
        config = tiny_config("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4",
                             *extra, nproc=2)
        first, last = run_distributed(2, count_deferrable_forwards, config.to_dict())
        assert first["calls"] == 0 and first["layers"] > 0
        # checkpointing reruns the split micro-batch's blocks (not the head) in its I
        recompute = last["in_blocks"] if extra else 0
        assert last["calls"] == last["layers"] + recompute and last["in_blocks"] > 0


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.pp=2", "model.n_layers=1"], "fewer than the 2 pipeline stages"),
    (["parallel.pp=2", "parallel.pp_split=3,2"], "adding up to model.n_layers"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b"], "virtual_stages"),
])
def test_bad_pipeline_configs(overrides, fragment):
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        tiny_config(*overrides, nproc=2)
