"""BatchPrefetcher: the same batches as TrainData, one step ahead, sampler position unchanged."""

from __future__ import annotations

import torch

from meshtrain.data.prefetch import BatchPrefetcher
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.training.trainer import IGNORE_INDEX, Trainer
from tests.helpers import tiny_config


def test_prefetch_matches_plain_loading_and_keeps_the_data_position():
    config = tiny_config("parallel.microbatches=2")
    reference = Trainer(config, ParallelMesh()).data
    data = Trainer(tiny_config("parallel.microbatches=2"), ParallelMesh()).data
    batches = BatchPrefetcher(data, torch.device("cpu"), IGNORE_INDEX)
    for _ in range(3):
        expected = reference.next_step()
        got, tokens = batches.next_step()
        batches.prefetch()  # step ahead: must not move the saved position
        assert data.state_dict() == reference.state_dict()
        assert len(got) == len(expected)
        for (x, y), (ex, ey) in zip(got, expected, strict=True):
            assert torch.equal(x, ex) and torch.equal(y, ey)
        assert tokens == sum(int((y != IGNORE_INDEX).sum()) for _, y in expected)


def test_cuda_path_pins_and_copies_without_blocking(monkeypatch):
    data = Trainer(tiny_config(), ParallelMesh()).data
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    real_to = torch.Tensor.to

    def fake_to(self, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking))
        return real_to(self, "cpu")

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    batches = BatchPrefetcher(data, torch.device("cuda", 0), IGNORE_INDEX)
    batches.prefetch()
    monkeypatch.undo()
    assert calls.count("pin") == 2 * len(batches._ready[1])
    copies = [c for c in calls if c != "pin"]
    assert copies and all(c == ("to", "cuda:0", True) for c in copies)
    step = data.state_dict()
    got, _ = batches.next_step()
    assert got is batches._ready[1] and data.state_dict() != step
