"""FP8 linear layers in the cost model (``--trait fp8_linear=true``): refused without FP8 tensor
cores, faster only where the linear layers are, memory as Transformer Engine holds it, not held
to the bf16 MFU cap, and the published FP8 rows priced with it."""

import contextlib
import io
import json
import shlex

import pytest

from meshtrain.cli import main
from meshtrain.planner.tables.published import published_rows
from meshtrain.planner.tables.row_commands import row_command
from meshtrain.planner.tables.stacks import MEGATRON_CORE_2024_H100

FP8 = ["--trait", "fp8_linear=true"]


def _estimate(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _pair(argv: list[str]) -> tuple[dict, dict]:
    return _estimate(argv), _estimate([*argv, *FP8])


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(capsys):
    argv = ["estimate", "--model", "llama3.1-8b", "--hardware", "a100-80g", "--gpus", "8", *FP8]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a100-80g" in err and "fp8_linear" in err and "H100" in err


def test_fp8_speeds_up_the_linear_layers_and_nothing_else():
    layout = ["--set", "parallel.tp=4", "--set", "parallel.sequence_parallel=true",
              "--set", "parallel.dp=2", "--set", "parallel.zero=1"]
    base = ["--model", "llama3.1-70b", "--hardware", "h100-80g", "--gpus", "8",
            "--stack", "megatron-core-2024", "--set", "train.seq_len=4096", *layout]
    bf16, fp8 = _pair(base)
    assert fp8["fp8_linear"] and not bf16["fp8_linear"]
    # The FP8 peak is twice the bf16 one, and attention, the head and the collectives stay bf16:
    # the step gets faster, by less than 2 x.
    assert bf16["step_time_s"] / 2 < fp8["step_time_s"] < bf16["step_time_s"]
    # Tensor-parallel collectives carry bf16 activations either way.
    assert fp8["overlap"]["tp"]["total_s"] == pytest.approx(bf16["overlap"]["tp"]["total_s"])
    # A longer sequence puts more of the step in attention, which FP8 does not speed up.
    long_bf16, long_fp8 = _pair([*base, "--set", "train.seq_len=32768",
                                 "--set", "train.global_batch=64"])
    assert (long_bf16["step_time_s"] / long_fp8["step_time_s"]
            < bf16["step_time_s"] / fp8["step_time_s"])


def test_fp8_reports_its_efficiency_and_says_so_in_text(capsys):
    argv = ["--model", "llama3.1-8b", "--hardware", "h100-80g", "--gpus", "8",
            "--stack", "megatron-core-2024", *FP8]
    result = _estimate(argv)
    assert result["kernel_efficiency"]["fp8_gemm"] == MEGATRON_CORE_2024_H100.fp8_gemm
    assert main(["estimate", *argv]) == 0
    text = capsys.readouterr().out
    assert "linear layers in FP8 at 57% of the FP8 peak" in text
    assert "stack megatron-core-2024 with fp8_linear=true" in text


def test_fp8_is_not_held_to_the_bf16_mfu_cap():
    base = ["--model", "llama3.1-405b", "--hardware", "h100-80g", "--gpus", "512",
            "--stack", "megatron-core-2024"]
    bf16, fp8 = _pair(base)
    assert bf16["breakdown"]["mfu_cap_s"] > 0  # this layout is priced at the H100 cap
    assert fp8["breakdown"]["mfu_cap_s"] == 0 and fp8["mfu"] > bf16["mfu"]


@pytest.mark.parametrize("zero, stack", [(1, "megatron-core-2024"), (3, "torchtitan-2025")])
def test_fp8_memory_keeps_one_fp8_weight_copy_and_fp8_layer_inputs(zero, stack):
    model = {"dim": 1024, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 4096,
             "vocab_size": 32000}
    sets = [f"model.{k}={v}" for k, v in model.items()]
    sets += [f"parallel.dp={8 // 2}", "parallel.tp=2", "parallel.sequence_parallel=true",
             f"parallel.zero={zero}", "train.seq_len=4096", "train.global_batch=8",
             "train.precision=bf16"]
    base = ["--hardware", "h100-80g", "--gpus", "8", "--stack", stack]
    for item in sets:
        base += ["--set", item]
    bf16, fp8 = _pair(base)
    (plain,), (cast,) = bf16["per_rank"], fp8["per_rank"]
    # The block weights on a rank: q, k, v, o and the three SwiGLU matrices, split over tp 2.
    dim, kv = model["dim"], model["dim"] // model["n_heads"] * model["n_kv_heads"]
    block = (dim * (2 * dim + 2 * kv) + 3 * dim * model["ffn_dim"]) / 2 * model["n_layers"]
    extra = cast["buffer_bytes"] - plain["buffer_bytes"]
    if zero < 3:  # one byte a parameter, kept for the step
        assert extra == pytest.approx(block, rel=1e-3)
    else:  # cast after each gather and freed with it
        assert extra == 0
    assert cast["activation_bytes"] < plain["activation_bytes"]
    assert (cast["param_bytes"], cast["optim_bytes"]) == (plain["param_bytes"],
                                                          plain["optim_bytes"])


def test_the_published_fp8_rows_are_priced_with_the_trait():
    rows = [r for r in published_rows() if "FP8" in r.name or "Float8" in r.name]
    assert len(rows) == 34  # dgxc 6, torchtitan Tables 1, 3 and 4: 8, Bridge 8, NeMo 12
    for row in rows:
        assert row.workload.traits.fp8_linear, row.name
        words = shlex.split(row_command(row))
        assert "fp8_linear=true" in words[words.index("--stack"):], row.name
    bridge = [r for r in rows if r.source == "Megatron-Bridge performance summary"]
    assert len(bridge) == 8 and all(r.workload.traits.fp8_params for r in bridge)
    assert all(r.workload.traits.grad_reduce_bytes == 2 for r in bridge)
    train = [r for r in rows if r.split == "train" and r.fits.endswith(" fp8")]
    assert {r.name for r in train} == {"Llama 3.1 8B FP8 8 H100", "Llama 3.1 8B FP8 128 H100"}
    assert all(r.fits == "megatron-core-2024 h100 fp8" for r in train)


def test_fp8_params_hold_the_block_weights_in_one_byte_and_need_fp8_linear(capsys):
    """``--trait fp8_params=true`` (Megatron's ``fp8_param_gather``): the block weights take one
    byte a parameter instead of two, with no FP8 copy beside them; alone it is refused."""
    model = {"dim": 1024, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 4096,
             "vocab_size": 32000}
    base = ["--hardware", "h100-80g", "--gpus", "8", "--stack", "megatron-core-2025"]
    for item in [f"model.{k}={v}" for k, v in model.items()] + [
            "parallel.dp=4", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.zero=1", "train.seq_len=4096", "train.global_batch=8",
            "train.precision=bf16"]:
        base += ["--set", item]
    (copy,), = [_estimate([*base, *FP8])["per_rank"]]
    only = _estimate([*base, *FP8, "--trait", "fp8_params=true"])
    (held,) = only["per_rank"]
    assert only["fp8_params"]
    dim, kv = model["dim"], model["dim"] // model["n_heads"] * model["n_kv_heads"]
    block = (dim * (2 * dim + 2 * kv) + 3 * dim * model["ffn_dim"]) / 2 * model["n_layers"]
    assert copy["param_bytes"] - held["param_bytes"] == pytest.approx(block, rel=1e-3)
    assert copy["buffer_bytes"] - held["buffer_bytes"] == pytest.approx(block, rel=1e-3)
    assert (held["grad_bytes"], held["optim_bytes"]) == (copy["grad_bytes"],
                                                         copy["optim_bytes"])
    assert main(["estimate", *base, "--trait", "fp8_params=true"]) == 2
    err = capsys.readouterr().err
    assert "fp8_params" in err and "fp8_linear=true" in err


def test_fp8_keeps_the_experts_input_rows_in_one_byte():
    """An MoE layer under FP8 keeps its experts' input rows (top-k copies of each token) in FP8,
    as the dense layers keep theirs: one byte an element less per row."""
    from meshtrain.config import ModelConfig
    from meshtrain.config.layout import Layout
    from meshtrain.planner.cost.memory import layer_activation_units

    model = ModelConfig(vocab_size=1000, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8,
                        ffn_dim=4096, moe_experts=16, moe_top_k=4, moe_ffn_dim=512)
    dense = ModelConfig(vocab_size=1000, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8,
                        ffn_dim=4096)
    layout = Layout(dp=2, ep=2)

    def saved(m, fp8):
        return layer_activation_units(m, 0, 2048, layout, True, "none", fused_swiglu=True,
                                      fp8_linear=fp8)

    # The dense parts change alike in both models; the MoE layer saves k more units less
    # (its k input rows at one byte, not two) beyond what its expert intermediates lose.
    moe_drop, dense_drop = saved(model, False) - saved(model, True), \
        saved(dense, False) - saved(dense, True)
    per_hidden_drop = 1.0  # the down projection's input, per expert width
    expected = (dense_drop - per_hidden_drop * dense.ffn_dim / dense.dim
                + 4 * per_hidden_drop * 512 / 1024 + 4)
    assert moe_drop == pytest.approx(expected)
