"""The pipeline simulator, its closed forms, the timelines and ``meshtrain simulate``."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main
from meshtrain.config import ConfigError
from meshtrain.parallel.pipeline import ActionKind, StageTimes, build_schedule, simulate
from meshtrain.parallel.pipeline.simulator import closed_form_bubble
from meshtrain.parallel.pipeline.timeline import (
    chrome_trace,
    format_ascii,
    plot_timeline,
    write_chrome_trace,
)

SIZES = [(2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (4, 12), (8, 8), (8, 16)]


@pytest.mark.parametrize("pp, m", SIZES)
def test_closed_forms_with_unit_times(pp, m):
    unit = StageTimes(f=1.0, b=1.0, w=1.0)
    one_f_one_b = (pp - 1) / (m + pp - 1)
    for name, early in (("gpipe", True), ("1f1b", False)):
        assert simulate(build_schedule(name, pp, m, early_grad_sends=early),
                        unit).bubble_fraction == pytest.approx(one_f_one_b, abs=1e-3)
    # 1F1B's early gradient sends take one W off each of the p - 1 cool-down hand-overs
    early = simulate(build_schedule("1f1b", pp, m), unit).bubble_fraction
    assert early == pytest.approx(2 * (pp - 1) / (3 * m + 2 * (pp - 1)), abs=1e-3)
    assert early < one_f_one_b
    zb_h1 = simulate(build_schedule("zb-h1", pp, m), unit).bubble_fraction
    assert zb_h1 == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-3)
    for v in (2, 3) if m % pp == 0 else ():  # Megatron's interleaving needs p | m
        inter = simulate(build_schedule("interleaved-1f1b", pp, m, v), unit).bubble_fraction
        assert inter == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-3)
        assert inter < one_f_one_b
    zb_v = simulate(build_schedule("zb-v", pp, m, 2), unit).bubble_fraction
    assert zb_v >= (pp - 1) / (6 * m + pp - 1) - 1e-9  # the V's start-up lower bound
    if m >= 2 * pp:
        assert zb_v <= zb_h1 + 1e-9


def test_zb_v_reaches_its_lower_bound_when_m_is_a_multiple_of_p():
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        result = simulate(build_schedule("zb-v", pp, m, 2))
        assert result.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1), abs=1e-9)


@pytest.mark.parametrize("times", [StageTimes(1, 2, 0.5), StageTimes(2, 1, 1),
                                   StageTimes(1, 3, 0), StageTimes(1, 1.5, 0.7)])
def test_closed_forms_with_uneven_kinds(times):
    for name, v in [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]:
        for pp, m in [(2, 4), (4, 8), (3, 7 if v == 1 else 9)]:
            expected = closed_form_bubble(name, pp, m, v, times)
            result = simulate(build_schedule(name, pp, m, v), times)
            assert result.bubble_fraction == pytest.approx(expected, abs=1e-3), (name, pp, m)
    assert closed_form_bubble("zb-v", 4, 8, 2, times) is None
    assert closed_form_bubble("1f1b", 4, 8, 1, StageTimes(comm=0.1)) is None


def test_event_timing_per_stage_times_and_comm():
    schedule = build_schedule("1f1b", 2, 1, early_grad_sends=False)
    times = [StageTimes(f=1, b=2, w=3, comm=0.5), StageTimes(f=4, b=5, w=6, comm=0.25)]
    result = simulate(schedule, times)
    spans = {str(a): (s, e) for _, a, s, e in result.events}
    assert spans["F0@s0"] == (0, 1)
    assert spans["RECV_ACT0@s1<-0"] == (0, 1.5)  # rank 1 waits for the send + stage 0's comm
    assert spans["F0@s1"] == (1.5, 5.5)
    assert spans["B0@s1"] == (5.5, 16.5)  # B costs b + w
    assert spans["RECV_GRAD0@s0<-1"] == (1, 16.75)
    assert spans["B0@s0"] == (16.75, 21.75)
    assert result.makespan == 21.75
    busy = 1 + 5 + 4 + 11
    assert result.bubble_fraction == pytest.approx((2 * 21.75 - busy) / (2 * 21.75))
    assert [e[1].kind for e in result.compute_events()] == \
        [ActionKind.F, ActionKind.F, ActionKind.B, ActionKind.B]


def test_bad_stage_times_are_config_errors():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="one StageTimes per global stage"):
        simulate(schedule, [StageTimes()])
    with pytest.raises(ConfigError, match=">= 0"):
        simulate(schedule, StageTimes(f=-1))


def test_ascii_timeline():
    text = format_ascii(build_schedule("zb-h1", 2, 2))
    assert text.splitlines() == ["rank 0:  F0 F1  . I0 W0 I1 W1",
                                 "rank 1:   . F0 I0 F1 I1 W0 W1"]
    assert "F0b" in format_ascii(build_schedule("zb-v", 2, 2, 2))


def test_chrome_trace_and_png(tmp_path):
    result = simulate(build_schedule("interleaved-1f1b", 2, 2, 2))
    doc = chrome_trace(result.events)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(result.events)
    first = spans[0]
    assert first["pid"] == 0 and first["tid"] == 0 and first["name"] == "F0@s0"
    assert first["ts"] == 0 and first["dur"] == pytest.approx(1e6)
    path = write_chrome_trace(result.events, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    png = plot_timeline(result.events, 2, tmp_path / "t.png", "interleaved")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_json_plot_and_trace(tmp_path, capsys):
    png, trace = tmp_path / "zbv.png", tmp_path / "zbv.json"
    assert main(["simulate", "--schedule", "zb-v", "--pp", "4", "--microbatches", "8",
                 "--json", "--plot", str(png), "--trace", str(trace)]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("makespan", "bubble_fraction", "peak_inflight", "schedule", "pp",
                "microbatches", "virtual_stages", "times"):
        assert key in doc
    assert doc["schedule"] == "zb-v" and doc["virtual_stages"] == 2 and doc["pp"] == 4
    assert doc["bubble_fraction"] == pytest.approx(3 / 51)
    assert len(doc["peak_inflight"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(trace.read_text())["traceEvents"]


def test_cli_simulate_table(capsys):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                 "--times", "1,2,0"]) == 0
    out = capsys.readouterr().out
    assert "bubble_fraction  0.2727" in out and "closed form      0.2727" in out
    assert "r0=4 r1=3 r2=2 r3=1" in out


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "nope", "--pp", "2", "--microbatches", "2"], "valid: gpipe"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--times", "1,x,1"],
     "--times takes three"),
    (["--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "6"], "divisible"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--comm", "-1"], "--comm"),
])
def test_cli_simulate_bad_input_exits_2(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")
