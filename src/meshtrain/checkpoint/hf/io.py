"""Hugging Face interop: load / save Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE
checkpoints, convert weight directories.

Everything streams one tensor at a time: models are built on the meta device and materialised
empty, each tensor is read with ``safetensors.safe_open`` and copied into place, and files are
written by :class:`~meshtrain.checkpoint.safetensors_io.ShardedWriter`, which plans the layout
first and then writes each tensor at its offset. So a conversion never holds more than one tensor
(plus, for :func:`load_hf`, the model being filled).

Two directory formats are involved:

* a **Hugging Face** directory: ``config.json`` (``model_type`` llama / qwen2 / qwen3 / mixtral /
  qwen2_moe / qwen3_moe) and ``model.safetensors`` or shards with ``model.safetensors.index.json``;
* a **meshtrain weights** directory: meshtrain names and ``config.json`` holding the full run
  Config, with shards ``model-0000i-of-0000K.safetensors`` + ``model.safetensors.index.json``
  (what ``meshtrain train`` writes to ``RUN_DIR/final``) or one ``model.safetensors`` (what
  :func:`convert_from_hf` and older runs write). A directory with shards but no index is an
  interrupted save and is refused.

The converters write their ``--out`` crash-safely (:mod:`meshtrain.checkpoint.atomic`): the whole
new directory goes to ``OUT.tmp-<token>`` beside it, every file fsynced (``config.json`` and the
index each through a fsynced temporary file renamed into place), then it is swapped in for
``OUT``, so a crash leaves ``OUT`` as it was or complete. ``OUT`` must be new, empty or a model
directory: it is replaced as a whole. A run directory whose ``final/`` is missing because a save
was interrupted between its two renames is read from the complete previous set left aside.

Config mapping: :mod:`meshtrain.checkpoint.hf.config`; names and layouts:
:mod:`meshtrain.checkpoint.hf.tensors`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint import atomic
from meshtrain.checkpoint.hf.config import hf_model_type, hf_to_model_config, model_config_to_hf
from meshtrain.checkpoint.hf.moe_tensors import explain_extra, explain_missing, explain_shape
from meshtrain.checkpoint.hf.tensors import IGNORED_HF_SUFFIXES, from_hf, is_fused_moe, to_hf
from meshtrain.checkpoint.safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    ShardedWriter,
    TensorReader,
    complete_weights_dir,
    current_weights_dir,
    has_weights,
)
from meshtrain.config import Config, ConfigError, ModelConfig, config_from_dict
from meshtrain.model.init import canonical_name
from meshtrain.model.transformer import Transformer

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
HF_CONFIG_COPY = "hf_config.json"
"""Where ``convert --from-hf`` keeps the original Hugging Face config, for the way back."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: unreadable JSON ({error}).") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object.")
    return doc


def _classify(path: str | Path) -> tuple[str, Path, dict[str, Any]]:
    """``("hf" | "meshtrain", directory, config.json dict)`` for a weights directory or run dir.
    A ``final/`` missing because a save was interrupted between its two renames is read from the
    complete previous set it left aside (``current_weights_dir``)."""
    path = current_weights_dir(path)
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist or is not a directory.")
    for directory in (path, current_weights_dir(path / "final")):
        if not (directory / "config.json").is_file():
            continue
        doc = _read_json(directory / "config.json")
        if "model_type" in doc or "architectures" in doc:
            return "hf", directory, doc
        if isinstance(doc.get("model"), dict) and has_weights(directory):
            return "meshtrain", directory, doc  # (a run dir's own config.json has no weights)
    raise ConfigError(f"{path}: neither a Hugging Face model directory (config.json with "
                      f"model_type) nor a meshtrain weights directory ({INDEX_NAME} or "
                      f"{SINGLE_NAME}, + config.json of a run, or a run directory with final/).")


