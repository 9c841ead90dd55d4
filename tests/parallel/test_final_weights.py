"""Final weights as streamed, sharded safetensors (:mod:`meshtrain.checkpoint.final_weights`).

Every saved tensor must be bit-identical to what the former whole-model gather produced (kept
here, test-only, as :func:`reference_gather`) at dp2 ZeRO-3 (fp32 and bf16), tp2 + SP, pp2,
interleaved pp2, ep2 with and without re-placed experts, dp2 × tp2 ZeRO-3 and dp2 × tp2 × pp2 ×
ep2; the readers (``generate``, ``convert --to-hf``, ``checkpoint.init_from``) must read the
sharded layout and the old single file; a failed writer must fail every rank and leave the
previous ``final/`` as it was; a save interrupted between its two renames must be read from the
set it left aside and recovered by the next save.

Memory is measured, not inferred: each rank of a dp2 × tp2 ZeRO-3 world resets its peak RSS
(``/proc/self/clear_refs``), saves a model of 64 MiB whose largest tensor is 4 MiB, and reports
``VmHWM`` minus its ``VmRSS`` before the save.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

from meshtrain.checkpoint.final_weights import file_names, plan_stage_files
from meshtrain.checkpoint.safetensors_io import INDEX_NAME, TensorReader
from meshtrain.config import ConfigError, config_from_dict
from meshtrain.parallel.gather import TensorSpec
from tests.distributed import DistributedTestError, run_distributed
from tests.helpers import tiny_config

STEPS = 2
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
SKEW = ("model.moe_balance=bias", "model.moe_bias_rate=0")  # + bias 1 on experts 0, 1 (below)
BIG = ("model.dim=512", "model.ffn_dim=2048", "model.n_layers=4")  # 64 MiB, largest 4 MiB


# ------------------------------------------------------------------ in the workers
def _gather_cat(tensor, comm, dim):
    if not comm.active:
        return tensor
    piece = tensor.contiguous()
    out = torch.empty((comm.size * piece.numel(),), dtype=piece.dtype, device=piece.device)
    comm.all_gather_into(out, piece.reshape(-1))
    return torch.cat(list(out.view(comm.size, *piece.shape).unbind(0)), dim=dim)


@torch.no_grad()
def reference_gather(model, engine, mesh) -> dict[str, torch.Tensor] | None:
    """The former ``gather_full_state_dict``: the whole model (fp32, CPU) on rank 0."""
    values = {}
    for b in engine.buckets:  # every parameter's full value (a collective under ZeRO-3)
        full = b.param_buffer
        if engine.stage == 3:
            full = b.new_buffer()
            engine.comms[b.axis].all_gather_into(full, b.param_shard)
        for s in b.slots:
            values[s.name] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    shardings = engine.shardings
    persistent = model.state_dict(keep_vars=True)
    for name, buffer in model.named_buffers():
        if name in persistent and name not in values:
            values[name] = buffer.detach().clone()
    names = sorted(values)
    if mesh.edp_rank == 0:
        for name in names:
            dim = shardings.get(name).ep_dim
            if dim is not None:
                values[name] = _gather_cat(values[name], mesh.comm("ep"), dim)
                placement = shardings[name].expert_placement
                if placement is not None and not placement.identity:
                    slot_of = torch.argsort(torch.tensor(placement.slots))
                    values[name] = values[name].index_select(dim, slot_of)
    if mesh.dp_rank != 0:
        return None
    for name in names:
        dim = shardings.get(name).tp_dim
        if dim is not None:
            values[name] = _gather_cat(values[name], mesh.comm("tp"), dim)
    if mesh.tp_rank != 0:
        return None
    state = {name: value.detach().float().cpu() for name, value in values.items()}
    if mesh.comm("pp").active:
        merged = {}
        import torch.distributed as dist

        gathered = [None] * mesh.comm("pp").size
        dist.all_gather_object(gathered, state, group=mesh.comm("pp").group)  # test-only
        for stage_state in gathered:
            merged.update(stage_state)
        state = merged
    return state if mesh.is_logging_rank else None


def _trainer(config_dict: dict, skew: bool = False):
    from meshtrain.model import moe_layers
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    if skew:  # every token picks experts 0 and 1 (ep rank 0's): the first rebalance moves them
        for layer in moe_layers(trainer.model):
            layer.expert_bias[[0, 1]] = 1.0
    return trainer


def save_cases(cases: list[tuple[dict, str]]) -> list[dict]:
    """Each case: ``(config, kind)``; ``train`` trains STEPS steps and saves the final weights,
    ``skew`` also skews the router, ``init`` only restores (checkpoint.init_from). Returns the
    reference gather (rank 0) and the expert placements of each case."""
    out = []
    for config_dict, kind in cases:
        trainer = _trainer(config_dict, skew=kind == "skew")
        if kind == "init":
            trainer.restore()
        else:
            for _ in range(STEPS):
                trainer.train_step()
        reference = reference_gather(trainer.model, trainer.engine, trainer.mesh)
        if kind != "init":
            trainer.save_final()
        placer = trainer.expert_placer
        out.append({"reference": reference,
                    "placements": placer.placements if placer is not None else None})
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_extra_bytes(fn) -> tuple[int, object]:
    """Run ``fn``; return the growth of this process's peak RSS over its RSS before, and the
    result."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    result = fn()
    return (_status_kib("VmHWM") - before) * 1024, result


