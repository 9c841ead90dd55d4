"""``plan --explain LAYOUT``: the layout syntax, and a low-ranked published layout beside the
planner's first choice, term by term."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.search.explain import (
    TIME_TERMS,
    explain,
    format_explain,
    parse_layout,
)
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.published import published_rows

ROW = next(r for r in published_rows() if r.name == "GPT 18.4B tp8 pp1 dp32")
"""Narayanan 2021 Table 1's 18.4B model on 256 GPUs (the layout syntax's examples)."""

LOW = next(r for r in published_rows() if r.name == "GPT 39.1B tp8 pp2 dp32")
"""Narayanan 2021 Table 1's 39.1B model, which the search ranks 71st (docs/planner.md)."""


def test_layout_syntax_fills_dp_and_micro_batches():
    work = ROW.workload  # 1,024 sequences
    lay = parse_layout("tp=8, pp=1, ckpt=full, mbs=8", work, 256)
    assert (lay.dp, lay.tp, lay.pp, lay.microbatches) == (32, 8, 1, 4)
    assert lay.activation_checkpointing == "full"
    lay = parse_layout("dp=8,tp=4,pp=8,sp=true,schedule=interleaved-1f1b,v=5,zero=1", work, 256)
    assert lay.sequence_parallel and lay.virtual_stages == 5 and lay.microbatches == 128
    assert parse_layout("tp=8,microbatches=16", work, 256).microbatches == 16


@pytest.mark.parametrize("text,words", [("tp=8,foo=1", "unknown key"), ("tp=eight", "integer"),
                                        ("tp=8,sp=maybe", "true or false"), ("tp", "key=value"),
                                        ("dp=4,tp=8", "is not --gpus"),
                                        ("tp=8,mbs=3", "does not divide"),
                                        ("tp=3", "does not divide --gpus"),
                                        ("", "needs a layout"), (" , ", "needs a layout")])
def test_layout_syntax_refuses_what_it_cannot_read(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_layout(text, ROW.workload, 256)


def test_a_low_ranked_published_layout_beside_the_first_choice():
    cluster = Cluster(PROFILES[LOW.profile], LOW.gpus, 8)
    result = explain(LOW.workload, cluster, LOW.layout, LOW.stack)
    given, first = result["given"], result["first"]
    assert result["rank"] > 10 and result["given_fits"]
    assert first["step_time_s"] < given["step_time_s"] and result["speedup"] > 0.05
    assert (first["layout"]["tp"], first["layout"]["pp"]) != (8, 2)
    for side in (given, first):  # the terms add up to the step, the components to the peak
        assert sum(side["time"][key] for _, key in TIME_TERMS) == pytest.approx(
            side["step_time_s"], rel=1e-9)
        assert sum(side["memory"].values()) == pytest.approx(side["memory_gb_per_gpu"],
                                                             rel=1e-6)
    deltas = sum(d["seconds"] for d in result["differences"])
    assert deltas == pytest.approx(first["step_time_s"] - given["step_time_s"], rel=1e-3)
    text = format_explain(result)
    assert "given:        dp=32 tp=8 pp=2" in text and "first choice:" in text
    assert f"ranks {result['rank']} of {result['feasible']}" in text
    for label, _ in TIME_TERMS:
        assert label in text
    for name in ("activations", "parameters", "optimizer", "reserve"):
        assert f"  {name}" in text
    assert "the difference rests on:" in text


def test_explain_refuses_a_layout_the_stack_cannot_run():
    cluster = Cluster(PROFILES[ROW.profile], ROW.gpus, 8)
    layout = parse_layout("tp=8,sp=true,ckpt=full", ROW.workload, 256)
    with pytest.raises(ConfigError, match="megatron-2021-torch-ddp cannot run"):
        explain(ROW.workload, cluster, layout, ROW.stack)
