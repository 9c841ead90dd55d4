"""The planner across sites: DiLoCo's replica traffic priced, and sites on the wide-area link.

The byte counts are checked against the runtime's own ``comm_bytes.replica``, measured on a tiny
two-group CPU training run (rank 0's counter, summed over the run): they must agree within 1 %
(the planner counts parameters by formula; the runtime pads nothing for fp32, and the 8-bit
padding is the planner's too). The rest are properties of the pricing that a wrong model would
break: rounds amortised over H, fragments cutting the largest exchange, the 8-bit formats' byte
ratio, the inner layout's traffic staying on its site, and the plan's choice flipping with the
link's speed.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import ConfigError
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.sites.diloco_cost import (
    ReplicaSettings,
    check_replica_settings,
    estimate_replicated,
)
from meshtrain.planner.sites.wide_area import WideArea, wide_area_from_options
from meshtrain.planner.tables.profiles import PROFILES
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

H100 = PROFILES["h100-80g"]


def _workload(config) -> Workload:
    from meshtrain.validation.model import validate_shapes

    validate_shapes(config)
    return Workload.from_config(config)


def test_planner_bytes_match_the_runtime_counter():
    """2 groups × dp 1, H = 3, fp32, and int8 with 2 fragments (fragment 0 syncs at steps 1
    and 4, fragment 1 at 3 and 6; every fragment again at the run's last step, 7, which the
    steady state leaves out): the planner's per-step amortised bytes × 6 equal the counter
    summed over steps 1-6, a round's bytes the counter over steps 1-3 less the metrics."""
    steps = 7
    common = ("parallel.replicas=2", "parallel.sync_every=3", f"train.steps={steps}")
    configs = [tiny_config(*common, nproc=2),
               tiny_config(*common, "parallel.outer_grad_dtype=int8", "parallel.sync_fragments=2",
                           nproc=2)]
    runs = run_distributed(2, train_many, [c.to_dict() for c in configs], steps)[0]
    cluster = Cluster(H100, 2, 1, wan=WideArea(2, 1.0, 10.0))
    for config, records in zip(configs, runs, strict=True):
        measured = [r["comm_bytes"]["replica"] for r in records]
        settings = ReplicaSettings.from_config(config.parallel)
        priced = estimate_replicated(_workload(config), config.parallel.layout(), cluster,
                                     settings)
        metrics = priced["replica_step_metrics_bytes"]
        assert min(measured) == metrics  # a step without a sync
        assert sum(measured[:6]) == pytest.approx(6 * priced["replica_comm_bytes"], rel=0.01)
        assert sum(measured[:3]) - 3 * metrics == pytest.approx(priced["replica_round_bytes"],
                                                                rel=0.01)
        print(settings.outer_grad_dtype, "measured", sum(measured[:6]), "planned",
              6 * priced["replica_comm_bytes"])


def _llama_like(layers: int = 16, batch: int = 64) -> Workload:
    from meshtrain.planner.tables.presets import preset_config

    config = preset_config("llama3.2-1b")
    config.train.global_batch = batch
    config.model.n_layers = layers
    return Workload.from_config(config)


