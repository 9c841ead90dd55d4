"""DiLoCo replica groups (``parallel.replicas``) on CPU processes.

The identity: with H = 1, outer lr 1 and no outer momentum, averaging the groups' pseudo-
gradients averages their weights after every step. That equals synchronous data parallelism over
replicas × dp ranks only when the inner step is *linear* in the gradient: averaging AdamW
updates of different gradients is not the AdamW update of their mean (each group divides by its
own second moment). So the identity test makes AdamW linear: ``adam_eps = 1e8`` dwarfs
``sqrt(v)`` (gradients are ~1e-2, below the fp32 spacing of 1e8), leaving
``θ ← θ(1 − lr·wd) − lr/eps · m̂``, SGD with momentum and decoupled decay, whose momentum is
linear in the gradients too (every group keeps its own, and their mean is the synchronous
one). Clipping is per group, also not linear, so it is off. The tolerance, 2e-5 absolute on the
loss, is fp32 rounding (the two runs sum the same terms in another order and the outer step
computes start − (start − mean)); measured differences are ~1e-7.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

IDENTITY_TOLERANCE = 2e-5
LINEAR_ADAM = ("train.adam_eps=1e8", "train.lr=1e6", "train.min_lr=1e5",
               "train.weight_decay=1e-8", "train.grad_clip=0")
DILOCO_H1 = ("parallel.sync_every=1", "train.outer_lr=1", "train.outer_momentum=0")
STEPS = 5


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_h1_outer_sgd_equals_synchronous_dp():
    """replicas 2 × dp 1 vs dp 2, replicas 2 × tp 2 vs dp 2 × tp 2, replicas 2 × dp 2 (ZeRO-1:
    the outer state sharded like the masters) vs dp 4, replicas 2 × pp 2 vs dp 2 × pp 2, and an
    MoE model at replicas 2 × (dp 2, ep 2) vs dp 4 × ep 2."""
    two = [tiny_config(*LINEAR_ADAM, "parallel.dp=2", nproc=2),
           tiny_config(*LINEAR_ADAM, *DILOCO_H1, "parallel.replicas=2", nproc=2)]
    four = [tiny_config(*LINEAR_ADAM, "parallel.dp=2", "parallel.tp=2", nproc=4),
            tiny_config(*LINEAR_ADAM, *DILOCO_H1, "parallel.replicas=2", "parallel.tp=2",
                        nproc=4),
            tiny_config(*LINEAR_ADAM, "parallel.dp=4", nproc=4),
            tiny_config(*LINEAR_ADAM, *DILOCO_H1, "parallel.replicas=2", "parallel.zero=1",
                        nproc=4)]
    pipe = ("parallel.pp=2", "parallel.microbatches=2")
    moe = ("model.moe_experts=4", "parallel.ep=2")
    four += [tiny_config(*LINEAR_ADAM, *pipe, "parallel.dp=2", nproc=4),
             tiny_config(*LINEAR_ADAM, *DILOCO_H1, *pipe, "parallel.replicas=2", nproc=4),
             tiny_config(*LINEAR_ADAM, *moe, "parallel.dp=4", nproc=4),
             tiny_config(*LINEAR_ADAM, *DILOCO_H1, *moe, "parallel.replicas=2", nproc=4)]
    sync2, diloco2 = run_distributed(2, train_many, [c.to_dict() for c in two], STEPS)[0]
    results = run_distributed(4, train_many, [c.to_dict() for c in four], STEPS)[0]
    pairs = [(sync2, diloco2)] + list(zip(results[::2], results[1::2], strict=True))
    for sync, diloco in pairs:
        assert _losses(diloco) == pytest.approx(_losses(sync), abs=IDENTITY_TOLERANCE)
        print("H=1 identity, largest loss difference:",
              max(abs(a - b) for a, b in zip(_losses(diloco), _losses(sync), strict=True)))
        assert _losses(diloco)[-1] < _losses(diloco)[0] - 0.05  # it trains
        assert [r["tokens"] for r in diloco] == [r["tokens"] for r in sync]
        assert "replica" in diloco[0]["comm_bytes"] and "replica" not in sync[0]["comm_bytes"]


def _train_and_fingerprint(config_dict: dict, steps: int) -> tuple[list[dict], list[float]]:
    """Train ``steps`` steps; return rank 0's records and every rank's master checksums."""
    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    mesh = build_mesh(config)
    trainer = Trainer(config, mesh)
    records = [trainer.train_step() for _ in range(steps)]
    sums = [float(s.master.double().sum()) for s in trainer.optimizer.shards]
    return (records if mesh.is_logging_rank else []), sums


def test_rounds_traffic_and_groups_end_in_sync():
    """H = 3 over 7 steps (rounds end at 3, 6 and the last step), default outer optimizer:
    pseudo-gradient traffic only at a round's end, bf16 halves it, every group ends equal."""
    steps = 7
    fp32 = tiny_config("parallel.replicas=2", "parallel.sync_every=3", f"train.steps={steps}",
                       nproc=2)
    bf16 = tiny_config("parallel.replicas=2", "parallel.sync_every=3", f"train.steps={steps}",
                       "parallel.outer_grad_dtype=bf16", nproc=2)
    results = run_distributed(2, _train_and_fingerprint, fp32.to_dict(), steps)
    records = results[0][0]
    assert results[0][1] == results[1][1]  # both groups hold the same weights at the end
    metrics_only = 2 * (2 - 1) // 2 * (5 + 2) * 4  # per step: 5 fp32 numbers + 2 group tokens
    traffic = [r["comm_bytes"]["replica"] for r in records]
    sync_steps = [3, 6, 7]
    for step, moved in enumerate(traffic, 1):
        if step in sync_steps:
            assert moved > 100 * metrics_only
        else:
            assert moved == metrics_only
    import dataclasses

    from meshtrain.data.tokenizer import ByteTokenizer
    from meshtrain.model import count_parameters

    model = dataclasses.replace(fp32.model, vocab_size=ByteTokenizer().vocab_size)
    params = count_parameters(model)["total"]
    assert traffic[2] - metrics_only == pytest.approx(4 * params, rel=0.01)  # 2(n-1)/n · 4P
    half = run_distributed(2, _train_and_fingerprint, bf16.to_dict(), steps)[0][0]
    assert half[2]["comm_bytes"]["replica"] - metrics_only == pytest.approx(2 * params, rel=0.01)
    losses = torch.tensor(_losses(records))
    assert torch.isfinite(losses).all() and losses[-2:].mean() < losses[:2].mean()
    # Start weights + momentum: as many bytes as Adam's two moments.
    assert records[0]["mem"]["outer_bytes"] == records[0]["mem"]["optim_bytes"]


