"""``meshtrain estimate``, ``plan`` and ``calibrate`` as a user runs them.

Every command goes through ``cli.main`` in this process, which is the same code path without
paying for a fresh interpreter each time (``calibrate``'s workers come from the suite's pool).
"""

from __future__ import annotations

import json

import pytest

SMALL = ["--set", "model.dim=2048", "--set", "model.n_layers=8", "--set", "model.n_heads=16",
         "--set", "model.ffn_dim=5632", "--set", "model.vocab_size=32000",
         "--set", "train.seq_len=2048", "--set", "train.global_batch=64",
         "--set", "train.precision=bf16"]


def test_estimate_json_has_the_contract_keys(meshtrain):
    run = meshtrain("estimate", "--hardware", "a100-80g", "--gpus", "8", "--json", *SMALL,
                    "--set", "parallel.tp=2", "--set", "parallel.pp=2",
                    "--set", "parallel.microbatches=4")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for key in ("params", "per_rank", "step_time_s", "tokens_per_s", "model_tflops_per_gpu",
                "hardware_tflops_per_gpu", "mfu", "bubble_fraction", "breakdown"):
        assert key in out
    assert len(out["per_rank"]) == 2
    for rank in out["per_rank"]:
        assert set(rank) >= {"param_bytes", "grad_bytes", "optim_bytes", "activation_bytes",
                             "total_bytes"}
    assert {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_exposed_s", "bubble_s"} <= set(
        out["breakdown"])
    assert out["layout"]["dp"] == 2 and 0 < out["mfu"] < 1


README_REFUSED = ["--model", "llama3-70b", "--set", "parallel.tp=8", "--hardware", "h100-80g",
                  "--gpus", "64"]
"""The README's refusal: one micro-batch of 64 x 8,192 tokens per GPU, 4,733.3 GB."""


