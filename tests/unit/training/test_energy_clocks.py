"""``train.energy_schedule``: each pipeline action at its energy schedule's clock."""

from __future__ import annotations

import pytest
import torch

from meshtrain.config import ConfigError, config_from_dict
from meshtrain.planner.energy.schedule import power_curve
from meshtrain.planner.tables.profiles import PROFILES
from tests.distributed import run_distributed
from tests.helpers import tiny_config

H100 = PROFILES["h100-80g"]


def _imbalanced_config():
    """pp 2 with four of six layers on the first stage: the second rank has slack."""
    return tiny_config("model.n_layers=6", "parallel.pp=2", "parallel.pp_split=4,2",
                       "parallel.microbatches=4", "train.global_batch=16", nproc=2)


def test_the_rank_with_slack_runs_lower_clocks():
    from meshtrain.training.energy_clocks import action_clocks

    config = _imbalanced_config()
    full = power_curve(H100).max_clock_mhz
    busy, idle = action_clocks(config, H100, 0), action_clocks(config, H100, 1)
    # a forward and a backward per micro-batch; rank 1's last backward runs as I and W (1F1B's
    # early gradient send)
    assert len(busy) == 2 * 4 and len(idle) == 2 * 4 + 1
    # the first forward starts the step on both ranks: on the critical path, at full clock
    assert max(busy.values()) == max(idle.values()) == full
    assert sum(idle.values()) / len(idle) < sum(busy.values()) / len(busy)
    assert min(idle.values()) < full


def test_clock_setter_sets_each_change_once_and_stops_at_the_first_failure():
    from meshtrain.parallel.pipeline.schedules import build_schedule
    from meshtrain.training.energy_clocks import ClockSetter

    actions = [a for a in build_schedule("1f1b", 2, 2, 1).actions[1] if a.kind.is_compute]
    calls = []
    setter = ClockSetter({actions[0]: 1500.0, actions[1]: 1500.0, actions[2]: 1980.0},
                         lambda mhz: calls.append(mhz) or "applied")
    for action in actions:
        setter(action)
    assert calls == [1500.0, 1980.0] and setter.failure is None
    refused = ClockSetter({a: 1000.0 + i for i, a in enumerate(actions)},
                          lambda mhz: calls.append(mhz) or "not applied: no permission")
    calls.clear()
    for action in actions:
        refused(action)
    assert calls == [1000.0] and refused.failure == "not applied: no permission"


def record_clock_calls(config_dict: dict) -> tuple[list[float], list[float]]:
    """Train with a recording ClockSetter on the executor: the clocks set, and the schedule's
    clocks of the rank's compute actions in execution order."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.energy_clocks import ClockSetter, action_clocks
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    clocks = action_clocks(config, H100, trainer.mesh.pp_rank)
    calls = []
    trainer.pipeline.before_compute = ClockSetter(clocks,
                                                  lambda mhz: calls.append(mhz) or "applied")
    trainer.train_step()
    order = [clocks[a] for a in trainer.pipeline.schedule.actions[trainer.mesh.pp_rank]
             if a.kind.is_compute]
    return calls, order


def test_the_executor_sets_every_actions_clock_in_order():
    results = run_distributed(2, record_clock_calls, _imbalanced_config().to_dict())
    for calls, order in results:
        changes = [c for i, c in enumerate(order) if i == 0 or c != order[i - 1]]
        assert calls == changes


def _fit(config_dict: dict) -> list[float]:
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    return [r["loss"] for r in Trainer(config, build_mesh(config)).fit()]


def test_on_cpu_it_says_why_not_and_trains_the_same(tmp_path):
    from meshtrain.training.energy_clocks import install_energy_schedule

    def losses(*extra):
        config = tiny_config("model.n_layers=4", "parallel.pp=2", "parallel.microbatches=2",
                             "train.steps=2", *extra, run_dir=str(tmp_path / str(len(extra))),
                             nproc=2)
        return run_distributed(2, _fit, config.to_dict())[0]

    assert losses("train.energy_schedule=true") == losses()
    note = install_energy_schedule(tiny_config("model.n_layers=4", "parallel.pp=2", nproc=2),
                                   torch.device("cpu"), 0, None)
    assert note.startswith("not applied: the cpu device has no GPU clocks")
    with pytest.raises(ConfigError, match="train.energy_schedule = true needs a pipeline"):
        tiny_config("train.energy_schedule=true")
