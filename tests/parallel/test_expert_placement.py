"""Dynamic expert placement (``parallel.ep_rebalance_every``): the placement planner, moves of
parameters and optimizer state across ZeRO shards, the busiest ep rank's load before and after a
rebalance with a skewed router, parity with one process, checkpoints and validation.

The skewed router is honest routing with a fixed selection bias: ``moe_balance = "bias"`` with
``moe_bias_rate = 0`` and the test setting the bias of experts 0 and 1 (ep rank 0's at start)
to 1, above any softmax score, so every token picks both. fp32; tolerances of
:mod:`meshtrain.commands.verify`. Each multi-process test spawns one world and runs all its cases
in it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
)
from meshtrain.config import Config, ConfigError, config_from_dict, load_config
from meshtrain.parallel.comm import CommLog, CountedComm
from meshtrain.parallel.expert import ExpertParallelExperts
from meshtrain.parallel.expert.move import param_segments
from meshtrain.parallel.expert.placement import plan_placement, rank_loads
from meshtrain.validation.run_config import validate_config
from tests.distributed import run_distributed
from tests.helpers import tiny_config

MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
SKEW = ("model.moe_balance=bias", "model.moe_bias_rate=0")
HOT = [0, 1]
ASSIGNMENTS = 8 * 16 * 2  # global_batch × seq_len × top_k per MoE layer per step


# ------------------------------------------------------------------ single process
def test_plan_placement_lowers_the_busiest_rank_and_keeps_balanced_layouts():
    hot = plan_placement([100, 100, 0, 0], [0, 1, 2, 3], ep=2)
    assert rank_loads([100, 100, 0, 0], [0, 1, 2, 3], 2) == [200, 0]
    assert rank_loads([100, 100, 0, 0], hot, 2) == [100, 100]
    assert hot == [0, 3, 2, 1]  # experts that stay keep their slot; only two move
    assert plan_placement([5, 5, 5, 5], [0, 1, 2, 3], ep=2) == [0, 1, 2, 3]  # no gain: no move
    loads = [9, 8, 7, 6, 4, 3, 2, 1]
    new = plan_placement(loads, list(range(8)), ep=4)
    assert max(rank_loads(loads, list(range(8)), 4)) == 17 and max(rank_loads(loads, new, 4)) == 10
    assert sorted(new) == list(range(8))
    assert plan_placement(loads, new, ep=4) == new  # stable once balanced


@pytest.mark.parametrize("edp, lead, sharded", [(2, 3, False), (2, 3, True), (3, 1, True),
                                                (2, 0, True)])
def test_moves_bring_every_element_to_its_new_slot(edp, lead, sharded):
    """Simulate ep=2 × edp ranks holding (ZeRO) shards of one bucket with two expert params,
    apply the planned segments and compare with the expected permuted tensors."""
    ep, local, per_expert = 2, 2, 5
    old, new = [0, 1, 2, 3], [3, 0, 2, 1]  # changes rank and local index
    offsets = (lead, lead + local * per_expert)  # a parameter maybe not at the bucket start
    numel = offsets[1] + local * per_expert
    shard_numel = -(-numel // edp) if sharded else None  # as FlatBucket pads and shards
    padded = shard_numel * edp if sharded else numel
    full = {e: torch.arange(per_expert, dtype=torch.float32) + 100 * e for e in range(4)}

    def bucket(placement, ep_rank):
        out = torch.full((padded,), -1.0)
        for p, off in enumerate(offsets):
            for k in range(local):
                e = placement[ep_rank * local + k]
                out[off + k * per_expert:off + (k + 1) * per_expert] = full[e] + 1000 * p
        return out

    def held(buf, edp_rank):
        if shard_numel is None:
            return buf.clone()
        return buf[edp_rank * shard_numel:(edp_rank + 1) * shard_numel].clone()

    ranks = {d: held(bucket(old, d % ep), d // ep) for d in range(ep * edp)}
    before = {d: t.clone() for d, t in ranks.items()}
    segments = [s for off in offsets
                for s in param_segments(0, off, per_expert, old, new, ep, edp, shard_numel)]
    for s in segments:
        ranks[s.dst][s.dst_at:s.dst_at + s.length] = before[s.src][s.src_at:s.src_at + s.length]
    for d in range(ep * edp):
        torch.testing.assert_close(ranks[d], held(bucket(new, d % ep), d // ep), rtol=0, atol=0)
    assert all(s.src != s.dst or s.src_at != s.dst_at for s in segments)


def test_slot_order_forward_is_bitwise_the_identity_forward():
    """Experts re-placed (weights permuted with the placement) give bitwise the same outputs
    and gradients: the rows of each expert are the same, in the same order."""
    from meshtrain.model.moe import GroupedExperts

    torch.manual_seed(0)
    plain = GroupedExperts(4, 8, 16)
    for p in plain.parameters():
        torch.nn.init.normal_(p)
    comm = CountedComm("ep", None, 1, CommLog())
    ident, moved = (ExpertParallelExperts(plain, comm, 0, 1) for _ in range(2))
    slots = [2, 0, 3, 1]
    moved.placement.slots = slots
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(moved, name).copy_(getattr(plain, name)[slots])
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 8)
    outs, grads = [], []
    for module in (ident, moved):
        xi = x.clone().requires_grad_()
        out = module(xi, counts)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append((xi.grad, module.w1.grad))
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1][slots], grads[1][1])
    assert moved.pop_rows_received() == int(counts.sum()) and moved.rows_received == 0


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.ep_rebalance_every=-1"], "at least 0"),
    (["parallel.ep_rebalance_every=2"], "needs parallel.ep > 1"),
    ([*MOE, "parallel.dp=2", "parallel.ep_rebalance_every=3"], "needs parallel.ep > 1"),
])
def test_rebalance_key_is_validated(overrides, fragment, capsys):
    from meshtrain.cli import main

    with pytest.raises(ConfigError, match=fragment):
        validate_config(load_config(None, overrides), None)
    assert main(["train"] + [a for o in overrides for a in ("--set", o)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    tiny_config(*MOE, "parallel.ep=2", "parallel.ep_rebalance_every=3", nproc=2)  # accepted


# ------------------------------------------------------------------ multi-process
def _trainer(config_dict: dict, skew: bool):
    from meshtrain.model import moe_layers
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    if skew:
        for layer in moe_layers(trainer.model):
            layer.expert_bias[HOT] = 1.0  # softmax scores are < 1: every token picks 0 and 1
    return trainer


def _rows_received(trainer) -> dict[str, int]:
    from meshtrain.model.moe import layer_index

    return {str(layer_index(name)): module.pop_rows_received()
            for name, module in trainer.model.named_modules()
            if isinstance(module, ExpertParallelExperts)}


def run_case(config_dict: dict, steps: int, skew: bool, forced: dict[int, dict]) -> dict:
    """Train ``steps`` steps; after step ``s`` adopt ``forced[s]`` (layer -> slots) if given.
    Returns this rank's records, rows its experts computed per step, and its coordinates."""
    trainer = _trainer(config_dict, skew)
    records, rows = [], []
    for step in range(1, steps + 1):
        records.append(trainer.train_step())
        rows.append(_rows_received(trainer))
        if step in forced:
            trainer.expert_placer.place(forced[step])
    mesh = trainer.mesh
    return {"records": records, "rows": rows, "ep_rank": mesh.ep_rank,
            "tp_rank": mesh.tp_rank}