def measure_save(config_dict: dict) -> dict:
    """Save (no training: the weights as initialised) and report this rank's peak extra RSS,
    then the same for the former whole-model gather (the yardstick)."""
    import meshtrain.checkpoint.final_weights  # noqa: F401 - imports are not the save's memory

    trainer = _trainer(config_dict)
    save, _ = _peak_extra_bytes(trainer.save_final)
    gather, reference = _peak_extra_bytes(
        lambda: reference_gather(trainer.model, trainer.engine, trainer.mesh))
    return {"save": save, "gather": gather, "reference": reference, "rank": trainer.mesh.rank}


def fail_after_first_file(config_dict: dict) -> None:
    """Train, with rank 1's writer raising once it has completed one file (one tensor a file)."""
    from meshtrain.checkpoint import final_weights

    class FlakyWriter(final_weights.ShardedWriter):
        closed = 0

        def close(self):
            if FlakyWriter.closed >= 1:
                raise OSError("No space left on device (test)")
            FlakyWriter.closed += 1
            return super().close()

    final_weights.MAX_FILE_BYTES = 1  # every tensor in a file of its own
    import torch.distributed as dist

    if dist.get_rank() == 1:
        final_weights.ShardedWriter = FlakyWriter
    _trainer(config_dict).fit()


# ------------------------------------------------------------------ helpers
def _read(directory) -> dict[str, torch.Tensor]:
    with TensorReader(directory) as reader:
        return {name: reader.get(name) for name in reader.keys()}


def _assert_identical(saved: dict, expected: dict, what: str) -> None:
    assert saved.keys() == expected.keys(), what
    for name, value in expected.items():
        assert saved[name].dtype == torch.float32, (what, name)
        assert torch.equal(saved[name], value), (what, name)


def _assert_layout(final, files: int) -> dict:
    """The index is complete and consistent with the files; returns it."""
    index = json.loads((final / INDEX_NAME).read_text())
    names = sorted(p.name for p in final.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)]
    assert sorted(set(index["weight_map"].values())) == names
    from safetensors import safe_open

    total = 0
    for name in names:
        with safe_open(str(final / name), "pt") as handle:
            keys = set(handle.keys())
            assert keys == {k for k, f in index["weight_map"].items() if f == name}
            total += sum(4 * math.prod(handle.get_slice(k).get_shape()) for k in keys)
    assert index["metadata"]["total_size"] == total
    assert not list(final.glob("*.tmp"))
    return index


