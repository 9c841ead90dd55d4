"""Tensor and sequence parallelism on several CPU processes against one process (fp32).

Tolerances: whole-run parity uses meshtrain.commands.verify's (2e-4 absolute on the loss, 1e-3
relative on the gradient norm). Layer-by-layer checks compare one forward/backward at 1e-5: the only
difference from one process is the summation order of split matmuls (fp32 rounding, ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import assert_layouts_match_one_process, tiny_config

STEPS = 3

LAYER_TOL = 1e-5


def _parity(world: int, cases) -> list[list[dict]]:
    return assert_layouts_match_one_process(world, cases, STEPS)


def test_tp2_with_and_without_sequence_parallel():
    cases = [tiny_config("parallel.tp=2", "model.n_layers=4", nproc=2),
             tiny_config("parallel.tp=2", "parallel.sequence_parallel=true", "model.n_layers=4",
                         nproc=2),
             tiny_config("parallel.tp=2", "model.tie_embeddings=true", "model.mlp=gelu",
                         nproc=2)]
    results = _parity(2, cases)
    # Megatron's count (Narayanan et al. 2021 3.2): 8·b·s·h·(t−1)/t elements per layer per
    # micro-batch; plus the embedding's forward all-reduce and the head input's backward
    # all-reduce (2·b·s·h·(t−1)/t each) and the loss's max + (sum-exp, target) all-reduces.
    config = cases[0]
    t, layers, h = 2, config.model.n_layers, config.model.dim
    bs = config.train.global_batch * config.train.seq_len  # dp = 1: this rank's tokens
    megatron = 8 * bs * h * (t - 1) / t * layers * 4  # fp32 bytes
    for records in results[:2]:
        measured = records[0]["comm_bytes"]["tp"]
        assert 1.0 <= measured / megatron <= 1.3, measured / megatron
    extra = (4 * bs * h + 2 * 3 * bs) * (t - 1) / t * 4
    assert results[0][0]["comm_bytes"]["tp"] == pytest.approx(megatron + extra, rel=0.01)


def test_tp4_replicated_kv_heads():
    # n_kv_heads = 2 < tp = 4: key/value projections replicated, each rank uses its kv head
    _parity(4, [tiny_config("parallel.tp=4", "model.n_kv_heads=2", nproc=4),
                tiny_config("parallel.tp=4", "model.n_kv_heads=4",
                            "parallel.sequence_parallel=true", nproc=4)])


def test_dp2_tp2_with_zero1_and_zero3():
    _parity(4, [tiny_config("parallel.tp=2", "parallel.zero=1", nproc=4),
                tiny_config("parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true",
                            nproc=4)])


def layer_by_layer(sequence_parallel: bool) -> dict[str, float]:
    """Largest difference of each block's output and each parameter's gradient vs one process."""
    from meshtrain.model import Transformer, build_model
    from meshtrain.parallel import ParallelPlan, parallelize
    from meshtrain.parallel.tensor.apply import tp_vocab_start
    from meshtrain.parallel.tensor.loss import vocab_parallel_cross_entropy
    from meshtrain.run.worker import build_mesh

    config = tiny_config("parallel.tp=2", f"parallel.sequence_parallel={sequence_parallel}",
                         nproc=2)
    config.model.vocab_size = 264
    mesh = build_mesh(config)
    reference = build_model(config.model, seed=config.train.seed)
    with torch.device("meta"):
        model = Transformer(config.model)
    model = parallelize(model, mesh, ParallelPlan.from_config(config))
    torch.manual_seed(0)
    tokens = torch.randint(0, 264, (2, 16))
    targets = torch.randint(0, 264, (2, 16))
    diffs = {}
    outputs = {}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda m, a, out, n=name: outputs.__setitem__(n, out))
    ref_outputs = {}
    for name, block in reference.layers.items():
        block.register_forward_hook(lambda m, a, out, n=name: ref_outputs.__setitem__(n, out))
    logits = model(tokens)
    ref_logits = reference(tokens)
    rank, t = mesh.tp_rank, 2
    for name, out in outputs.items():
        ref = ref_outputs[name]
        if sequence_parallel:
            chunk = ref.shape[1] // t
            ref = ref[:, rank * chunk:(rank + 1) * chunk]
        diffs[f"block {name} output"] = float((out - ref).abs().max())
    vocab = logits.shape[-1]
    diffs["logits"] = float((logits - ref_logits[..., rank * vocab:(rank + 1) * vocab]).abs().max())
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                        tp_vocab_start(model), mesh.comm("tp")).mean()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    diffs["loss"] = abs(float(loss - ref_loss))
    loss.backward()
    ref_loss.backward()
    from meshtrain.parallel import data_parallel_engine

    engine = data_parallel_engine(model)
    engine.end_microbatch()
    from meshtrain.training.optimizer import FlatAdamW

    engine.reduce_partial_grads(FlatAdamW(engine, config.train).shards)
    from meshtrain.parallel.state import shardings_of

    ref_params = dict(reference.named_parameters())
    shardings = shardings_of(model)
    for name, param in model.named_parameters():
        ref_grad = shardings[name].local_piece(ref_params[name].grad)
        diffs[f"grad {name}"] = float((param.grad - ref_grad).abs().max())
    return diffs


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_layer_forward_and_backward(sequence_parallel):
    for diffs in run_distributed(2, layer_by_layer, sequence_parallel):
        bad = {k: v for k, v in diffs.items() if v > LAYER_TOL}
        assert not bad, bad
        assert len([k for k in diffs if k.startswith("grad")]) > 10


def rng_streams() -> tuple[int, int, float]:
    from meshtrain.run.worker import build_mesh

    mesh = build_mesh(tiny_config("parallel.tp=2", nproc=4))
    sample = torch.rand(4, generator=mesh.generator("dropout", vary_along=("dp", "pp")))
    return mesh.dp_rank, mesh.tp_rank, float(sample.sum())


def test_rng_same_across_tp_different_across_dp():
    results = run_distributed(4, rng_streams)
    by_dp = {}
    for dp_rank, _, value in results:
        by_dp.setdefault(dp_rank, set()).add(value)
    assert all(len(values) == 1 for values in by_dp.values())  # tp ranks agree
    assert len({next(iter(v)) for v in by_dp.values()}) == 2  # dp ranks differ