def test_estimate_that_does_not_fit_says_why(meshtrain):
    run = meshtrain("estimate", *README_REFUSED, "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    why = out["why_not_fits"]
    assert not out["fits"] and why["largest"] == "activations"
    assert why["activations"] == pytest.approx(4215.8, abs=0.1)
    assert why["estimate_gb"] == pytest.approx(4733.3, abs=0.1) and why["capacity_gb"] == 82.5
    assert set(why) >= {"activations", "parameters", "gradients", "optimizer", "buffers",
                        "reserve", "largest", "capacity_gb", "estimate_gb", "suggestions"}
    parts = ("activations", "parameters", "gradients", "optimizer", "buffers", "reserve")
    assert sum(why[k] for k in parts) == pytest.approx(why["estimate_gb"], abs=0.5)
    assert why["reserve"] > 0  # the caching allocator's reserve on a GPU
    changed = {text.split("=")[0] for s in why["suggestions"] for text in s["set"]}
    assert {"parallel.microbatches", "parallel.activation_checkpointing"} <= changed
    assert any(s["fits"] for s in why["suggestions"])
    for key in ("step_time_s", "mfu", "tokens_per_s", "fits"):  # the existing keys stay
        assert key in out
    text = meshtrain("estimate", *README_REFUSED)
    assert "DOES NOT FIT" in text.stdout
    assert "why: activations are the largest part, 4,215.8 of 4,733.3 GB" in text.stdout
    assert "by component (GB): activations 4,215.8, parameters" in text.stdout
    assert "fragmentation reserve" in text.stdout
    assert "--set parallel.microbatches=64: peak" in text.stdout
    assert "(does not fit: not runnable)" in text.stdout


def test_estimate_that_fits_has_no_why(meshtrain):
    fitting = [*README_REFUSED, "--set", "parallel.zero=2", "--set", "parallel.microbatches=64",
               "--set", "parallel.activation_checkpointing=full"]
    out = json.loads(meshtrain("estimate", *fitting, "--json").stdout)
    assert out["fits"] and out["why_not_fits"] is None
    text = meshtrain("estimate", *fitting).stdout
    assert "fits" in text and "why:" not in text and "not runnable" not in text


def test_plan_json_and_table(meshtrain):
    run = meshtrain("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-80g",
                    "--json", "--top", "3")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert 1 <= len(out["candidates"]) <= 3
    for key in ("dp", "tp", "pp", "ep", "zero", "schedule", "microbatches", "memory_gb_per_gpu",
                "step_time_s", "tokens_per_s", "mfu", "kwh_per_1b_tokens", "why"):
        assert key in out["candidates"][0]
    table = meshtrain("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-80g",
                      "--top", "2")
    assert table.returncode == 0 and "bound" in table.stdout


def test_bad_hardware_and_model_exit_2(meshtrain):
    for args in (["--model", "llama3-8b", "--hardware", "z80"],
                 ["--model", "nope-1b", "--hardware", "h100-80g"]):
        run = meshtrain("plan", "--gpus", "8", *args)
        assert run.returncode == 2 and "Traceback" not in run.stderr


def test_calibrate_writes_a_usable_profile(tmp_path, meshtrain):
    out = tmp_path / "profile.json"
    # In this process: its 2 workers come from the suite's pool (tests/distributed.py).
    run = meshtrain("calibrate", "--out", str(out), "--nproc", "2", "--sizes", "4096,65536",
                    "--matmul-sizes", "64,128", "--repeats", "1")
    assert run.returncode == 0, run.stderr
    profile = json.loads(out.read_text())
    for key in ("peak_tflops", "memory_gb", "intra_node_gbps", "intra_node_latency_us",
                "measured"):
        assert key in profile
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        assert len(profile["measured"][op]) == 2
    assert profile["peak_tflops"] > 0 and profile["intra_node_gbps"] > 0
    # where it wrote, on stderr, and how to use a file that is not the default one
    assert f"calibrate wrote {out} (use it with --hardware {out}" in run.stderr
    assert "calibrate: timing this machine with 2 processes in 8 steps" in run.stderr
    est = meshtrain("estimate", "--hardware", str(out), "--gpus", "2", "--json", *SMALL)
    assert est.returncode == 0, est.stderr
    assert json.loads(est.stdout)["hardware"] == "measured"


def test_simulate_energy_schedule_json(meshtrain, tmp_path):
    run = meshtrain("simulate", "--schedule", "1f1b", "--pp", "8", "--microbatches", "16",
                    "--slow-stage", "3:1.2", "--energy-schedule", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    # one stage 20 % slower: 76.2 units in the paper's 1F1B (whole backwards); the early
    # gradient sends of ranks 1-7 take weight-gradient passes off the cool-down chain
    from meshtrain.parallel.pipeline import StageTimes, build_schedule, simulate

    times = [StageTimes()] * 8
    times[3] = StageTimes(1.2, 1.2, 1.2)
    paper = simulate(build_schedule("1f1b", 8, 16, early_grad_sends=False), times).makespan
    assert paper == pytest.approx(76.2)
    assert out["makespan"] == pytest.approx(simulate(build_schedule("1f1b", 8, 16),
                                                     times).makespan)
    assert out["makespan"] < paper - 5
    energy = out["energy_schedule"]
    assert energy["slowdown"] <= 0.01 + 1e-9 and 0.05 < energy["saving"] < 0.3
    assert len(energy["ranks"]) == 8
    bad = meshtrain("simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2",
                    "--slow-stage", "5:1.2")
    assert bad.returncode == 2


def test_plan_objective_and_budget(meshtrain):
    run = meshtrain("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-80g",
                    "--json", "--top", "3", "--objective", "energy")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["candidates"]
    assert [r["kwh_per_1b_tokens"] for r in rows] == sorted(r["kwh_per_1b_tokens"] for r in rows)
    run = meshtrain("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-80g",
                    "--objective", "energy", "--tokens", "1e12", "--deadline-hours", "1")
    assert run.returncode == 0, run.stderr
    assert "no layout on up to 16 GPUs" in run.stdout and "deadline of at least" in run.stdout
    half = meshtrain("plan", "--model", "llama2-7b", "--gpus", "16", "--hardware", "h100-80g",
                     "--tokens", "1e12")
    assert half.returncode == 2


def test_estimate_without_a_model_is_refused_with_what_is_missing(meshtrain):
    # --set alone must define the model: no demo model filled in behind the user's back.
    run = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "8",
                    "--set", "model.dim=6144", "--set", "model.n_layers=48",
                    "--set", "model.n_heads=48")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    message = " ".join(run.stderr.split())
    assert "missing: model.ffn_dim, model.vocab_size, train.seq_len" in message
    assert "--model PRESET" in message and "--config" in message
    full = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "8", "--json",
                     "--set", "model.dim=6144", "--set", "model.n_layers=48",
                     "--set", "model.n_heads=48", "--set", "model.ffn_dim=24576",
                     "--set", "model.vocab_size=51200", "--set", "model.mlp=gelu",
                     "--set", "train.seq_len=2048", "--set", "train.global_batch=8",
                     "--set", "train.precision=bf16", "--set", "parallel.tp=8")
    assert full.returncode == 0, full.stderr
    # GPT-style 22B (Korthikanti et al. 2022): multi-head attention (not the demo's 4 kv
    # heads): 12 h^2 + 2 h (norms) per layer, untied embedding and head, a final norm.
    h, layers, vocab = 6144, 48, 51200
    assert json.loads(full.stdout)["params"] == layers * (12 * h * h + 2 * h) + 2 * vocab * h + h


