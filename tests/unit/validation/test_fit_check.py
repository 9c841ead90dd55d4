"""A run that cannot fit in memory is refused before any worker builds its model: the planner's
per-rank estimate (plus the document mask, the loss's buffers and the runtime) against the host's
available memory on the CPU (all local ranks together) or each device's free memory on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.commands import fit_check
from meshtrain.commands.fit_check import GB, check_fits, estimate_ranks
from meshtrain.config import ConfigError, load_config
from meshtrain.validation.run_config import validate_config
from tests.helpers import tiny_config

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.toml"))


def host(monkeypatch, available: float) -> None:
    monkeypatch.setattr(fit_check, "host_available", lambda: (available, "MemAvailable"))
    monkeypatch.setattr(fit_check, "resolve_device_type", lambda device: "cpu")


def test_the_estimate_counts_logits_mask_and_runtime():
    plain = estimate_ranks(tiny_config("train.seq_len=64"), 1)[0]
    b, s, v = 8, 64, 264
    assert plain.parts["logits"] == pytest.approx((4 + fit_check.LOSS_BYTES_PER_LOGIT) * b * s * v)
    assert plain.parts["runtime"] == fit_check.CPU_RUNTIME_BYTES
    assert "document mask" not in plain.parts
    masked = estimate_ranks(tiny_config("train.seq_len=64", "data.document_mask=true"), 1)[0]
    # the boolean mask and SDPA's fp32 copy saved by each of the 2 blocks
    assert masked.parts["document mask"] == pytest.approx(b * s * s * (1 + 4 * 2))
    longer = estimate_ranks(tiny_config("train.seq_len=128", "data.document_mask=true"), 1)[0]
    assert longer.parts["document mask"] == pytest.approx(4 * masked.parts["document mask"])
    assert longer.parts["activations"] == pytest.approx(2 * masked.parts["activations"], rel=0.01)


def test_pipeline_stages_are_priced_apart_with_the_logits_on_the_last():
    first, last = estimate_ranks(tiny_config("parallel.pp=2", "parallel.microbatches=2",
                                             nproc=2), 2)
    assert first.parts["logits"] == 0 < last.parts["logits"]
    assert first.ranks == last.ranks == 1


def test_replica_groups_take_their_share_of_the_batch():
    one = estimate_ranks(tiny_config("parallel.dp=2", nproc=2), 2)[0]
    two = estimate_ranks(tiny_config("parallel.replicas=2", nproc=2), 2)[0]
    assert two.parts["activations"] == pytest.approx(one.parts["activations"])
    assert two.parts["DiLoCo outer state"] == pytest.approx(one.parts["optimizer states"])


def test_every_shipped_config_fits_a_small_machine():
    """configs/*.toml: all their ranks together well under 8 GB, so none is ever refused."""
    for path in CONFIGS:
        config = load_config(path, ["train.device=cpu"])
        world = validate_config(config, None if config.parallel.dp else 2)
        ranks = estimate_ranks(config, world)
        assert sum(r.total * r.ranks for r in ranks) < 8 * GB, path.name


def test_a_million_token_sequence_is_refused_with_both_numbers(monkeypatch):
    host(monkeypatch, 16 * GB)
    config = tiny_config("train.seq_len=1048576", "train.global_batch=1", "model.dim=256",
                         "model.n_heads=8", "model.ffn_dim=704")
    with pytest.raises(ConfigError) as error:
        check_fits(config, 1)
    message = str(error.value)
    assert "cannot fit in memory" in message and "only 16.00 GB is available" in message
    estimate = sum(r.total for r in estimate_ranks(config, 1))
    assert f"needs about {fit_check._gb(estimate)} of host memory" in message
    assert "activations" in message and "train.seq_len" in message


def test_a_huge_vocabulary_is_refused(monkeypatch):
    host(monkeypatch, 64 * GB)
    with pytest.raises(ConfigError, match=r"vocabulary 2000000000.*model.vocab_size"):
        check_fits(tiny_config("model.vocab_size=2000000000"), 1)


def test_refused_only_beyond_the_margin_and_never_when_unknown(monkeypatch, capsys):
    config = tiny_config()
    need = estimate_ranks(config, 1)[0].total
    host(monkeypatch, need / fit_check.FIT_MARGIN * 1.001)
    check_fits(config, 1)
    assert "memory check: the run needs about" in capsys.readouterr().err
    host(monkeypatch, need / fit_check.FIT_MARGIN * 0.999)
    with pytest.raises(ConfigError):
        check_fits(config, 1)
    monkeypatch.setattr(fit_check, "host_available", lambda: None)
    check_fits(config, 1)


def test_local_ranks_share_the_host(monkeypatch):
    config = tiny_config("parallel.dp=4", nproc=4)
    per_rank = estimate_ranks(config, 4)[0].total
    host(monkeypatch, 3 * per_rank)  # room for three of the four
    with pytest.raises(ConfigError, match="the 4 ranks on this host need"):
        check_fits(config, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a job with 2 of its 4 ranks here
    check_fits(config, 4, in_job=True)


def test_cgroup_limit_lowers_what_is_available(tmp_path, monkeypatch):
    stat = tmp_path / "memory.stat"
    stat.write_text(f"anon {2**30}\nfile {2**29}\nfile_mapped 4096\n")
    limit, usage = str(tmp_path / "memory.max"), str(tmp_path / "memory.current")
    values = {limit: 3 * 2**30, usage: 2**30 + 2**29}
    monkeypatch.setattr(fit_check, "_CGROUPS", ((limit, usage, str(stat), ("file",)),))
    monkeypatch.setattr(fit_check, "_read_int", values.get)
    monkeypatch.setattr(fit_check, "_meminfo_available", lambda: 100 * GB)
    # 3 GiB limit, 1.5 GiB used of which 0.5 GiB page cache: 2 GiB left
    assert fit_check.host_available() == (2 * 2**30, "left under this cgroup's memory limit")
    values[limit] = 2**63 - 4096  # v1's "no limit"
    assert fit_check.host_available() == (100 * GB, "MemAvailable")


def test_on_a_gpu_each_rank_is_compared_with_its_device(monkeypatch):
    monkeypatch.setattr(fit_check, "resolve_device_type", lambda device: "cuda")
    config = tiny_config("train.seq_len=4096", "train.global_batch=8", "parallel.dp=2", nproc=2)
    need = estimate_ranks(config, 2, "cuda")[0].total
    assert estimate_ranks(config, 2, "cuda")[0].parts["runtime"] == fit_check.CUDA_CONTEXT_BYTES
    asked = []
    monkeypatch.setattr(fit_check, "cuda_free",
                        lambda n, in_process: asked.append((n, in_process)) or [2 * need, need / 2])
    with pytest.raises(ConfigError, match="a rank needs about .* of device memory.*smallest"):
        check_fits(config, 2)
    assert asked == [(2, False)]  # two spawned workers: asked in a child process
    monkeypatch.setattr(fit_check, "cuda_free", lambda n, in_process: [1.5 * need])
    check_fits(config, 2)
    monkeypatch.setattr(fit_check, "cuda_free", lambda n, in_process: None)
    check_fits(config, 2)