def run_cases(cases: list[tuple[dict, int, bool, dict]]) -> list[dict]:
    """Several :func:`run_case` one after another in one world."""
    return [run_case(*case) for case in cases]


def _reference(config: Config, steps: int, skew: bool) -> list[dict]:
    ref = reference_config(config)
    return run_case(ref.to_dict(), steps, skew, {})["records"]


def _assert_parity(config: Config, records: list[dict], skew: bool) -> None:
    report = compare(records, _reference(config, len(records), skew), LOSS_TOLERANCE_FP32,
                     GRAD_NORM_RTOL_FP32)
    assert report["ok"], (config.parallel, report)


def test_skewed_router_rebalance_lowers_busiest_rank_and_matches_one_process():
    """(1) the busiest ep rank's tokens fall after a rebalance (metric and measured rows);
    (2) losses and gradient norms still match one process: dp4 ep2 ZeRO-1, dp2 ep2 pp2 ZeRO-1,
    dp2 ep2 tp2, and dp4 ep2 ZeRO-2 with forced general permutations (experts change rank *and*
    local index, across ZeRO shards)."""
    every2 = ("parallel.ep_rebalance_every=2",)
    skewed = tiny_config(*MOE, *SKEW, *every2, "parallel.ep=2", "parallel.zero=1",
                         "parallel.check_replicas_every=1", nproc=4)
    piped = tiny_config(*MOE, *SKEW, *every2, "parallel.ep=2", "parallel.pp=2",
                        "parallel.zero=1", "parallel.microbatches=2", "model.n_layers=4",
                        nproc=4)
    forced_cfg = tiny_config(*MOE, "model.moe_balance=bias", "model.moe_bias_rate=0.01",
                             "parallel.ep=2", "parallel.zero=2",
                             "parallel.check_replicas_every=1", nproc=4)  # replicas agree
    forced = {1: {0: [1, 3, 0, 2], 1: [2, 3, 0, 1]}, 2: {0: [3, 2, 1, 0]}}
    tensor = tiny_config(*MOE, *SKEW, *every2, "parallel.ep=2", "parallel.tp=2",
                         "parallel.zero=1", nproc=4)  # ep=2 folded over the tp ranks
    layouts = [(skewed, True), (piped, True), (forced_cfg, False), (tensor, True)]
    cases = [(skewed.to_dict(), 4, True, {}), (piped.to_dict(), 4, True, {}),
             (forced_cfg.to_dict(), 4, False, forced), (tensor.to_dict(), 4, True, {})]
    by_rank = run_distributed(4, run_cases, cases, timeout=900)

    for index, (config, skew) in enumerate(layouts):
        records = by_rank[0][index]["records"]
        _assert_parity(config, records, skew)
        # The metric is what the ep ranks' experts really computed, summed over every rank
        # (expert groups, and tp ranks: folded over tp, no assignment is computed twice).
        for step, record in enumerate(records):
            for layer, stats in record["moe"]["layers"].items():
                measured = [0, 0]
                for rank in by_rank:
                    if layer in rank[index]["rows"][step]:
                        measured[rank[index]["ep_rank"]] += rank[index]["rows"][step][layer]
                assert stats["ep_rank_tokens"] == measured, (index, step, layer)

    for index in (0, 1, 3):
        moe = [r["moe"] for r in by_rank[0][index]["records"]]
        before, after = moe[1]["ep_max_rank_tokens"], moe[2]["ep_max_rank_tokens"]
        assert before == ASSIGNMENTS and moe[0]["ep_max_rank_tokens"] == ASSIGNMENTS
        assert after == ASSIGNMENTS / 2 == moe[3]["ep_max_rank_tokens"]  # halved
        assert all(m["ep_mean_rank_tokens"] == ASSIGNMENTS / 2 for m in moe)
        layers = len(moe[0]["layers"])
        assert [m["ep_experts_moved"] for m in moe] == [0, 2 * layers, 0, 0]
    print(f"busiest ep rank tokens per MoE layer per step: before {before:.0f}, after {after:.0f}"
          f" (mean {ASSIGNMENTS / 2:.0f})")
    moved = [r["moe"]["ep_experts_moved"] for r in by_rank[0][2]["records"]]
    assert moved == [0, 0, 0, 0]  # forced moves are not rebalances