def test_estimate_warns_about_tp_beyond_a_node(meshtrain):
    run = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "16", "--json", *SMALL,
                    "--set", "parallel.tp=16")
    assert run.returncode == 0, run.stderr
    assert "spans 2 nodes" in run.stderr
    assert json.loads(run.stdout)["warnings"]
    inside = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "16", "--json", *SMALL,
                       "--set", "parallel.tp=8")
    assert json.loads(inside.stdout)["warnings"] == [] and "warning" not in inside.stderr


@pytest.mark.parametrize("name,memory", [("h800", 81559 * 2**20 / 1e9),
                                         ("h100-96g", 96 * 2**30 / 1e9)])
def test_h800_and_h100_96g_profiles(meshtrain, name, memory):
    run = meshtrain("estimate", "--hardware", name, "--gpus", "8", "--json", *SMALL)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["hardware"] == name and out["memory_limit_gb"] == pytest.approx(memory - 3.0)


def test_estimate_prices_the_stack_it_is_given(meshtrain):
    from meshtrain.planner.cost.workload import STACKS

    args = ["estimate", "--model", "llama3-8b", "--hardware", "h100-96g", "--gpus", "8",
            "--json", "--set", "train.seq_len=8192", "--set", "train.global_batch=16",
            "--set", "parallel.dp=8", "--set", "parallel.zero=3",
            "--set", "parallel.activation_checkpointing=selective"]
    by_stack = {}
    for stack in STACKS:
        run = meshtrain(*args, "--stack", stack)
        if stack.startswith("megatron"):  # no ZeRO-3 (nor, in 2021, selective recompute)
            assert run.returncode == 2 and "parallel.zero = 3" in " ".join(run.stderr.split())
            run = meshtrain(*args, "--stack", stack, "--set", "parallel.zero=0",
                            "--set", "parallel.activation_checkpointing=full")
        assert run.returncode == 0, run.stderr
        by_stack[stack] = json.loads(run.stdout)
        assert by_stack[stack]["stack"] == stack
    # torchtitan's per-op policy keeps far less than meshtrain's module policy.
    titan, ours = by_stack["torchtitan-2024"], by_stack["meshtrain"]
    assert titan["memory_gb_per_gpu"] < ours["memory_gb_per_gpu"] and titan["fits"]
    import argparse

    from meshtrain.commands.planner import add_hardware_options

    parser = argparse.ArgumentParser()
    add_hardware_options(parser, gpus_required=False)
    choices = next(a.choices for a in parser._actions if a.dest == "stack")
    assert tuple(choices) == tuple(STACKS)  # every stack is offered, and nothing else


