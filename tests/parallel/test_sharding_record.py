"""Sharding facts live in one typed record per parameter, in the parallelised model's table, and
never on the parameters (or modules) themselves: dense one process, tp + SP, pp, ep and ZeRO-3.
"""

from __future__ import annotations

import torch

from meshtrain.config import config_from_dict
from tests.distributed import run_distributed
from tests.helpers import tiny_config

MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
LAYOUTS = {
    "tp-sp": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp": ("parallel.pp=2", "parallel.microbatches=2"),
    "ep": (*MOE, "parallel.ep=2", "parallel.zero=1"),
    "zero3": ("parallel.zero=3",),
}


def describe(config_dicts: list[dict]) -> list[dict]:
    """Parallelise a meta-built model for each config; per parameter, its local shape, its
    record's fields and any ``_meshtrain_*`` attribute found on it or on a module."""
    from meshtrain.model import Transformer
    from meshtrain.parallel import ParallelPlan, parallel_state, parallelize
    from meshtrain.run.worker import build_mesh

    out = []
    for config_dict in config_dicts:
        config = config_from_dict(config_dict)
        config.model.vocab_size = 264  # no tokenizer here (divisible by tp)
        mesh = build_mesh(config)
        with torch.device("meta"):
            model = Transformer(config.model)
        model = parallelize(model, mesh, ParallelPlan.from_config(config))
        state = parallel_state(model)
        stray = [f"{name}.{key}" for name, p in model.named_parameters() for key in vars(p)
                 if key.startswith("_meshtrain_")]
        stray += [f"{name}:{key}" for name, m in model.named_modules() for key in vars(m)
                  if key.startswith("_meshtrain_")]
        params = {}
        for name, p in model.named_parameters():
            record = state.shardings[name]
            params[name] = {"shape": tuple(p.shape), "full_shape": record.full_shape,
                            "offset": record.offset, "tp_dim": record.tp_dim,
                            "ep_dim": record.ep_dim, "dp_axis": record.dp_axis,
                            "tp_replicated": record.tp_replicated,
                            "tp_partial_grad": record.tp_partial_grad,
                            "expert_rows": record.expert_rows()}
        out.append({"stray": stray, "params": params, "records": sorted(state.shardings),
                    "tp_rank": mesh.tp_rank, "ep_rank": mesh.ep_rank, "pp_rank": mesh.pp_rank,
                    "zero3": state.dp_engine.stage == 3})
    return out


def _check_common(case: dict) -> None:
    assert not case["stray"], case["stray"]
    assert case["records"] == sorted(case["params"])  # exactly one record per parameter


def _check_whole(params: dict) -> None:
    for name, p in params.items():
        assert p["full_shape"] is None and p["offset"] is None, name
        assert p["tp_dim"] is None and p["ep_dim"] is None and p["dp_axis"] == "dp", name
        assert not p["tp_replicated"] and not p["tp_partial_grad"], name


def _check_tp_sp(case: dict) -> None:
    rank, params = case["tp_rank"], case["params"]
    for name in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w1.weight",
                 "tok_embeddings.weight"):
        p = params[name]
        rows = p["shape"][0]
        assert p["tp_dim"] == 0 and p["full_shape"] == (2 * rows, p["shape"][1]), (name, p)
        assert p["offset"] == (rank * rows, 0), (name, p)
    wo = params["layers.0.attention.wo.weight"]
    cols = wo["shape"][1]
    assert wo["tp_dim"] == 1 and wo["full_shape"] == (wo["shape"][0], 2 * cols)
    assert wo["offset"] == (0, rank * cols)
    norm = params["layers.0.attention_norm.weight"]
    assert norm["tp_replicated"] and norm["tp_partial_grad"] and norm["full_shape"] is None
    for name, p in params.items():
        assert (p["tp_dim"] is not None) != p["tp_replicated"], (name, p)
        assert p["ep_dim"] is None and p["dp_axis"] == "dp", name


def _check_pp(case: dict) -> None:
    params = case["params"]
    expected = ({"tok_embeddings.weight", "layers.0.attention.wq.weight"} if case["pp_rank"] == 0
                else {"norm.weight", "layers.1.attention.wq.weight"})
    assert expected <= set(params), sorted(params)
    assert not any(name.startswith(f"layers.{1 - case['pp_rank']}.") for name in params)
    _check_whole(params)


def _check_ep(case: dict) -> None:
    rank, params = case["ep_rank"], case["params"]
    experts = {n: p for n, p in params.items() if ".moe.experts." in n}
    assert experts
    for name, p in experts.items():
        local = p["shape"][0]
        assert local == 2 and p["full_shape"] == (4, *p["shape"][1:]), (name, p)
        assert p["ep_dim"] == 0 and p["dp_axis"] == "edp" and p["tp_dim"] is None, (name, p)
        assert p["offset"] == (rank * local, 0, 0), (name, p)
        assert p["expert_rows"] == [rank * local, rank * local + 1], (name, p)
    _check_whole({n: p for n, p in params.items() if n not in experts})


def _check_zero3(case: dict) -> None:
    assert case["zero3"]
    _check_whole(case["params"])  # ZeRO shards flat buckets, not parameters: nothing to record


def test_one_process_dense_model_has_whole_records_and_no_attributes():
    case, = describe([tiny_config().to_dict()])
    _check_common(case)
    assert case["params"] and not case["zero3"]
    _check_whole(case["params"])


def test_layouts_keep_their_facts_in_records_not_on_parameters():
    configs = [tiny_config(*overrides, nproc=2).to_dict() for overrides in LAYOUTS.values()]
    checks = {"tp-sp": _check_tp_sp, "pp": _check_pp, "ep": _check_ep, "zero3": _check_zero3}
    for rank_cases in run_distributed(2, describe, configs, timeout=900):
        for layout, case in zip(LAYOUTS, rank_cases, strict=True):
            _check_common(case)
            checks[layout](case)