def test_mesh_puts_replica_groups_outermost():
    from meshtrain.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(replicas=2, dp=2, tp=2, rank=5)  # replica 1, dp 0, tp 1
    assert (mesh.replica_rank, mesh.dp_rank, mesh.tp_rank, mesh.world_size) == (1, 0, 1, 8)
    members = mesh._axis_members()
    assert members["replica"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert members["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert members["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("replica") == [1, 5] and mesh.group_ranks("dp") == [5, 7]
    assert ParallelMesh(dp=2).group_ranks("replica") == [0]


@pytest.mark.parametrize("overrides, nproc, words", [
    (("parallel.replicas=3",), 4, "multiples of 3"),
    (("parallel.replicas=0",), 4, "parallel.replicas"),
    (("parallel.replicas=2", "parallel.sync_every=0"), 2, "parallel.sync_every"),
    (("parallel.replicas=2", "train.outer_lr=0"), 2, "train.outer_lr"),
    (("parallel.replicas=2", "train.outer_momentum=1"), 2, "train.outer_momentum"),
    (("parallel.replicas=2", "parallel.outer_grad_dtype=fp16"), 2, "fp32, bf16, int8, fp8"),
    (("parallel.replicas=2", "parallel.auto=true"), 2, "parallel.auto"),
    (("parallel.replicas=2", "parallel.check_replicas_every=1"), 2, "check_replicas_every"),
    (("parallel.replicas=2", "parallel.sync_every=2", "parallel.sync_fragments=3"), 2,
     "valid: 1 to 2"),
    (("parallel.sync_fragments=2", "parallel.sync_every=2"), 2, "needs parallel.replicas"),
    (("parallel.replicas=2", "train.global_batch=6", "parallel.microbatches=2"), 4,
     "replicas × dp"),
])
def test_bad_replica_settings_are_refused(overrides, nproc, words):
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=words.replace("×", ".")) as error:
        tiny_config(*overrides, nproc=nproc)
    assert any(word in str(error.value) for word in ("valid", "must", "choose"))


def _fit_many(config_dicts: list[dict]) -> list[list[float]]:
    """``Trainer.fit`` (restoring first) of each config in turn; every one's losses."""
    from tests.parallel.test_checkpoint import uninterrupted

    return [uninterrupted(c) for c in config_dicts]


def test_checkpoint_mid_round_resumes_bitwise(tmp_path):
    """replicas 2 × (dp 2, ZeRO-1) stopped after step 4 of 7, mid-round (H = 3, rounds end at 3
    and 6): the resumed run's losses equal the uninterrupted run's bitwise, and within fp32
    tolerance when resumed at another inner layout; a checkpoint with replica groups refuses
    another replica count; a run from weights (``init_from``) starts its first round there."""
    from meshtrain.checkpoint.manager import check_compatible, list_checkpoints
    from meshtrain.config import ConfigError
    from tests.parallel.test_checkpoint import resume_and_finish, train_then_stop, uninterrupted

    common = ("parallel.replicas=2", "parallel.sync_every=3", "train.steps=7")
    saved = tiny_config(*common, "parallel.zero=1", run_dir=str(tmp_path / "run"), nproc=4)
    first = run_distributed(4, train_then_stop, saved.to_dict(), 4)[0]
    resumed = tiny_config(*common, "parallel.zero=1", "checkpoint.resume=auto",
                          run_dir=str(tmp_path / "run"), nproc=4)
    rest = run_distributed(4, resume_and_finish, resumed.to_dict())[0]
    straight = tiny_config(*common, "parallel.zero=1", run_dir=str(tmp_path / "straight"),
                           nproc=4)
    reference = run_distributed(4, uninterrupted, straight.to_dict())[0]
    assert first + rest == reference
    # The inner layout may change on resume (layout-free within each group): tp 2 instead.
    shutil.copytree(tmp_path / "run", tmp_path / "retp", ignore=shutil.ignore_patterns("final"))
    as_tp = tiny_config(*common, "parallel.tp=2", "checkpoint.resume=auto",
                        run_dir=str(tmp_path / "retp"), nproc=4)
    rest_tp = run_distributed(4, resume_and_finish, as_tp.to_dict())[0]
    assert rest_tp == pytest.approx(reference[4:], abs=LOSS_TOLERANCE_FP32)
    # Starting from weights, the first round starts from them (H = 1, linear AdamW: dp 4).
    weights = f"checkpoint.init_from={tmp_path / 'straight' / 'final'}"
    from_weights = [tiny_config(*LINEAR_ADAM, weights, "parallel.dp=4", nproc=4),
                    tiny_config(*LINEAR_ADAM, *DILOCO_H1, weights, "parallel.replicas=2",
                                nproc=4)]
    sync, diloco = run_distributed(4, _fit_many, [c.to_dict() for c in from_weights])[0]
    assert diloco == pytest.approx(sync, abs=IDENTITY_TOLERANCE)
    other = tiny_config("parallel.replicas=1", "checkpoint.resume=auto", nproc=4,
                        run_dir=str(tmp_path / "run"))
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    with pytest.raises(ConfigError, match="parallel.replicas = 2"):
        check_compatible(other, newest, 264)


def test_streaming_fragments_spread_the_traffic():
    """sync_fragments = F: each step moves at most about 1/F of a full sync's pseudo-gradient
    bytes (at dim 32 the embedding and head are each as large as a block, so with 4 blocks and
    F = 4 the largest fragment holds a block and the head: ~3 ×; at dim 128 ~4 ×), the total
    per H steps is unchanged, and the groups still end equal."""
    def peaks(fragments: int, layers: int, dim: int = 32) -> tuple[int, int]:
        config = tiny_config("parallel.replicas=2", "parallel.sync_every=4", "train.steps=8",
                             f"parallel.sync_fragments={fragments}", f"model.n_layers={layers}",
                             f"model.dim={dim}", f"model.ffn_dim={2 * dim}", nproc=2)
        results = run_distributed(2, _train_and_fingerprint, config.to_dict(), 8)
        assert results[0][1] == results[1][1]  # every fragment syncs at the last step
        traffic = [r["comm_bytes"]["replica"] for r in results[0][0]]
        return max(traffic[:7]), sum(traffic[:4])  # before the last step's sync of them all

    # At dim 128 a block (~12 dim²) is ~6 × the byte-vocabulary embedding: F = 4 gives ~4 ×.
    for fragments, layers, dim, least in ((2, 2, 32, 1.8), (4, 4, 32, 2.8), (4, 4, 128, 3.5)):
        whole, whole_total = peaks(1, layers, dim)
        streamed, streamed_total = peaks(fragments, layers, dim)
        assert whole / streamed >= least, (fragments, whole, streamed)
        print(f"F={fragments}, dim {dim}: largest per-step replica bytes {whole} -> {streamed} "
              f"({whole / streamed:.2f}x)")
        assert streamed_total == pytest.approx(whole_total, rel=0.01)


def test_fragments_split_blocks_in_order():
    from meshtrain.config.runtime_facts import fragment_of_parameters

    sizes = [("tok_embeddings.weight", 10)] + [(f"layers.{i}.w", 10) for i in range(6)] + [
        ("norm.weight", 1), ("output.weight", 9)]
    where = fragment_of_parameters(sizes, 4)
    order = [where[name] for name, _ in sizes]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}
    assert where["norm.weight"] == where["output.weight"] == 3


