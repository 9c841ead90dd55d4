"""What every benchmark process runs: a timed step loop, and the meshtrain side of every suite.

Workers are module-level functions ``worker(config_dict, warmup, steps) -> dict`` started on each
rank by :func:`meshtrain.host.local_processes.run_distributed` (the process group already exists,
one intra-op thread). Each returns the dict of :func:`timed_run`:

``step_times``       wall seconds of each *measured* step (the ``warmup`` first ones dropped)
``step_cpu_times``   CPU seconds this process used in each measured step (all its threads): less
                     sensitive than wall time to other programs sharing the cores
``losses``           the loss of every step, warm-up included (same data: both sides should agree)
``tokens_per_step``  tokens of the global batch (all ranks) per optimizer step
``base_bytes``       peak RSS before the model was built (imports and the token stream loaded)
``peak_bytes``       peak RSS at the end (``meshtrain.training.metrics.peak_memory_bytes``)
``threads``          ``torch.get_num_threads()`` while the steps ran
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.config import Config, config_from_dict
from meshtrain.training.metrics import peak_memory_bytes


def load_bench_config(config_dict: dict) -> Config:
    """The :class:`Config` the runner validated, rebuilt in a worker."""
    return config_from_dict(config_dict, origin="bench")


def preload_tokens(config: Config) -> None:
    """Tokenize the corpus now (cached in-process), so it counts in ``base_bytes`` on both sides."""
    from meshtrain.data.sources import load_token_stream
    from meshtrain.data.tokenizer import load_tokenizer

    load_token_stream(config.data, load_tokenizer(config.data.tokenizer))


def barrier() -> None:
    """Line the ranks up (no-op for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


CPU = torch.device("cpu")


def timed_run(step: Callable[[int], float], warmup: int, steps: int, tokens_per_step: int,
              base_bytes: int, device: torch.device = CPU) -> dict:
    """Run ``step(i)`` (returns the loss) ``warmup + steps`` times; time each step. On a CUDA
    ``device`` each step's time runs to the end of its last kernel (synchronized), and
    ``peak_bytes`` is the CUDA allocator's peak."""
    times, cpu_times, losses = [], [], []
    barrier()
    for i in range(warmup + steps):
        synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(float(step(i)))
        synchronize(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
    return {"step_times": times[warmup:], "step_cpu_times": cpu_times[warmup:], "losses": losses,
            "tokens_per_step": tokens_per_step, "base_bytes": base_bytes,
            "peak_bytes": peak_memory_bytes(device), "threads": torch.get_num_threads()}


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_device(config: Config) -> torch.device:
    """The device a suite's sides train on (``train.device``, checked by ``bench_config``)."""
    return torch.device(config.train.device)


def meshtrain_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The meshtrain side of every suite: ``Trainer(config, mesh).train_step()`` in a loop.

    The layout is whatever the suite's ``configure`` put in ``config.parallel``.
    """
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = load_bench_config(config_dict)
    mesh = build_mesh(config)
    preload_tokens(config)
    base = peak_memory_bytes(mesh.device)
    trainer = Trainer(config, mesh)
    tokens = config.train.global_batch * config.train.seq_len
    return timed_run(lambda i: trainer.train_step()["loss"], warmup, steps, tokens, base,
                     mesh.device)
