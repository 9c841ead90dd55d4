"""8-bit pseudo-gradient exchange (``parallel.outer_grad_dtype = "int8" | "fp8"``).

The mean over 4 ranks of random tensors with a wide range of magnitudes, exchanged in 8 bits,
must be the same on every rank (the groups stay in sync), within the rounding bound the module
states of the exact fp32 mean (two roundings: int8 at most 2 × half a step of 1/127 of the
block's largest magnitude per value; fp8 e4m3 2 × 2^-4 of the value, plus the block's smallest
normal), and move a quarter of an fp32 all-reduce's bytes. Then a training run at replicas 2
with int8 stays in sync and follows the fp32 run's losses closely.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.config import config_from_dict
from tests.distributed import run_distributed
from tests.helpers import tiny_config

N = 5000  # not a multiple of the block or of the group: the padding is exercised


def _inputs(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: normal values scaled over four decades."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(N, generator=generator) * torch.logspace(-3, 1, N)


def _mean_and_bytes(config_dict: dict, kind: str) -> tuple[torch.Tensor, int, int]:
    """This rank's quantized mean and the bytes it and an fp32 all-reduce moved."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.diloco.quantized_reduce import quantized_mean

    mesh = build_mesh(config_from_dict(config_dict))
    comm = mesh.comm("replica")
    values = _inputs(mesh.replica_rank)
    mesh.comm_log.reset()
    mean = quantized_mean(comm, values, mesh.replicas, kind)
    quantized_bytes = mesh.comm_log.snapshot()["replica"]
    mesh.comm_log.reset()
    comm.all_reduce(values.clone())
    return mean, quantized_bytes, mesh.comm_log.snapshot()["replica"]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_mean_is_identical_everywhere_and_within_its_rounding(kind):
    from meshtrain.training.diloco.quantized_reduce import BLOCK

    config = tiny_config("parallel.replicas=4", "parallel.sync_every=2", nproc=4)
    results = run_distributed(4, _mean_and_bytes, config.to_dict(), kind)
    mean, quantized_bytes, fp32_bytes = results[0]
    for other, _, _ in results[1:]:
        assert torch.equal(other, mean)  # every group dequantizes the same bytes
    inputs = torch.stack([_inputs(r) for r in range(4)])
    exact = inputs.mean(dim=0)
    padded = torch.zeros(4, -(-N // (4 * BLOCK)) * 4 * BLOCK)
    padded[:, :N] = inputs.abs()
    # each block's largest magnitude over the ranks: bounds both roundings' steps
    block_max = padded.amax(0).view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[:N]
    error = (mean - exact).abs()
    if kind == "int8":  # half a step of block_max / 127, twice
        bound = 2 * 0.5 * block_max / 127 + 1e-7
    else:  # 2^-4 relative of each input and of the mean; e4m3's subnormal step below 2^-6
        bound = (2 ** -4 * (inputs.abs().mean(0) + exact.abs())
                 + 2 * block_max / 448 * 2 ** -9 + 1e-7)
    assert (error <= bound).all(), (error - bound).max()
    assert error.max() > 0  # it is really quantized
    assert quantized_bytes / fp32_bytes == pytest.approx((1 + 4 / BLOCK) / 4, rel=0.05)


def _fingerprint_run(config_dict: dict, steps: int) -> tuple[list[float], float, list[int]]:
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    records = [trainer.train_step() for _ in range(steps)]
    weights = sum(float(s.master.double().sum()) for s in trainer.optimizer.shards)
    return ([r["loss"] for r in records], weights,
            [r["comm_bytes"]["replica"] for r in records])


def test_int8_training_stays_in_sync_and_near_fp32():
    steps = 6
    base = ("parallel.replicas=2", "parallel.sync_every=2", f"train.steps={steps}")
    fp32 = run_distributed(2, _fingerprint_run, tiny_config(*base, nproc=2).to_dict(), steps)
    int8 = run_distributed(2, _fingerprint_run, tiny_config(
        *base, "parallel.outer_grad_dtype=int8", nproc=2).to_dict(), steps)
    assert int8[0][1] == int8[1][1]  # both groups end with the same weights
    assert int8[0][0] == pytest.approx(fp32[0][0], abs=2e-2)
    assert int8[0][0] != fp32[0][0]  # the rounding shows after the first round
    # a round's bytes: about a quarter of fp32's (the per-step metric numbers aside)
    assert int8[0][2][1] < 0.3 * fp32[0][2][1]