def test_verify_refuses_replica_groups(meshtrain):
    """(``estimate`` prices replica groups: tests/unit/test_planner_wide_area.py.)"""
    result = meshtrain("verify", "--nproc", "4", "--set", "parallel.replicas=2")
    assert result.returncode == 2
    assert "parallel.replicas = 2" in result.stderr and "valid value" in result.stderr


def test_outer_step_is_torch_nesterov_sgd():
    """The outer step on one process (one group: the average is the group's own pseudo-
    gradient) against ``torch.optim.SGD(nesterov=True)`` over three rounds."""
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.diloco.outer import OuterOptimizer
    from meshtrain.training.trainer import Trainer

    trainer = Trainer(tiny_config(), ParallelMesh())
    outer = OuterOptimizer(trainer.optimizer, trainer.mesh, 1, lr=0.7, momentum=0.9)
    master = trainer.optimizer.shards[0].master
    reference = torch.nn.Parameter(master.detach().clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        drift = torch.randn(master.shape, generator=generator) * 1e-2
        with torch.no_grad():
            master.sub_(drift)  # what the round's inner steps did
        outer.sync()
        reference.grad = drift.clone()  # the pseudo-gradient: start - now
        sgd.step()
        torch.testing.assert_close(master, reference.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(outer.start[0], master, rtol=0, atol=0)
    assert outer.rounds == 3


def _train_with_fault(config_dict: dict, steps: int, spec: str):
    """:func:`_train_and_fingerprint` with a test-only fault (:mod:`meshtrain.faults`)."""
    import os

    from meshtrain import faults

    os.environ[faults.ENV_VAR] = spec
    faults.reset()
    try:
        return _train_and_fingerprint(config_dict, steps)
    finally:
        del os.environ[faults.ENV_VAR]
        faults.reset()


def test_a_nonfinite_step_in_one_group_is_skipped_by_all():
    """A NaN loss in group 1 only (rank 1) at step 2: the groups share loss and norm, so both
    skip that step alike, and they still end the run in sync."""
    config = tiny_config("parallel.replicas=2", "parallel.sync_every=2", nproc=2)
    results = run_distributed(2, _train_with_fault, config.to_dict(), 4,
                              "nan_loss:rank=1:step=2")
    records = results[0][0]
    assert results[0][1] == results[1][1]
    assert [r["nonfinite_skips"] for r in records] == [0, 1, 1, 1]
    assert not torch.isfinite(torch.tensor(records[1]["loss"]))