def _priced(workload, cluster, layout=None, **settings):
    from meshtrain.config.layout import Layout

    layout = layout or Layout(dp=cluster.gpus // settings.get("replicas", 2), zero=1)
    full = dict(replicas=2, sync_every=10, sync_fragments=1, outer_grad_dtype="fp32")
    full.update(settings)
    return estimate_replicated(workload, layout, cluster, ReplicaSettings(**full))


def test_rounds_are_amortised_over_h_and_fragments_cut_the_largest_sync():
    cluster = Cluster(H100, 16, 8, wan=WideArea(2, 1.0, 20.0))
    work = _llama_like()
    h10, h100 = _priced(work, cluster, sync_every=10), _priced(work, cluster, sync_every=100)
    metrics = h10["replica_step_metrics_bytes"]
    assert h10["replica_round_bytes"] == h100["replica_round_bytes"]
    assert (h10["replica_comm_bytes"] - metrics) == pytest.approx(
        10 * (h100["replica_comm_bytes"] - metrics))
    assert h10["replica_comm_s"] > 9 * h100["replica_comm_s"]
    assert h10["step_time_s"] - h100["step_time_s"] == pytest.approx(
        h10["replica_comm_exposed_s"] - h100["replica_comm_exposed_s"])
    whole = _priced(work, cluster, sync_every=20)
    streamed = _priced(work, cluster, sync_every=20, sync_fragments=4)
    ratio = whole["replica_sync_bytes_max"] / streamed["replica_sync_bytes_max"]
    assert 3.3 <= ratio <= 4.0, ratio  # the embedding and head make the end fragments larger
    assert streamed["replica_round_bytes"] == pytest.approx(whole["replica_round_bytes"],
                                                            rel=1e-3)
    # parallel.sync_overlap = τ: a fragment's exchange hides behind τ inner steps, up to the
    # whole of it; blocking, none of it does.
    inner = streamed["inner_step_time_s"]
    for overlap in (1, 2, 5):
        hidden = _priced(work, cluster, sync_every=20, sync_fragments=4, sync_overlap=overlap)
        assert hidden["replica_comm_exposed_s"] <= streamed["replica_comm_exposed_s"]
        assert hidden["replica_comm_s"] == pytest.approx(streamed["replica_comm_s"])
        assert hidden["step_time_s"] == pytest.approx(
            streamed["step_time_s"] - streamed["replica_comm_exposed_s"]
            + hidden["replica_comm_exposed_s"])
    longest = streamed["replica_sync_s_max"]
    enough = _priced(work, cluster, sync_every=20, sync_fragments=4,
                     sync_overlap=min(19, int(longest / inner) + 1))
    blocking_rounds = streamed["replica_comm_exposed_s"] - enough["replica_comm_exposed_s"]
    assert blocking_rounds == pytest.approx(streamed["replica_round_s"] / 20, rel=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_eight_bit_pseudo_gradients_move_a_quarter_plus_scales(dtype):
    cluster = Cluster(H100, 16, 8, wan=WideArea(2, 1.0, 20.0))
    work = _llama_like()
    fp32 = _priced(work, cluster)["replica_round_bytes"]
    quantized = _priced(work, cluster, outer_grad_dtype=dtype)["replica_round_bytes"]
    assert quantized / fp32 == pytest.approx((1 + 4 / 256) / 4, rel=1e-3)
    bf16 = _priced(work, cluster, outer_grad_dtype="bf16")["replica_round_bytes"]
    assert bf16 / fp32 == pytest.approx(0.5, rel=1e-6)


def test_inner_traffic_stays_on_the_site_and_sync_dp_crosses_the_link():
    """One group per site: the group's own dp traffic is priced as on a one-site cluster of its
    size, only the replica exchange crosses; synchronous dp over both sites is bound by the
    link: its gradient time follows the link's bandwidth."""
    from meshtrain.config.layout import Layout
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.sites.across_sites import describe_sites

    work = _llama_like()
    two_sites = Cluster(H100, 16, 8, wan=WideArea(2, 1.0, 20.0))
    diloco = _priced(work, two_sites)
    alone = estimate(dataclasses.replace(work, global_batch=32), Layout(dp=8, zero=1),
                     Cluster(H100, 8, 8), use_simulator=False)
    assert diloco["breakdown"]["dp_comm_total_s"] == alone["breakdown"]["dp_comm_total_s"]
    assert describe_sites(work, Layout(dp=8, zero=1), two_sites, diloco)["crossing"] == [
        "replica"]
    sync = Layout(dp=16, zero=1)
    slow = estimate(work, sync, two_sites, use_simulator=False)
    fast = estimate(work, sync, dataclasses.replace(two_sites, wan=WideArea(2, 2.0, 20.0)),
                    use_simulator=False)
    one_site = estimate(work, sync, Cluster(H100, 16, 8), use_simulator=False)
    section = describe_sites(work, sync, two_sites, slow)
    assert section["crossing"] == ["dp"]
    link_s = section["dp_comm_bytes"] / (1e9 / 8)  # 1 Gb/s: the bytes through it, at least
    assert slow["breakdown"]["dp_comm_total_s"] >= 0.9 * link_s
    assert slow["breakdown"]["dp_comm_total_s"] > 100 * one_site["breakdown"]["dp_comm_total_s"]
    assert fast["breakdown"]["dp_comm_total_s"] == pytest.approx(
        slow["breakdown"]["dp_comm_total_s"] / 2, rel=0.05)


def test_plan_proposes_diloco_on_a_slow_link_and_synchronous_on_a_fast_one():
    from meshtrain.planner.search.layouts import plan
    from meshtrain.planner.sites.across_sites import plan_across_sites

    work = _llama_like(layers=4, batch=32)
    answers = {}
    # A slow link (1 Gb/s, 10 ms) and a fast one as good as the nodes' own network
    # (3200 Gb/s: 8 x 400 Gb/s NICs, 0.05 ms: every latency-bound sync pays it).
    for gbps, latency in ((1.0, 10.0), (3200.0, 0.05)):
        cluster = Cluster(H100, 16, 8, wan=WideArea(2, gbps, latency))
        synchronous = plan(work, cluster, 3).candidates
        answers[gbps] = plan_across_sites(work, cluster, synchronous)
    slow, fast = answers[1.0], answers[3200.0]
    assert slow["proposal"] == "diloco" and slow["speedup_over_synchronous"] > 2
    assert slow["diloco"]["replicas"] == 2 and slow["diloco"]["sync_every"] in (10, 20, 50,
                                                                                100, 500)
    assert slow["saving"]["bytes_ratio"] > slow["diloco"]["sync_every"] / 2
    assert slow["saving"]["comm_s_per_step_diloco"] < slow["saving"][
        "comm_s_per_step_synchronous_dp"]
    assert fast["proposal"] == "synchronous"
    assert "not convergence" in slow["convergence_note"]


@pytest.mark.parametrize("options, words", [
    ((4, 3, None, 1.0, None), "valid: 1, 2, 4"),
    ((4, None, 3, 1.0, None), "does not divide the 4 nodes"),
    ((4, 2, 1, 1.0, None), "give one of the two"),
    ((4, 2, None, None, None), "give --wan-gbps"),
    ((4, None, None, 1.0, None), "give --sites"),
    ((4, 2, None, 0.0, None), "positive bandwidth"),
    ((4, 2, None, 1.0, -1.0), "at least 0"),
    ((4, 0, None, 1.0, None), "at least 1"),
])
def test_bad_site_options_are_refused(options, words):
    nodes, sites, per_site, gbps, latency = options
    with pytest.raises(ConfigError, match=words):
        wide_area_from_options(nodes, 8, sites, per_site, gbps, latency)


def test_bad_replica_settings_are_refused():
    cluster = Cluster(H100, 24, 8, wan=WideArea(3, 1.0))
    work = _llama_like(batch=48)
    with pytest.raises(ConfigError, match="straddle a site boundary"):
        check_replica_settings(ReplicaSettings(2), work, cluster)
    with pytest.raises(ConfigError, match="valid: 1 to 10"):
        check_replica_settings(ReplicaSettings(3, 10, 11), work, cluster)
    with pytest.raises(ConfigError, match="fp32, bf16, int8, fp8"):
        check_replica_settings(ReplicaSettings(3, 10, 1, "fp16"), work, cluster)


def test_estimate_cli_prices_replica_groups_and_refuses_a_bad_site_split(meshtrain):
    base = ("estimate", "--model", "llama3.2-1b", "--hardware", "h100-80g", "--gpus", "16",
            "--set", "train.global_batch=32", "--sites", "2", "--wan-gbps", "1")
    result = meshtrain(*base, "--set", "parallel.replicas=2", "--set", "parallel.sync_every=50")
    assert result.returncode == 0, result.stderr
    assert "DiLoCo: 2 replica groups, sync_every 50" in result.stdout
    assert "crossing it: replica" in result.stdout and "not convergence" in result.stdout
    bad = meshtrain(*base[:-4], "--sites", "3", "--wan-gbps", "1")
    assert bad.returncode == 2 and "--sites 3 does not split the 2 nodes" in bad.stderr


def test_pipeline_sends_and_expert_all_to_alls_that_cross_sites_pay_the_link():
    """pp 2 with one stage per site: the stage boundary's sends cross the link (half the link,
    twice the time); an MoE model's ep spanning both sites pays for its off-site share."""
    from meshtrain.config.layout import Layout
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.sites.across_sites import crossing_axes

    work = _llama_like(layers=4, batch=32)
    piped = Layout(dp=8, pp=2, microbatches=4)
    prices = {}
    for gbps in (10.0, 20.0, None):
        cluster = Cluster(H100, 16, 8, wan=WideArea(2, gbps, 1.0) if gbps else None)
        prices[gbps] = estimate(work, piped, cluster, use_simulator=False)["breakdown"]
    assert crossing_axes(piped, Cluster(H100, 16, 8, wan=WideArea(2, 10.0))) == ["pp"]
    assert prices[10.0]["pp_comm_s"] > 50 * prices[None]["pp_comm_s"]
    assert prices[10.0]["pp_comm_s"] == pytest.approx(2 * prices[20.0]["pp_comm_s"], rel=0.05)
    moe = dataclasses.replace(work, model=dataclasses.replace(work.model, moe_experts=16,
                                                              moe_top_k=2))
    expert = Layout(dp=16, ep=16, zero=1)
    one, two = (estimate(moe, expert, Cluster(H100, 16, 8, wan=wan), use_simulator=False)
                for wan in (None, WideArea(2, 10.0, 1.0)))
    assert "ep" in crossing_axes(expert, Cluster(H100, 16, 8, wan=WideArea(2, 10.0)))
    assert two["breakdown"]["ep_comm_s"] > 10 * one["breakdown"]["ep_comm_s"]
