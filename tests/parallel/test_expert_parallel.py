"""Expert parallelism, and MoE layers under tensor / pipeline parallelism, on several CPU
processes against one process (fp32; tolerances of :mod:`meshtrain.commands.verify`).

Each test spawns one world and runs all its cases in it (start-up dominates on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
    run_layout,
)
from meshtrain.config import Config, config_from_dict
from tests.distributed import run_distributed
from tests.helpers import tiny_config

STEPS = 2
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
BIAS = ("model.moe_balance=bias", "model.moe_bias_rate=0.01")
AUX = ("model.moe_balance=aux-loss", "model.moe_aux_coef=0.5")  # large: a missed term shows


def train_cases(config_dicts: list[dict], steps: int, save: list[bool]) -> list[list[dict]]:
    """Train each config for ``steps`` in this worker; every rank returns its own records (for
    per-rank communication volumes); ``save[i]`` also writes case i's final weights."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    out = []
    for config_dict, do_save in zip(config_dicts, save, strict=True):
        config = config_from_dict(config_dict)
        trainer = Trainer(config, build_mesh(config))
        out.append([trainer.train_step() for _ in range(steps)])
        if do_save:
            trainer.save_final()
    return out


def _run(world: int, cases: list[Config], save: list[bool] | None = None) -> list[list[list]]:
    """``result[rank][case]`` = that rank's records."""
    save = save or [False] * len(cases)
    return run_distributed(world, train_cases, [c.to_dict() for c in cases], STEPS, save,
                           timeout=900)


def _assert_parity(config: Config, records: list[dict], reference: Config | None = None) -> None:
    expected = run_layout(reference or reference_config(config), 1, STEPS)
    report = compare(records, expected, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], (config.parallel, report)


def _expected_ep_bytes(config: Config) -> float:
    """Mean ``comm_bytes.ep`` per rank per step, dropless: four all-to-alls (dispatch, combine,
    and their backward) of ``tokens × top_k × dim`` fp32 values per MoE layer, plus one exchange
    of the E int64 counts per MoE layer per micro-batch, each × (ep - 1) / ep."""
    m, par, train = config.model, config.parallel, config.train
    layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    rows = train.global_batch // par.dp * train.seq_len * m.moe_top_k
    share = (par.ep - 1) / par.ep
    return layers * share * (4 * rows * m.dim * 4 + par.microbatches * m.moe_experts * 8)


def test_ep2_and_moe_under_tp_and_pp():
    ep2 = ("parallel.ep=2",) + MOE
    cases = [
        tiny_config(*ep2, *BIAS, "parallel.microbatches=2", nproc=2),
        tiny_config(*ep2, *AUX, "parallel.microbatches=2", "parallel.zero=2",
                    "model.moe_score=sigmoid", "model.moe_shared_experts=1",
                    "model.moe_capacity_factor=2.0", nproc=2),  # capacity that drops nothing
        tiny_config(*ep2, *AUX, "model.moe_capacity_factor=0.5",  # drops
                    "parallel.activation_checkpointing=full", nproc=2),
        tiny_config(*MOE, *AUX, "parallel.tp=2", "parallel.sequence_parallel=true",
                    "model.moe_capacity_factor=1.0", nproc=2),
        tiny_config(*MOE, *AUX, "parallel.pp=2", "parallel.microbatches=2", "model.n_layers=4",
                    "parallel.pp_schedule=zb-h1", nproc=2),
    ]
    by_rank = _run(2, cases)
    for config, records in zip(cases, by_rank[0], strict=True):
        _assert_parity(config, records)

    # Bias balancing is independent of micro-batching: the loads are the global batch's.
    fewer = reference_config(cases[0])
    fewer.parallel.microbatches = 1
    _assert_parity(cases[0], by_rank[0][0], reference=fewer)

    dropless, capped, dropping = by_rank[0][0], by_rank[0][1], by_rank[0][2]
    assert all(r["moe"]["dropped"] == 0 for r in dropless + capped)
    assert all(r["moe"]["dropped"] > 0 for r in dropping)
    layer = dropping[0]["moe"]["layers"]["0"]
    assert layer["max_over_mean"] >= 1 and layer["cv"] >= 0 and layer["dropped"] > 0
    assert dropping[0]["moe"]["aux_loss"] > 0

    for step in range(STEPS):
        mean_ep = sum(rank[0][step]["comm_bytes"]["ep"] for rank in by_rank) / len(by_rank)
        assert mean_ep == pytest.approx(_expected_ep_bytes(cases[0]), rel=1e-9)


def test_ep4_zero1_and_ep2_over_four_data_parallel_ranks():
    cases = [
        tiny_config("parallel.ep=4", "parallel.zero=1", *MOE, *BIAS, nproc=4),
        tiny_config("parallel.ep=2", "parallel.zero=2", "parallel.check_replicas_every=1", *MOE,
                    *AUX, nproc=4),
    ]
    by_rank = _run(4, cases)
    for config, records in zip(cases, by_rank[0], strict=True):
        _assert_parity(config, records)
    assert by_rank[0][1][0]["comm_bytes"]["edp"] > 0  # expert grads reduced over edp


def test_4d_dp2_ep2_tp2_pp2_matches_one_process_and_saves_full_weights(tmp_path):
    from meshtrain.checkpoint import iter_weights
    from meshtrain.commands.generate import load_for_generation
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = tiny_config("parallel.ep=2", "parallel.tp=2", "parallel.pp=2",
                         "parallel.microbatches=2", "parallel.zero=1",
                         "parallel.sequence_parallel=true", *MOE, *BIAS,
                         run_dir=str(tmp_path / "layout"), nproc=8)
    records = _run(8, [config], save=[True])[0][0]
    _assert_parity(config, records)
    fewer = reference_config(config)
    fewer.parallel.microbatches = 1
    _assert_parity(config, records, reference=fewer)

    reference = reference_config(config)
    reference.train.run_dir = str(tmp_path / "reference")
    trainer = Trainer(reference, build_mesh(reference))
    for _ in range(STEPS):
        trainer.train_step()
    trainer.save_final()
    saved = dict(iter_weights(tmp_path / "layout" / "final"))
    expected = dict(iter_weights(tmp_path / "reference" / "final"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)
    model, _, _ = load_for_generation(tmp_path / "layout")
    assert model.layers["0"].moe.experts.w1.shape[0] == 4