def _meta_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor name of the meshtrain state dict with a meta tensor of its shape/dtype."""
    with torch.device("meta"):
        return Transformer(config).state_dict()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``"float32"`` / ... -> torch dtype (ConfigError if not)."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype {name!r} is not a floating-point torch dtype; valid: float32, "
                          "bfloat16, float16.")
    return dtype


@dataclass
class _HFSource:
    """An open Hugging Face directory: its configs, a tensor reader and the expert layout."""

    directory: Path
    hf: dict[str, Any]
    config: ModelConfig
    reader: TensorReader
    fused: bool
    model_type: str

    @classmethod
    def open(cls, path: str | Path) -> _HFSource:
        kind, directory, doc = _classify(path)
        if kind != "hf":
            raise ConfigError(f"{directory} is a meshtrain weights directory, not a Hugging Face "
                              "one (use convert --to-hf to make one).")
        origin = str(directory / "config.json")
        config = hf_to_model_config(doc, origin)
        reader = TensorReader(directory)
        return cls(directory, doc, config, reader, is_fused_moe(reader.keys()),
                   hf_model_type(doc, origin))

    def _read(self, name: str, read) -> torch.Tensor:
        return from_hf(name, read, self.config, self.fused, self.model_type)

    def check(self, state: dict[str, torch.Tensor]) -> None:
        """Dry run on meta tensors: every tensor present with the right shape, none left over."""
        used: set[str] = set()

        def read_meta(key: str) -> torch.Tensor:
            if key not in self.reader:
                raise ConfigError(f"{self.directory}: tensor {key} is missing"
                                  f"{explain_missing(key, self.config)}.")
            used.add(key)
            return torch.empty(self.reader.shape(key), device="meta")

        for name, meta in state.items():
            shape = tuple(self._read(name, read_meta).shape)
            if shape != tuple(meta.shape):
                raise ConfigError(f"{self.directory}: {name} would have shape {shape}, but "
                                  f"config.json implies {tuple(meta.shape)}"
                                  f"{explain_shape(name, shape, self.config)}.")
        ignored = ("lm_head.weight",) if self.config.tie_embeddings else ()
        left = [key for key in self.reader.keys() if key not in used and key not in ignored
                and not key.endswith(IGNORED_HF_SUFFIXES)]
        if left:
            raise ConfigError(f"{self.directory}: {len(left)} tensors have no meshtrain "
                              f"counterpart, e.g. {left[:3]}{explain_extra(left, self.config)}.")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Checked, then ``(meshtrain name, tensor)`` one at a time (incl. zero expert_bias)."""
        state = _meta_state(self.config)
        self.check(state)
        for name in state:
            yield name, self._read(name, self.reader.get)


def load_hf(path: str | Path, device: str | torch.device = "cpu",
            dtype: torch.dtype | None = None) -> Transformer:
    """A meshtrain :class:`Transformer` holding the weights of Hugging Face directory ``path``.

    ``path`` holds a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM`` ``config.json`` and
    safetensors weights (single file or sharded). The model is built on the meta device,
    materialised empty on ``device`` in ``dtype`` (default float32, meshtrain's master-weight
    dtype) and filled one tensor at a time. Unsupported configs raise :class:`ConfigError`.
    """
    source = _HFSource.open(path)
    with source.reader:
        with torch.device("meta"):
            model = Transformer(source.config)
        model.to(dtype or torch.float32)
        model.to_empty(device=device)
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in source.tensors():
                targets[name].copy_(tensor)
    for module in model.modules():  # RoPE caches, MoE expert_bias (zeros, fp32)
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model


def _write_hf(named: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, out: Path,
              dtype: torch.dtype, max_shard_bytes: int | None, **hf_options: Any) -> Path:
    """Write a Hugging Face directory from meshtrain-named tensors arriving in any order."""
    hf = model_config_to_hf(config, _dtype_name(dtype), **hf_options)  # refuses first
    model_type = hf["model_type"]
    plan = [(hf_name, tuple(view.shape), dtype)
            for name, meta in _meta_state(config).items()
            for hf_name, view in to_hf(name, meta, config, model_type)]
    out.mkdir(parents=True, exist_ok=True)
    with ShardedWriter(out, plan, max_shard_bytes) as writer:
        for name, tensor in named:
            for hf_name, view in to_hf(canonical_name(name), tensor, config, model_type):
                writer.write(hf_name, view.to(dtype))
        writer.close()
    atomic.write_atomically(out / "config.json", json.dumps(hf, indent=2))
    return out


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def _is_model_dir(directory: Path) -> bool:
    """Whether ``directory`` looks like a model directory (complete or not): ``config.json`` or
    safetensors files at its top."""
    return (directory / "config.json").is_file() or any(directory.glob("*.safetensors*"))


