"""The cost-model commands and every ``--help`` answer without importing torch (about 1.5 s of
start-up): ``estimate`` and ``plan`` are arithmetic on the config and the hardware profile."""

import subprocess
import sys

import pytest

PROBE = """
import sys
from meshtrain.cli import main
try:
    status = main({argv!r})
except SystemExit as leaving:  # --help
    status = leaving.code or 0
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH-MODULES", len(loaded), loaded[:3])
sys.exit(status)
"""

COMMANDS = {
    "help": ["--help"],
    "train-help": ["train", "--help"],
    "estimate-preset": ["estimate", "--model", "llama3-8b", "--hardware", "h100-80g",
                        "--set", "parallel.tp=2", "--set", "parallel.dp=4"],
    "estimate-moe-pipeline": ["estimate", "--config", "configs/4d_moe.toml",
                              "--hardware", "a100-80g"],
    "estimate-3d-json": ["estimate", "--config", "configs/3d_dp2_tp2_pp2.toml",
                         "--hardware", "h100-80g", "--json"],
    "plan": ["plan", "--model", "llama3-8b", "--hardware", "h100-80g", "--gpus", "16",
             "--top", "3"],
    "simulate": ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
}


@pytest.mark.parametrize("argv", COMMANDS.values(), ids=COMMANDS.keys())
def test_command_runs_without_importing_torch(argv):
    result = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)],
                            capture_output=True, text=True, timeout=120)
    line = [s for s in result.stdout.splitlines() if s.startswith("TORCH-MODULES")]
    assert result.returncode == 0, result.stderr[-2000:]
    assert line, (result.stdout[-2000:], result.stderr[-2000:])
    assert line[0].startswith("TORCH-MODULES 0 "), line[0]
