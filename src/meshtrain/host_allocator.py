"""glibc ``malloc`` settings for meshtrain's training processes, applied before they start.

PyTorch's CPU tensors come straight from ``malloc``. With glibc's defaults, every block of 128 KiB
or more, and every free block at the top of the heap, goes back to the kernel when it is freed, so
each training step takes thousands of fresh page faults as its activations and gradients are
allocated again (5–8k minor faults per step for the bench shape of issue 10). Two settings keep
that memory in the process instead:

``MALLOC_MMAP_THRESHOLD_ = 32 MiB``
    blocks up to 32 MiB (glibc's maximum) come from the heap, not from a fresh ``mmap`` each time;
    setting it also turns off glibc's *dynamic* threshold;
``MALLOC_TRIM_THRESHOLD_ = 2 GiB - 1``
    free memory at the top of the heap is not handed back between steps.

Measured on the 2-vCPU VM of ``docs/performance.md`` (two copies of the same meshtrain step, one
with and one without, each pinned to its own core so that both share the machine's drift): 200–430
instead of 4.5–7.9k faults per step, steps 0–35 % faster (median of six pairs 1.10×), the same
peak RSS. A training step's allocations repeat exactly, so memory kept from one step is what the
next one needs.

glibc reads these variables once, when the process starts, so they must be in the environment
before it does: ``mallopt`` from inside a running process did not stop the faults (tried and
reverted, see ``docs/performance.md``). So :func:`reexec_with_allocator_env` restarts a one-process
``meshtrain train`` (and every rank of a torchrun/SLURM job) with them, before torch is imported,
and the local launcher passes them on to the workers it spawns.

A user's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` win over these.
``MESHTRAIN_HOST_ALLOCATOR=default`` keeps glibc's defaults. Nothing is set off Linux or on a C
library other than glibc (the variables mean nothing there).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

from meshtrain.config import ConfigError

ALLOCATOR_ENV: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
}
"""The glibc ``malloc`` variables meshtrain sets for its training processes (see the module doc)."""

OPT_OUT_ENV = "MESHTRAIN_HOST_ALLOCATOR"
"""Set to ``default`` to keep glibc's own ``malloc`` settings."""

REEXEC_MARK_ENV = "MESHTRAIN_ALLOCATOR_REEXEC"
"""Set in the environment of a re-executed process, so it never re-executes twice."""


def uses_glibc() -> bool:
    """Whether this process runs on Linux with glibc (whose ``malloc`` reads the variables)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def allocator_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`ALLOCATOR_ENV` that ``environ`` (default: ``os.environ``) lacks.

    Empty when the user opted out (``MESHTRAIN_HOST_ALLOCATOR=default``), off glibc, or when every
    variable is already set (a user's own value is never replaced).
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(OPT_OUT_ENV, "tuned").strip().lower()
    if choice not in ("tuned", "default"):
        raise ConfigError(f'{OPT_OUT_ENV} = "{environ[OPT_OUT_ENV]}" is not a choice; valid: '
                         '"tuned" (meshtrain\'s malloc settings, the default) or "default" '
                         "(glibc's own).")
    if choice == "default" or not uses_glibc():
        return {}
    return {key: value for key, value in ALLOCATOR_ENV.items() if key not in environ}


@contextmanager
def allocator_environment() -> Iterator[dict[str, str]]:
    """Put :func:`allocator_env` into ``os.environ`` for processes started inside the block.

    Yields what was added; removes it again on exit (the current process is not affected: glibc
    read its settings when it started).
    """
    added = allocator_env()
    os.environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            os.environ.pop(key, None)


def reexec_with_allocator_env() -> None:
    """Replace this process with itself under :data:`ALLOCATOR_ENV`, if any variable is missing.

    Re-runs the interpreter with the same command line (``sys.orig_argv``: interpreter options,
    ``-m``/``-c``/script and arguments) and the same process id, so torchrun's and SLURM's
    bookkeeping are unaffected. Call it before importing torch: only the interpreter start-up
    (~50 ms) is repeated. Returns without doing anything when nothing is missing, after one
    re-exec already, or when the original command line is not known.
    """
    added = allocator_env()
    argv = getattr(sys, "orig_argv", None)
    if not added or os.environ.get(REEXEC_MARK_ENV) == "1" or not argv or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]],
              {**os.environ, **added, REEXEC_MARK_ENV: "1"})
