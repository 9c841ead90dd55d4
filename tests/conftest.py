"""Suite-wide settings: reuse spawned gloo workers across multi-process tests (see
tests/distributed.py's WorkerPool), for the tests' own ranks and for meshtrain commands the tests
call in this process; each test still gets fresh meshes and groups."""

import os
import tempfile
from types import SimpleNamespace

import pytest

from tests.distributed import REUSE_ENV, use_pool_for_meshtrain_commands

os.environ.setdefault(REUSE_ENV, "1")
use_pool_for_meshtrain_commands()

# Pipeline messages are matched as NCCL matches them (per pair, in order, no tags) and every
# send waits until its receive is posted (NCCL's rendezvous), so no test passes only because
# gloo matches tags and buffers sends (meshtrain.parallel.pipeline.p2p).
os.environ.setdefault("MESHTRAIN_P2P_SEMANTICS", "nccl-rendezvous")

# Raw text sources are tokenized into an on-disk cache (meshtrain.data.sources); the suite's go to
# a directory of its own, never the user's ~/.cache.
os.environ.setdefault("MESHTRAIN_DATA_CACHE", tempfile.mkdtemp(prefix="meshtrain-test-cache-"))


@pytest.fixture
def meshtrain(capsys):
    """Run ``meshtrain ARGS...`` in this process; returns its exit status and captured output
    (``returncode``, ``stdout``, ``stderr``)."""
    from meshtrain.cli import main

    def run(*args: str) -> SimpleNamespace:
        code = main(list(args))
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run