def test_estimate_refuses_a_layout_its_stack_cannot_run(meshtrain):
    """Megatron-LM 2021 had no ZeRO, no context or sequence parallelism, no selective
    recompute, equal layers per stage and interleaving only beyond two stages: ``estimate
    --stack megatron-2021`` refuses each, naming what the stack offers."""
    args = ["estimate", "--model", "gpt3-175b", "--hardware", "a100-80g", "--stack",
            "megatron-2021", "--set", "parallel.tp=8", "--set", "parallel.microbatches=8"]
    refusals = {
        ("parallel.zero=1", "parallel.pp=2"): "ZeRO stages it offers: 0",
        ("parallel.cp=2", "parallel.pp=2"): "no context parallelism",
        ("parallel.sequence_parallel=true", "parallel.pp=2"): "no sequence parallelism",
        ("parallel.activation_checkpointing=selective", "parallel.pp=2"): "it offers none, full",
        ("parallel.pp=2", "parallel.pp_schedule=zb-h1"): "it offers 1f1b, interleaved-1f1b",
        ("parallel.pp=5",): "stages must divide the layer count",
        ("parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b",
         "parallel.virtual_stages=2"): "only with pp > 2",
    }
    for overrides, words in refusals.items():
        sets = [item for key in overrides for item in ("--set", key)]
        run = meshtrain(*args, *sets)
        message = " ".join(run.stderr.split())  # the message is wrapped for the terminal
        assert run.returncode == 2 and words in message, (overrides, message)
        assert "--stack megatron-2021 cannot run this layout" in message
    run = meshtrain(*args, "--set", "parallel.pp=4", "--set", "parallel.pp_schedule="
                    "interleaved-1f1b", "--set", "parallel.virtual_stages=3", "--json")
    assert run.returncode == 0, run.stderr  # 96 layers = 4 stages x 3 chunks x 8 layers


def test_every_layout_plan_searches_for_a_stack_is_one_it_can_run():
    from meshtrain.planner.cost.workload import STACKS, Workload, check_stack_offers
    from meshtrain.planner.hardware.profile import Cluster
    from meshtrain.planner.search.layouts import enumerate_layouts
    from meshtrain.planner.tables.presets import preset_config
    from meshtrain.planner.tables.profiles import PROFILES

    config = preset_config("gpt3-175b")
    for name, traits in STACKS.items():
        work = Workload.from_config(config, traits)
        layouts = enumerate_layouts(work, Cluster(PROFILES["a100-80g"], 64, 8))
        assert layouts
        for layout in layouts:
            check_stack_offers(work, layout, name)


EXPLAIN = ["plan", "--model", "gpt3-175b", "--gpus", "96", "--hardware", "a100-80g", "--stack",
           "megatron-2021", "--set", "train.global_batch=1536", "--explain",
           "tp=8,pp=12,ckpt=full"]
"""Narayanan 2021 Figure 12's GPT-3 175B layout (tp 8 × pp 12, 1F1B, full recompute)."""


def test_plan_explain_puts_the_layout_beside_the_first_choice(meshtrain):
    text = meshtrain(*EXPLAIN)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[1].startswith("given:        dp=1 tp=8 pp=12")
    assert lines[2].startswith("first choice: ")
    assert "ranks" in lines[3] and "that fit" in lines[3]
    for term in ("compute", "recompute", "tp communication", "pp communication",
                 "pipeline bubble", "dp communication (exposed)", "  activations",
                 "  optimizer", "  reserve", "  total"):
        assert any(line.startswith(term) for line in lines), term
    out = json.loads(meshtrain(*EXPLAIN, "--json").stdout)["explain"]
    assert out["rank"] >= 1 and out["given"]["layout"]["tp"] == 8
    assert set(out["given"]["memory"]) == {"activations", "parameters", "gradients",
                                           "optimizer", "buffers", "reserve"}
    assert out["first"]["step_time_s"] <= out["given"]["step_time_s"]
    assert out["stack"] == "megatron-2021" and out["gpus"] == 96