# ------------------------------------------------------------------ the layouts
WORLD2 = {  # name: (overrides, kind, files expected)
    "zero3": (("parallel.zero=3",), "train", 1),
    "zero3_bf16": (("parallel.zero=3", "train.precision=bf16"), "train", 1),
    "tp2": (("parallel.tp=2", "parallel.sequence_parallel=true"), "train", 2),
    "pp2": (("parallel.pp=2", "parallel.microbatches=2"), "train", 2),
    "pp2_interleaved": (("parallel.pp=2", "parallel.microbatches=2", "model.n_layers=4",
                         "parallel.pp_schedule=interleaved-1f1b", "parallel.virtual_stages=2"),
                        "train", 2),
    "ep2": (("parallel.ep=2", "parallel.zero=1", *MOE), "train", 1),
    "ep2_replaced": (("parallel.ep=2", "parallel.zero=1", "parallel.ep_rebalance_every=1",
                      *MOE, *SKEW), "skew", 1),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every 2-process layout saved in one spawned world, then two layouts started from saved
    sharded weights (tp2 from pp2's, ep2 from the re-placed ep2's)."""
    root = tmp_path_factory.mktemp("final")
    cases, configs = [], {}
    for name, (overrides, kind, _) in WORLD2.items():
        configs[name] = tiny_config(*overrides, run_dir=str(root / name), nproc=2)
        cases.append((configs[name].to_dict(), kind))
    # A stale final/ of another layout (more files) must vanish, not mix with the new files.
    stale = root / "pp2" / "final"
    stale.mkdir(parents=True)
    for i in range(1, 4):
        (stale / f"model-{i:05d}-of-00003.safetensors").write_bytes(b"stale")
    (stale / "model.safetensors").write_bytes(b"stale")
    (root / "ep2_replaced" / "final").mkdir(parents=True)  # (init_from must exist to validate)
    inits = {"tp2_from_pp2": ("parallel.tp=2", f"checkpoint.init_from={root / 'pp2'}"),
             "ep2_from_replaced": ("parallel.ep=2", *MOE, *SKEW,
                                   f"checkpoint.init_from={root / 'ep2_replaced' / 'final'}")}
    for name, overrides in inits.items():
        cases.append((tiny_config(*overrides, run_dir=str(root / name), nproc=2).to_dict(),
                      "init"))
    results = run_distributed(2, save_cases, cases, timeout=900)[0]
    names = [*WORLD2, *inits]
    return root, dict(zip(names, results, strict=True)), configs


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_process_layouts_save_the_same_tensors_as_the_full_gather(world2, name):
    root, results, _ = world2
    final = root / name / "final"
    _assert_layout(final, WORLD2[name][2])
    _assert_identical(_read(final), results[name]["reference"], name)
    assert (final / "config.json").is_file()
    with TensorReader(final) as reader:
        assert reader.metadata()["step"] == str(STEPS)
    if name == "ep2_replaced":  # the placement really moved experts, and files are canonical
        assert any(p != [0, 1, 2, 3] for p in results[name]["placements"].values())


def test_init_from_sharded_weights_starts_bit_identical_at_another_layout(world2):
    root, results, _ = world2
    for name, source in (("tp2_from_pp2", "pp2"), ("ep2_from_replaced", "ep2_replaced")):
        _assert_identical(_read(root / source / "final"), results[name]["reference"], name)


def test_generate_and_convert_read_sharded_and_single_file_dirs(world2, tmp_path):
    from meshtrain.checkpoint import convert_to_hf, load_hf
    from meshtrain.commands.generate import generate, load_for_generation

    root, _, configs = world2
    saved = _read(root / "pp2" / "final")
    single = tmp_path / "single"  # the layout of earlier runs: one model.safetensors
    single.mkdir()
    from safetensors.torch import save_file

    save_file(saved, str(single / "model.safetensors"), metadata={"step": str(STEPS)})
    shutil.copy(root / "pp2" / "final" / "config.json", single / "config.json")
    for source in (root / "pp2", single):
        model, tokenizer, _ = load_for_generation(source)
        _assert_identical(model.state_dict(), saved, str(source))
        assert isinstance(generate(model, tokenizer, "ab", max_new_tokens=3), str)
        hf_dir = convert_to_hf(source, tmp_path / f"hf_{source.name}")
        _assert_identical(load_hf(hf_dir).state_dict(), saved, f"hf {source}")
        # checkpoint.init_from, on one process, starts from exactly these weights.
        config = tiny_config(f"checkpoint.init_from={source}",
                             run_dir=str(tmp_path / f"one_{source.name}"), nproc=1)
        assert config.model == configs["pp2"].model
        _assert_identical(save_cases([(config.to_dict(), "init")])[0]["reference"], saved,
                          f"init_from {source}")


def test_cli_generate_and_convert_on_a_sharded_run_dir(world2, tmp_path):
    root, _, _ = world2
    run = [sys.executable, "-m", "meshtrain"]
    gen = subprocess.run([*run, "generate", "--checkpoint", str(root / "tp2"), "--prompt", "ab",
                          "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    conv = subprocess.run([*run, "convert", "--to-hf", str(root / "tp2"), "--out",
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def test_4d_dp2_tp2_pp2_ep2_saves_the_same_tensors(tmp_path):
    config = tiny_config("parallel.ep=2", "parallel.tp=2", "parallel.pp=2",
                         "parallel.microbatches=2", "parallel.zero=1",
                         "parallel.sequence_parallel=true", *MOE,
                         run_dir=str(tmp_path / "4d"), nproc=8)
    result = run_distributed(8, save_cases, [(config.to_dict(), "train")], timeout=900)[0][0]
    _assert_layout(tmp_path / "4d" / "final", 4)  # pp2 stages × tp2 writers
    _assert_identical(_read(tmp_path / "4d" / "final"), result["reference"], "4d")


@pytest.mark.slow  # a measurement: `make bench`
def test_writer_peak_memory_is_about_one_tensor(tmp_path, monkeypatch):
    # Every allocation above 64 KiB gets its own mapping, returned on free: RSS follows the
    # live tensors instead of glibc's heap reuse (inherited by the spawned workers).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    config = tiny_config(*BIG, "parallel.zero=3", "parallel.tp=2", run_dir=str(tmp_path),
                         nproc=4)
    results = run_distributed(4, measure_save, config.to_dict(), timeout=900)
    _assert_identical(_read(tmp_path / "final"), results[0]["reference"], "dp2 tp2 zero3")
    largest = 4 * 512 * 2048  # w1 / w2 / w3: 4 MiB
    model = 4 * sum(v.numel() for v in results[0]["reference"].values())
    assert model > 10 * largest

    def mib(key):
        return {r["rank"]: round(r[key] / 2**20, 1) for r in results}

    print(f"peak extra RSS per rank (MiB): streaming save {mib('save')}, former whole-model "
          f"gather {mib('gather')}; largest tensor {largest / 2**20:.0f} MiB, model "
          f"{model / 2**20:.0f} MiB")
    assert results[0]["gather"] > 0.8 * model  # the measurement sees a whole-model gather
    assert max(r["save"] for r in results) <= 3 * largest


def test_a_failed_writer_keeps_the_previous_final_weights_and_fails_the_run(tmp_path):
    config = tiny_config("parallel.pp=2", "parallel.microbatches=2", "train.steps=1",
                         run_dir=str(tmp_path), nproc=2)
    final = tmp_path / "final"
    final.mkdir()  # an earlier save: it must survive whole, with nothing of the new one in it
    previous = {name: f"previous {name}" for name in ("model.safetensors", INDEX_NAME,
                                                      "config.json")}
    for name, text in previous.items():
        (final / name).write_text(text)
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(2, fail_after_first_file, config.to_dict(), timeout=300)
    message = str(failure.value)
    assert "FinalWeightsError" in message and "No space left on device" in message
    assert re.search(r"rank 1 \(pp 1, tp 0\) could not write model-\d{5}-of-\d{5}", message)
    assert "keeps the previous final weights" in message
    assert {p.name: p.read_text() for p in final.iterdir()} == previous
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("final")] == ["final"]
    # What the interrupted save had written (shards, no index) is refused by every reader.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="without model.safetensors.index.json"):
        TensorReader(partial)


def test_one_process_save_recovers_a_set_left_aside_then_replaces_it(tmp_path, monkeypatch):
    """A save interrupted between its two renames (filesystem without the atomic exchange) left
    no final/ and the previous set as final.old-*: readers get that set; the next save renames
    it back first, then swaps its own set in (here by the two renames too)."""
    from meshtrain.checkpoint import atomic, iter_weights
    from meshtrain.checkpoint.final_weights import save_final_weights
    from meshtrain.checkpoint.safetensors_io import current_weights_dir

    config = tiny_config(run_dir=str(tmp_path), nproc=1)
    trainer = _trainer(config.to_dict())
    final = tmp_path / "final"
    save_final_weights(trainer.model, trainer.engine, trainer.mesh, final,
                       json.dumps(config.to_dict()), 0)
    first = _read(final)
    token = atomic.token()
    (tmp_path / f"final.tmp-{token}").mkdir()  # the new set (complete or not: never read)
    aside = tmp_path / f"final.old-{token}"
    final.rename(aside)  # the first rename; the crash comes before the second
    assert current_weights_dir(final) == aside
    _assert_identical(dict(iter_weights(tmp_path)), first, "read from the aside")

    trainer.train_step()
    expected = reference_gather(trainer.model, trainer.engine, trainer.mesh)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = save_final_weights(trainer.model, trainer.engine, trainer.mesh, final,
                             json.dumps(config.to_dict()), 1)
    assert out == final
    _assert_layout(final, 1)
    _assert_identical(_read(final), expected, "after recovery")
    assert not torch.equal(first["output.weight"], expected["output.weight"])  # a new set
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("final")] == ["final"]


def test_file_plan_spreads_tp_split_tensors_and_numbers_files_deterministically():
    specs = [TensorSpec("a", (4, 4), True), TensorSpec("b", (4,), False),
             TensorSpec("c", (4, 4), True), TensorSpec("d", (8, 4), True)]
    files = plan_stage_files(specs, tp=2, max_file_bytes=96)
    # a -> tp 0 (64 B), b (not split) -> tp 0 (80 B), c -> tp 1 (64 B), d -> tp 1 (less loaded),
    # in a second file of tp 1 (64 + 128 B > 96 B).
    assert files == [(0, [("a", (4, 4)), ("b", (4,))]), (1, [("c", (4, 4))]),
                     (1, [("d", (8, 4))])]
    assert plan_stage_files(specs, tp=1, max_file_bytes=2**30) == [
        (0, [("a", (4, 4)), ("b", (4,)), ("c", (4, 4)), ("d", (8, 4))])]
    assert file_names([files, files[:1]]) == [
        ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
         "model-00003-of-00004.safetensors"], ["model-00004-of-00004.safetensors"]]


def test_one_process_save_with_small_files_round_trips(tmp_path):
    from meshtrain.checkpoint.final_weights import save_final_weights

    trainer = _trainer(tiny_config(run_dir=str(tmp_path), nproc=1).to_dict())
    expected = reference_gather(trainer.model, trainer.engine, trainer.mesh)
    out = save_final_weights(trainer.model, trainer.engine, trainer.mesh, tmp_path / "final",
                             "{}", 0, max_file_bytes=20_000)
    files = len(list(out.glob("*.safetensors")))
    assert files > 3
    _assert_layout(out, files)
    _assert_identical(_read(out), expected, "small files")