def checkpoint_story(straight: dict, saved: dict, same: dict, other: dict, split: int) -> dict:
    """An uninterrupted skewed run; a run saved after ``split`` steps (after a rebalance); the
    same-layout and another-layout resumes of it. Returns the losses (rank 0's matter)."""
    def fit(config_dict):
        return [r["loss"] for r in _trainer(config_dict, skew=True).fit()]

    out = {"straight": fit(straight)}
    trainer = _trainer(saved, skew=True)
    out["first"] = [trainer.train_step()["loss"] for _ in range(split)]
    out["placements"] = trainer.expert_placer.placements
    trainer.save_checkpoint()
    out["same"], out["other"] = fit(same), fit(other)
    resumed = _trainer(same, skew=True)
    resumed.restore()
    out["restored"] = resumed.expert_placer.placements
    out["restored_step"] = resumed.train_step()["moe"]["ep_max_rank_tokens"]
    return out


def test_checkpoint_after_rebalance_resumes_at_any_layout(tmp_path):
    """(3) saved at dp4 ep2 ZeRO-1 after a rebalance; resumed at the same layout (exactly the
    uninterrupted run), at dp4 ep4 ZeRO-2 and on one process (within the verify tolerance)."""
    total, split = 6, 3
    root = tmp_path / "saved" / "checkpoints"
    base = (*MOE, *SKEW, f"train.steps={total}")
    ep2 = ("parallel.ep=2", "parallel.zero=1", "parallel.ep_rebalance_every=2")
    resume = (f"checkpoint.dir={root}", "checkpoint.resume=auto")

    def cfg(name, *overrides, nproc=4):
        return tiny_config(*base, *overrides, run_dir=str(tmp_path / name), nproc=nproc).to_dict()

    result = run_distributed(4, checkpoint_story, cfg("straight", *ep2), cfg("saved", *ep2),
                             cfg("same", *ep2, *resume),
                             cfg("other", "parallel.ep=4", "parallel.zero=2",
                                 "parallel.ep_rebalance_every=2", *resume),
                             split, timeout=900)[0]
    assert result["placements"] == {0: [0, 3, 2, 1], 1: [0, 3, 2, 1]}  # re-placed at step 2
    assert result["restored"] == result["placements"]  # same ep: the saved placement is back
    assert result["restored_step"] == ASSIGNMENTS / 2  # and balances the very next step
    one = config_from_dict(cfg("one", *resume, nproc=1))
    reference = [r["loss"] for r in _trainer(cfg("reference", nproc=1), skew=True).fit()]
    shutil.copytree(root, tmp_path / "copy")  # the one-process resume must not touch it
    one.checkpoint.dir = str(tmp_path / "copy")
    rest = [r["loss"] for r in _trainer(one.to_dict(), skew=True).fit()]

    first = result["first"]
    assert result["straight"] == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    assert first + result["same"] == result["straight"]  # same layout: exactly the same run
    for resumed in (result["other"], rest):
        assert len(resumed) == total - split
        assert first + resumed == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    # Final weights gathered from a re-placed layout are in canonical expert order.
    from meshtrain.checkpoint import iter_weights

    saved = dict(iter_weights(tmp_path / "straight" / "final"))
    expected = dict(iter_weights(tmp_path / "reference" / "final"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)