@pytest.mark.parametrize("layout,words", [("tp=8,pp=12,zero=1", "megatron-2021 cannot run"),
                                          ("tp=8,pp=7", "does not divide --gpus"),
                                          ("tp=8,bogus=1", "unknown key")])
def test_plan_explain_refuses_a_layout_it_cannot_price(meshtrain, layout, words):
    run = meshtrain(*EXPLAIN[:-1], layout)
    assert run.returncode == 2 and words in run.stderr, run.stderr


OFFLOADED = ["--model", "llama3-70b", "--hardware", "h100-80g", "--gpus", "8",
             "--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true",
             "--set", "parallel.zero=3", "--set", "parallel.microbatches=128",
             "--set", "parallel.activation_checkpointing=full",
             "--set", "parallel.offload=optimizer+params"]
"""Llama 3 70B on one node of 8 H100 at ZeRO-3 with the parameters and optimizer offloaded."""


def test_estimate_prices_offload(meshtrain):
    out = json.loads(meshtrain("estimate", *OFFLOADED, "--json").stdout)
    assert out["fits"] and out["why_not_fits"] is None
    cost = out["offload"]
    assert cost["kind"] == "optimizer+params" and cost["device"] == "host"
    assert cost["host_gb_per_node"] == pytest.approx(8 * (14 * 70.55e9 / 8 + 5e9) / 1e9,
                                                     rel=0.01)
    assert out["breakdown"]["offload_s"] == cost["exposed_s"] > 0
    assert out["per_rank"][0]["param_bytes"] == 0 and out["per_rank"][0]["optim_bytes"] == 0
    text = meshtrain("estimate", *OFFLOADED).stdout
    assert "offload: optimizer+params on host, 123.5 GB of state per rank" in text
    assert "offload adds" in text and "host AdamW" in text and "PCIe" in text


def test_estimate_refuses_a_too_small_host_naming_the_numbers(meshtrain):
    out = json.loads(meshtrain("estimate", *OFFLOADED, "--host-memory-gb", "512",
                               "--json").stdout)
    why = out["why_not_fits"]
    assert not out["fits"] and why["largest"] == "host"
    assert why["offload"]["host_gb_per_node"] == pytest.approx(1027.8, abs=0.5)
    assert why["offload"]["host_limit_gb"] == pytest.approx(460.8)
    assert any(s["fits"] and "parallel.offload_device=nvme" in s["set"]
               for s in why["suggestions"])
    text = meshtrain("estimate", *OFFLOADED, "--host-memory-gb", "512").stdout
    assert "the node does not: host memory 1,028 GB per node" in text
    assert "of 461 GB usable (512 GB less 10% for the system): DOES NOT FIT" in text
    none = meshtrain("estimate", *OFFLOADED, "--host-memory-gb", "512", "--nvme-tb", "0")
    assert "offload_device=nvme" not in none.stdout


def test_plan_proposes_offload_for_70b_on_8_h100(meshtrain):
    args = ["plan", "--model", "llama3-70b", "--gpus", "8", "--gpus-per-node", "8",
            "--hardware", "h100-80g", "--top", "2"]
    text = meshtrain(*args).stdout
    assert "nothing fits without offload" in text and "offload optimizer" in text
    out = json.loads(meshtrain(*args, "--json").stdout)
    assert out["nothing_fits"] is None and out["offload"].startswith("nothing fits without")
    for row in out["candidates"]:
        for key in ("offload", "offload_device", "offload_overlap", "offload_s",
                    "host_gb_per_node", "nvme_gb_per_node"):
            assert key in row
        assert row["offload"] != "none" and row["step_time_s"] > row["offload_s"] > 0
    small = json.loads(meshtrain(*args, "--json", "--host-memory-gb", "512",
                                 "--nvme-tb", "0").stdout)
    assert not small["candidates"] and "512 GB" in small["nothing_fits"]
    never = json.loads(meshtrain(*args, "--json", "--offload", "never").stdout)
    assert not never["candidates"] and never["offload"] is None
