"""``why_not_fits``: the largest part of a layout that does not fit and only the changes that
apply to it, each priced (:mod:`meshtrain.planner.cost.fit_advice`)."""

from __future__ import annotations

from meshtrain.config import parse_override, set_key
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.fit_advice import format_why_not_fits, why_not_fits
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.workload import STACKS, Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.validation.model import validate_shapes


def _why(preset: str, gpus: int, *sets: str, stack: str = "meshtrain"):
    config = preset_config(preset)
    for text in sets:
        set_key(config, *parse_override(text))
    validate_shapes(config)
    par = config.parallel
    par.dp = gpus // (par.tp * par.pp * par.cp)
    work = Workload.from_config(config, STACKS[stack])
    cluster = Cluster(PROFILES["h100-80g"], gpus, 8)
    result = estimate(work, par.layout(), cluster)
    return result, why_not_fits(work, par.layout(), cluster, result, stack)


def _changed_keys(why: dict) -> set[str]:
    return {text.split("=")[0] for s in why["suggestions"] for text in s["set"]}


def test_a_layout_that_fits_has_no_why():
    result, why = _why("llama3-70b", 64, "parallel.tp=8", "parallel.zero=2",
                       "parallel.microbatches=64", "parallel.activation_checkpointing=full")
    assert result["fits"] and why is None


def test_activations_named_with_their_size_and_what_shrinks_them():
    # The README's refusal: one micro-batch of 64 x 8192 tokens per rank.
    result, why = _why("llama3-70b", 64, "parallel.tp=8")
    assert not result["fits"]
    assert why["largest"] == "activations"
    assert why["activations"] == round(result["per_rank"][0]["activation_bytes"] / GB, 1)
    assert why["estimate_gb"] == round(result["memory_gb_per_gpu"], 1)
    assert why["capacity_gb"] == round(result["memory_limit_gb"], 1)
    sets = [s["set"] for s in why["suggestions"]]
    assert ["parallel.microbatches=64"] in sets
    assert ["parallel.activation_checkpointing=full"] in sets
    assert ["parallel.sequence_parallel=true"] in sets
    # tp is already a whole node: no tp = 16
    assert not any("parallel.tp=16" in s for s in sets)
    # every suggestion lowers the peak; no single change fits, so the combination is offered
    assert all(s["estimate_gb"] < why["estimate_gb"] for s in why["suggestions"])
    together = why["suggestions"][0]
    assert together["why"] == "these together" and together["fits"]
    # ZeRO-2 completes it without offload (the README's first estimate), so no offload is proposed
    assert set(together["set"]) == {"parallel.zero=2", "parallel.microbatches=64",
                                    "parallel.activation_checkpointing=full"}
    text = "\n".join(format_why_not_fits(why))
    assert "activations are the largest part" in text and "--set parallel.microbatches=64" in text


def test_combined_changes_offload_only_where_no_layout_change_fits():
    # 70B on one node: no combination of layout changes fits 8 GPUs; with the optimizer state
    # in host memory one does.
    _, why = _why("llama3-70b", 8, "parallel.tp=4", "parallel.microbatches=64")
    together = [s for s in why["suggestions"] if s["why"] == "these together"]
    assert together and together[0]["fits"]
    assert "parallel.offload=optimizer" in together[0]["set"]


def test_gradients_at_zero_1_suggest_zero_2():
    _, why = _why("llama3-70b", 64, "parallel.tp=8", "parallel.zero=1",
                  "parallel.microbatches=64", "parallel.activation_checkpointing=full")
    assert why["largest"] == "gradients"
    assert why["suggestions"][0]["set"] == ["parallel.zero=2"] and why["suggestions"][0]["fits"]


def test_no_zero_suggestion_at_zero_3_or_where_the_stack_has_none():
    # 405B on 16 GPUs at ZeRO-3: the model states alone do not fit; sharding more is tp / pp.
    _, why = _why("llama3-405b", 16, "parallel.zero=3", "parallel.microbatches=128",
                  "parallel.activation_checkpointing=full")
    assert why["largest"] in ("parameters", "gradients", "optimizer")
    assert "parallel.zero" not in _changed_keys(why)
    assert {"parallel.tp", "parallel.pp"} & _changed_keys(why)
    # Megatron-LM 2021 offers ZeRO 0 only.
    _, why = _why("llama3-70b", 64, "parallel.tp=8", "parallel.microbatches=64",
                  "parallel.activation_checkpointing=full", stack="megatron-2021")
    assert why is not None and "parallel.zero" not in _changed_keys(why)
    assert "parallel.activation_checkpointing" not in _changed_keys(why)  # already full