@contextmanager
def _replacing(out: Path, sources: Iterable[Path | None]) -> Iterator[Path]:
    """A fresh directory beside ``out`` to write into; swapped in for ``out`` when the block
    ends (fsynced first), removed if it fails, so ``out`` is never left half-written. Refuses an
    ``out`` that holds a source, or that exists and is not an empty or model directory."""
    for source in sources:
        if source is not None and source.exists() and _inside(source, out):
            raise ConfigError(f"--out {out} is or holds the source directory {source}; choose "
                              "another (it is replaced as a whole).")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or _is_model_dir(out))):
        raise ConfigError(f"--out {out} exists and is not a model directory (no config.json or "
                          "*.safetensors); it would be replaced as a whole: choose a new or "
                          "empty directory.")
    atomic.cleanup(out, complete_weights_dir)  # an interrupted earlier conversion's leftovers
    staging = atomic.staging_dir(out)
    try:
        yield staging
        atomic.swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_hf(model: Transformer, path: str | Path, dtype: torch.dtype | None = None,
            max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write ``model`` (single-device, unsharded) as a Hugging Face Llama / Qwen2 / Qwen3 /
    Mixtral / Qwen2-MoE / Qwen3-MoE directory (see
    :func:`~meshtrain.checkpoint.hf.config.check_exportable`).

    Writes ``config.json`` and ``model.safetensors`` (or shards of at most ``max_shard_bytes``
    plus ``model.safetensors.index.json``), loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained``. ``dtype`` defaults to the model's.
    Models Hugging Face cannot represent (GELU, ungated shared experts, sigmoid routing, ...) raise
    :class:`ConfigError`.
    """
    if dtype is None:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return _write_hf(model.state_dict().items(), model.config, Path(path), dtype,
                     max_shard_bytes)


def weights_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face directory or a meshtrain weights/run directory."""
    kind, directory, doc = _classify(path)
    if kind == "hf":
        return hf_to_model_config(doc, str(directory / "config.json"))
    config = config_from_dict(doc, origin=str(directory / "config.json")).model
    if config.vocab_size <= 0:
        with TensorReader(directory) as reader:
            config.vocab_size = reader.shape("tok_embeddings.weight")[0]
    return config


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(meshtrain name, full CPU tensor)`` pairs, one at a time, from either directory kind.

    Tensors keep their stored dtype. A Hugging Face source is checked against its config before
    the first tensor is read and also yields each MoE layer's (zero) ``expert_bias``, so both
    kinds yield the full meshtrain state dict.
    """
    kind, directory, _ = _classify(path)
    if kind == "hf":
        source = _HFSource.open(directory)
        with source.reader:
            yield from source.tensors()
        return
    with TensorReader(directory) as reader:
        for name in reader.keys():
            yield name, reader.get(name)


def convert_from_hf(hf_dir: str | Path, out: str | Path,
                    dtype: torch.dtype | None = None) -> Path:
    """Hugging Face directory -> meshtrain weights directory (read wherever ``RUN_DIR/final`` is).

    Writes one ``model.safetensors`` (meshtrain names, ``dtype``, default float32 like a training
    run's final weights; MoE ``expert_bias`` fp32 zeros),
    ``config.json`` (a full run Config: defaults with the mapped model and ``data.tokenizer`` =
    the source's ``tokenizer.json`` if it has one, else ``bytes``) and ``hf_config.json`` (the
    original config, so that converting back restores the fields meshtrain does not track).
    """
    from meshtrain.validation.model import validate_model

    source = _HFSource.open(hf_dir)
    dtype = dtype or torch.float32
    out = Path(out)
    run_config = Config(model=source.config)
    tokenizer = source.directory / "tokenizer.json"
    run_config.data.tokenizer = str(tokenizer.resolve()) if tokenizer.is_file() else "bytes"
    validate_model(run_config, None)
    state = _meta_state(source.config)
    plan = [(name, tuple(meta.shape), meta.dtype if name.endswith("expert_bias") else dtype)
            for name, meta in state.items()]
    dtypes = {name: planned for name, _, planned in plan}
    source_dtype = source.reader.dtype("model.embed_tokens.weight")
    metadata = {"format": "pt", "source": "huggingface", "source_dtype": _dtype_name(source_dtype)}
    with _replacing(out, [Path(hf_dir), source.directory]) as staging:
        with source.reader, ShardedWriter(staging, plan, None, metadata=metadata) as writer:
            for name, tensor in source.tensors():
                writer.write(name, tensor.to(dtypes[name]))
            writer.close()
        atomic.write_atomically(staging / HF_CONFIG_COPY, json.dumps(source.hf, indent=2))
        atomic.write_atomically(staging / "config.json",
                                json.dumps(run_config.to_dict(), indent=2))
    return out


def _eos_id(tokenizer: str) -> int | None:
    from meshtrain.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(tokenizer).eos_id
    except (OSError, ValueError, ImportError):
        return None


def _open_weights_source(path: Path):
    """``(run Config, named tensor iterator, source dir or None, default dtype)`` of a source."""
    try:
        kind, directory, doc = _classify(path)
    except ConfigError as not_weights:
        from meshtrain.checkpoint.reader import read_checkpoint_tensors as reader

        if not path.is_dir():
            raise
        try:  # a distributed training checkpoint
            config, tensors = reader(path)
        except ConfigError:
            raise
        except (ValueError, OSError, KeyError) as error:
            raise ConfigError(f"{not_weights} Nor is it a readable training checkpoint "
                              f"({error}).") from None
        return config, tensors, None, torch.float32
    if kind == "hf":
        raise ConfigError(f"{directory} is already a Hugging Face directory (convert --to-hf "
                          "takes a meshtrain weights, run or checkpoint directory).")
    config = config_from_dict(doc, origin=str(directory / "config.json"))
    config.model = weights_config(directory)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with TensorReader(directory) as reader:
            for name in reader.keys():
                yield name, reader.get(name)

    with TensorReader(directory) as reader:
        recorded = reader.metadata().get("source_dtype")
    return config, tensors(), directory, parse_dtype(recorded) if recorded else torch.float32


def convert_to_hf(src: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                  max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """meshtrain weights directory (or run dir with ``final/``, or training checkpoint) -> HF.

    ``dtype`` defaults to the dtype the weights came from Hugging Face in (recorded by
    :func:`convert_from_hf`), else float32. The tokenizer files of a ``tokenizer.json`` run are
    copied along; ``hf_config.json`` of an imported model is the base of the written config.
    """
    src, out = Path(src), Path(out)
    config, tensors, directory, default_dtype = _open_weights_source(src)
    base = None
    if directory is not None and (directory / HF_CONFIG_COPY).is_file():
        base = _read_json(directory / HF_CONFIG_COPY)
    with _replacing(out, [src, directory]) as staging:
        try:
            _write_hf(tensors, config.model, staging, dtype or default_dtype, max_shard_bytes,
                      base=base, max_positions=config.train.seq_len,
                      eos_token_id=_eos_id(config.data.tokenizer))
        except ConfigError:
            raise
        except ValueError as error:  # a tensor that does not match the config
            raise ConfigError(f"{src}: the weights do not match their config ({error}).") \
                from None
        tokenizer = Path(config.data.tokenizer)
        if tokenizer.suffix == ".json" and tokenizer.is_file():
            for name in _TOKENIZER_FILES:
                if (tokenizer.parent / name).is_file():
                    atomic.write_atomically(staging / name, (tokenizer.parent / name).read_bytes())
    return out
