"""One published figure of a training run and how the cost model prices it.

Every row is marked **train** (a constant of the cost model was fitted on it: ``fits`` names
which) or **test** (nothing was fitted on it; it measures accuracy). Fitting routines
(:mod:`meshtrain.planner.tables.fitting`) refuse any row not marked train.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.workload import STACKS, RuntimeTraits, Workload

SPLITS = ("train", "test")
"""A row's ``split``: fitted on, or only checked against."""

METRICS = ("hardware_tflops_per_gpu", "model_tflops_per_gpu", "step_time_s", "tokens_per_s",
           "memory_gb_per_gpu")
"""The estimate keys a row can compare."""


@dataclasses.dataclass(frozen=True)
class PublishedRow:
    """One published figure and how to price it."""

    name: str
    source: str
    split: str
    """``train`` (a constant was fitted on it) or ``test`` (accuracy only)."""
    metric: str
    """The estimate's key compared, one of :data:`METRICS`."""
    published: float
    workload: Workload
    layout: Layout
    profile: str
    stack: str
    """The :data:`~meshtrain.planner.cost.workload.STACKS` name the row is priced with (its
    traits may differ from the preset in what the run configured: the gradient dtype)."""
    fits: str = ""
    """For a train row, the fitted constant it feeds (a :func:`meshtrain.planner.tables.
    fitting.fit_groups` key); "" for test rows."""
    note: str = ""
    """What the source does not state and how it was priced instead."""

    def __post_init__(self):
        if self.split not in SPLITS or self.metric not in METRICS:
            raise ValueError(f"{self.name}: split {self.split!r} / metric {self.metric!r}")
        if (self.split == "train") != bool(self.fits):
            raise ValueError(f"{self.name}: a train row names what it fits, a test row nothing")

    @property
    def gpus(self) -> int:
        """GPUs of the run."""
        return self.layout.world_size


def row(name: str, source: str, split: str, metric: str, published: float, model: ModelConfig,
        seq_len: int, global_batch: int, layout: Layout, profile: str, stack: str,
        fits: str = "", note: str = "", traits: RuntimeTraits | None = None) -> PublishedRow:
    """A :class:`PublishedRow` of a bf16 run of ``model`` priced with ``stack`` (``traits``:
    that stack as the run configured it)."""
    workload = Workload(model, seq_len, global_batch, "bf16", traits or STACKS[stack])
    return PublishedRow(name, source, split, metric, published, workload, layout, profile,
                        stack, fits, note)


def megatron_layout(gpus: int, tp: int, pp: int, cp: int, chunks: int, global_batch: int,
                    micro: int, checkpointing: str = "none") -> Layout:
    """A Megatron-Core run's layout as NeMo's and Megatron-Bridge's tables state one: the
    distributed optimizer (ZeRO-1), sequence parallelism wherever tp > 1, interleaved 1F1B with
    ``chunks`` virtual stages (plain 1F1B with one), ``micro`` sequences a micro-batch."""
    dp = gpus // (tp * pp * cp)
    return Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=1, sequence_parallel=tp > 1,
                  pp_schedule="interleaved-1f1b" if chunks > 1 else "1f1b",
                  virtual_stages=chunks, microbatches=global_batch // (dp * micro),
                  activation_checkpointing=checkpointing)


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, **extra) -> ModelConfig:
    """A GPT-style model (GELU MLP of 4 × hidden, multi-head attention)."""
    return ModelConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads,
                       ffn_dim=4 * hidden, mlp="gelu", **extra)


LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_dim=14336, mlp="swiglu", rope_theta=500000.0)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         ffn_dim=28672, mlp="swiglu", rope_theta=500000.0)
LLAMA2_13B = ModelConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824,
                         mlp="swiglu")
LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         ffn_dim=28672, mlp="swiglu")
