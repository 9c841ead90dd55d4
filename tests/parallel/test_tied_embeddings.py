"""Tied embeddings under pipeline parallelism: the first and the last stage each hold the shared
matrix and sum its gradient over the mesh's ``tied`` group. Every layout matches one process
within meshtrain.commands.verify's fp32 tolerances (2e-4 on the loss, 1e-3 relative on the gradient
norm,
which counts the matrix once)."""

from __future__ import annotations

import torch

from meshtrain.config import config_from_dict
from tests.helpers import assert_layouts_match_one_process, tiny_config

STEPS = 3
TIED = ("model.tie_embeddings=true", "parallel.microbatches=4", "model.n_layers=4")


def test_tied_pp2_every_schedule():
    """zb-v and interleaved place the first and last stage on one rank / on two ranks."""
    cases = [tiny_config(*TIED, "parallel.pp=2", f"parallel.pp_schedule={name}",
                         f"parallel.virtual_stages={v}", nproc=2)
             for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2))]
    assert_layouts_match_one_process(2, cases, STEPS)


def test_tied_pp2_with_tp2_zero_cp_ep_and_pp4():
    cases = [
        tiny_config(*TIED, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                    nproc=4),
        tiny_config(*TIED, "parallel.pp=2", "parallel.dp=2", "parallel.zero=1", nproc=4),
        tiny_config(*TIED, "parallel.pp=2", "parallel.dp=2", "parallel.zero=2",
                    "parallel.pp_schedule=zb-h1", nproc=4),
        tiny_config(*TIED, "parallel.pp=4", nproc=4),
        tiny_config(*TIED, "parallel.pp=4", "parallel.pp_schedule=interleaved-1f1b",
                    "parallel.virtual_stages=2", "model.n_layers=8", nproc=4),
        tiny_config(*TIED, "parallel.pp=2", "parallel.cp=2", nproc=4),
        tiny_config(*TIED, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                    "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=16",
                    "model.moe_balance=bias", nproc=4),
    ]
    assert_layouts_match_one_process(4, cases, STEPS)


def train_save(config_dict: dict, steps: int) -> list[float]:
    """Train ``steps`` steps, then save a checkpoint and the final weights."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    trainer.save_checkpoint()
    trainer.save_final()
    return losses


def resume(config_dict: dict) -> list[float]:
    """Resume from the run's checkpoint and train to ``train.steps``."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    return [r["loss"] for r in Trainer(config, build_mesh(config)).fit()]


def test_tied_checkpoint_and_final_weights_hold_the_matrix_once(tmp_path):
    """Saved at pp2 × tp2 (ZeRO-1): the checkpoint and the final weights hold
    ``tok_embeddings.weight`` once and no head, equal to one process's; the checkpoint resumes at
    pp4 and on one process, continuing the one-process curve."""
    import shutil

    import pytest

    from meshtrain.checkpoint import iter_weights, read_checkpoint_tensors
    from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
    from tests.distributed import run_distributed

    def cfg(run, *overrides, nproc):
        return tiny_config(*TIED, "train.steps=4", *overrides, run_dir=str(tmp_path / run),
                           nproc=nproc)

    reference = train_save(cfg("ref", "parallel.microbatches=1", nproc=1).to_dict(), 2)
    expected = dict(iter_weights(tmp_path / "ref" / "final"))  # after 2 steps
    reference += resume(cfg("ref", "checkpoint.resume=auto", nproc=1).to_dict())
    saved = cfg("run", "parallel.pp=2", "parallel.tp=2", "parallel.zero=1", nproc=4)
    first = run_distributed(4, train_save, saved.to_dict(), 2)[0]
    assert first == pytest.approx(reference[:2], abs=LOSS_TOLERANCE_FP32)

    weights = dict(iter_weights(tmp_path / "run" / "final"))
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=1e-4, rtol=0, msg=name)
    index = (tmp_path / "run" / "final" / "model.safetensors.index.json").read_text()
    assert "output.weight" not in weights and index.count('"tok_embeddings.weight"') == 1
    _, tensors = read_checkpoint_tensors(tmp_path / "run" / "checkpoints")
    state = dict(tensors)
    assert "output.weight" not in state
    torch.testing.assert_close(state["tok_embeddings.weight"], weights["tok_embeddings.weight"])

    from meshtrain.cli import main

    assert main(["convert", "--to-hf", str(tmp_path / "run" / "checkpoints"), "--out",
                 str(tmp_path / "hf")]) == 0
    hf_names = dict(iter_weights(tmp_path / "hf"))
    assert hf_names.keys() == weights.keys()  # tied: no lm_head in, none out
    torch.testing.assert_close(hf_names["tok_embeddings.weight"], state["tok_embeddings.weight"])

    shutil.copytree(tmp_path / "run", tmp_path / "pp4")
    pp4 = run_distributed(4, resume, cfg("pp4", "parallel.pp=4", "checkpoint.resume=auto",
                                         nproc=4).to_dict())[0]
    one = resume(cfg("run", "checkpoint.resume=auto", nproc=1).to_dict())
    assert first + pp4 == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    assert first + one == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_tied_groups_join_the_ranks_of_the_first_and_last_stage():
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.parallel.pipeline import build_schedule

    assert build_schedule("1f1b", 4, 4, 1).embedding_ranks == (0, 3)
    assert build_schedule("interleaved-1f1b", 4, 4, 2).embedding_ranks == (0, 3)
    assert build_schedule("zb-v", 4, 4, 2).embedding_ranks == (0,)  # the V ends on rank 0

    def tied(rank):
        mesh = ParallelMesh(dp=2, tp=2, pp=4, rank=rank, tied_pp_ranks=(0, 3))
        return mesh.group_ranks("tied")

    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    assert tied(0) == [0, 12] and tied(13) == [1, 13] and tied(6) == [6]
    assert ParallelMesh(dp=2, pp=2, rank=1).group_ranks("tied") == [1]  # untied: alone


def embedding_after(config_dict: dict, steps: int):
    """This rank's copy of the tied matrix after ``steps`` steps (None where there is none)."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    for _ in range(steps):
        trainer.train_step()
    embedding = trainer.model.tok_embeddings
    return None if embedding is None else embedding.weight.detach().clone()


def test_the_two_copies_stay_bitwise_equal():
    from tests.distributed import run_distributed

    config = tiny_config(*TIED, "parallel.pp=2", "parallel.dp=2", "parallel.zero=1", nproc=4)
    copies = run_distributed(4, embedding_after, config.to_dict(), STEPS)
    # rank = pp_rank * dp + dp_rank: ranks 0, 1 hold the first stage, 2, 3 the last
    assert all(c is not None for c in copies)
    assert all(torch.equal(copies[0], c) for c in copies[1:])
