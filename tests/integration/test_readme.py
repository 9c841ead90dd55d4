"""``README.md`` runs: its ``sh`` blocks, as a user would type them.

Three kinds of block: a **synopsis** (``meshtrain train [--config FILE] ...``) must name only
options the command's ``--help`` lists; the **planning** block runs as written in the default
suite (its ``calibrate`` and ``parallel.auto`` lines, a minute of measuring and training, run in
the slow test), and what the README quotes from its output must appear in it; **every** command
block, ``make train`` included, runs as written in the slow test (``make bench``), from an empty
directory with this checkout's configs and tools (``make`` itself runs in the checkout, as its
Makefile expects, and trains the demo into that directory). ``make test`` is the suite itself and
is not run from inside it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_guide import _WRAPPERS, _install_tools, _user_env, guide_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV = ROOT / ".venv"
SLOW_LINES = ("meshtrain calibrate", "parallel.auto=true")


def readme_blocks() -> list[str]:
    """The README's ``sh`` blocks."""
    return [block for _, block in guide_blocks(README.read_text())]


def is_synopsis(block: str) -> bool:
    """A usage line (``[--option VALUE]`` in brackets) rather than a command to run."""
    return bool(re.search(r"\s\[--", block))


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _run(command: str, cwd: Path, env: dict[str, str], timeout: int = 600):
    return subprocess.run(["bash", "-e", "-c", command], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def test_readme_blocks_are_found():
    blocks = readme_blocks()
    assert sum(is_synopsis(b) for b in blocks) >= 2
    joined = "\n".join(blocks)
    for command in ("make train", "meshtrain verify", "meshtrain estimate", "meshtrain plan",
                    "meshtrain calibrate", "meshtrain simulate"):
        assert command in joined, command


@pytest.mark.parametrize("block", [b for b in readme_blocks() if is_synopsis(b)],
                         ids=lambda b: b.split()[1])
def test_synopsis_names_only_real_options(block, tmp_path):
    text = " ".join(commands(block))
    verb = text.split()[1]
    help_text = subprocess.run([sys.executable, "-m", "meshtrain", verb, "--help"],
                               text=True, capture_output=True, check=True).stdout
    options = set(re.findall(r"--[a-z][a-z-]*", text))
    assert options, block
    missing = sorted(option for option in options if option not in help_text)
    assert not missing, f"README's synopsis of `meshtrain {verb}` names {missing}, which " \
                        f"`meshtrain {verb} --help` does not list"


def test_planning_block_runs_and_says_what_the_readme_quotes(tmp_path):
    block = next(b for b in readme_blocks() if "meshtrain estimate" in b)
    bin_dir = tmp_path / "bin"
    _install_tools(bin_dir, _WRAPPERS)
    env = _user_env(bin_dir)
    outputs = {}
    for command in commands(block):
        if any(slow in command for slow in SLOW_LINES):
            continue
        run = _run(command, tmp_path, env)
        assert run.returncode == 0, f"{command}\n--- output ---\n{run.stdout}"
        outputs[command] = run.stdout
    assert (tmp_path / "timeline.png").stat().st_size > 0
    fits, refused = [out for command, out in outputs.items() if "estimate" in command]
    readme = README.read_text()
    quoted_fit = re.search(r"The first `estimate` fits \(([\d.]+) GB of the ([\d.]+) GB", readme)
    assert quoted_fit and f"peak {quoted_fit[1]} GB of {quoted_fit[2]} GB usable" in fits
    quoted = re.search(r"```\n(peak [^\n]*DOES NOT FIT)\n(why: [^\n]*)\n", readme)
    assert quoted, "README no longer quotes the refusal"
    assert quoted[1] in refused and quoted[2] in refused


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not (VENV / "bin" / "meshtrain").exists(), reason="needs `make setup`")
def test_every_block_runs_as_written(tmp_path):
    """Every command block in order (``make train`` and the calibration too), from an empty
    directory holding this checkout's configs; ``make`` runs in the checkout and trains the demo
    into the empty directory's ``runs/demo``."""
    bin_dir = tmp_path / "bin"
    # make runs in the checkout (its Makefile's paths are relative to it) and trains into here.
    _install_tools(bin_dir, {**_WRAPPERS,
                             "make": f'#!/bin/sh\nexec make -C "{ROOT}" '
                                     'DEMO_RUN_DIR="$PWD/runs/demo" "$@"\n'})
    env = _user_env(bin_dir)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # calibrate writes here, not in ~/.cache
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / ".venv").symlink_to(VENV)
    for block in readme_blocks():
        if is_synopsis(block):
            continue
        for command in commands(block):
            if command.startswith("make test"):
                continue
            run = _run(command, tmp_path, env, timeout=900)
            assert run.returncode == 0, f"{command}\n--- output ---\n{run.stdout}"
    assert (tmp_path / "runs" / "demo" / "final").is_dir()
    profile = tmp_path / "cache" / "meshtrain" / "profile.json"
    assert profile.is_file()
    assert os.path.getsize(profile) > 0
