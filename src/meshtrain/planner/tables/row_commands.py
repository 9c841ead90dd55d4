"""Each validation row as the ``meshtrain estimate`` command that prices it.

``python -m meshtrain.planner.tables.published --commands`` prints them: anyone can re-price a
row from the command line, change one setting and see what moves, or price a run of their own
the same way. The command names the row's model field by field (``--set model.*``), its
sequence length, batch and layout (``--set train.*``, ``--set parallel.*``), its GPU profile and
count, its stack, and every runtime trait the run set differently from that stack
(``--trait``, :mod:`meshtrain.planner.cost.trait_overrides`). The tests run every command and
check that it prices its row exactly as the validation table does.
"""

from __future__ import annotations

import dataclasses
import shlex

from meshtrain.config import ModelConfig
from meshtrain.config.loading import REQUIRED_WITHOUT_CONFIG
from meshtrain.planner.cost.trait_overrides import format_value, trait_arguments
from meshtrain.planner.cost.workload import STACKS
from meshtrain.planner.tables.runs_row import PublishedRow


def row_arguments(row: PublishedRow) -> list[str]:
    """The ``meshtrain estimate`` arguments (after ``estimate``) that price ``row``."""
    work, defaults = row.workload, ModelConfig()
    required = {key.split(".", 1)[1] for key in REQUIRED_WITHOUT_CONFIG if key.startswith("model.")}
    args = ["--hardware", row.profile, "--gpus", str(row.gpus), "--stack", row.stack]
    for field in dataclasses.fields(ModelConfig):
        value = getattr(work.model, field.name)
        if isinstance(value, dict):  # a table: one --set per key (model.rope_scaling.factor=8)
            args += [item for key, entry in value.items()
                     for item in ("--set", f"model.{field.name}.{key}={format_value(entry)}")]
        elif field.name in required or value != getattr(defaults, field.name):
            args += ["--set", f"model.{field.name}={format_value(value)}"]
    args += ["--set", f"train.seq_len={work.seq_len}",
             "--set", f"train.global_batch={work.global_batch}",
             "--set", f"train.precision={work.precision}"]
    for field in dataclasses.fields(row.layout):
        value = getattr(row.layout, field.name)
        if field.name == "pp_split" and not value:
            continue
        args += ["--set", f"parallel.{field.name}={format_value(value)}"]
    for text in trait_arguments(work.traits, STACKS[row.stack]):
        args += ["--trait", text]
    return args


def row_command(row: PublishedRow) -> str:
    """``row``'s command as one shell line."""
    return shlex.join(["meshtrain", "estimate", *row_arguments(row)])

