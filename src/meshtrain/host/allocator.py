"""glibc ``malloc`` settings for meshtrain's training processes, applied before they start.

PyTorch's CPU tensors come straight from ``malloc``. With glibc's defaults, every block of 128 KiB
or more, and every free block at the top of the heap, goes back to the kernel when it is freed, so
each training step takes thousands of fresh page faults as its activations and gradients are
allocated again (5–8k minor faults per step for the bench shape,
``meshtrain.commands.bench.base.BENCH_DEFAULTS``). Two settings keep that memory in the process
instead:

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
library other than glibc (the variables mean nothing there), and nothing for a job that trains on
a GPU (``train.device = "cuda"``, or ``"auto"`` with an NVIDIA GPU visible): its activations and
gradients live in CUDA's caching allocator, not in ``malloc``, and the settings were measured on
CPU training only. That decision is taken before torch is imported, so it looks for the GPU
cheaply (:func:`gpu_visible`: an NVIDIA device node that ``CUDA_VISIBLE_DEVICES`` does not hide).
"""

from __future__ import annotations

import glob
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

ZERO3_MMAP_THRESHOLD = str(1024 * 1024)
"""``MALLOC_MMAP_THRESHOLD_`` for a ZeRO-3 job (``parallel.zero = 3``): blocks of 1 MiB and more
are mapped, each handed back to the kernel when freed. Memory is what such a job is for: with
the 32 MiB threshold the heap keeps (fragmented) the bucket-sized temporaries of activations,
gradients and optimizer steps, and a dp 8 ZeRO-3 worker at ~85M parameters peaked 276-325 MiB
above a tiny model's run instead of 244-264, at 1.06-1.20x the step time with 1 MiB
(docs/parallelism.md, "Peak memory measured from outside")."""

OPT_OUT_ENV = "MESHTRAIN_HOST_ALLOCATOR"
"""Set to ``default`` to keep glibc's own ``malloc`` settings."""

REEXEC_MARK_ENV = "MESHTRAIN_ALLOCATOR_REEXEC"
"""Set in the environment of a re-executed process, so it never re-executes twice."""


def uses_glibc() -> bool:
    """Whether this process runs on Linux with glibc (whose ``malloc`` reads the variables)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def gpu_visible(environ: MutableMapping[str, str] | None = None, dev_dir: str = "/dev") -> bool:
    """Whether a CUDA GPU looks visible to this process, without importing torch: an NVIDIA
    device node (``/dev/nvidia0``, ...) exists and ``CUDA_VISIBLE_DEVICES`` (of ``environ``,
    default ``os.environ``) is not set to hide every device: CUDA counts devices up to the first
    entry that is neither an index >= 0 nor a ``GPU-``/``MIG-`` UUID, so an empty value, ``-1``
    or SLURM's ``NoDevFiles`` hide them all."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):
            return False
    return bool(glob.glob(os.path.join(dev_dir, "nvidia[0-9]*")))


def job_uses_gpu(device: str, environ: MutableMapping[str, str] | None = None,
                 dev_dir: str = "/dev") -> bool:
    """Whether a job whose ``train.device`` is ``device`` trains on a GPU: ``"cuda"`` does,
    ``"cpu"`` does not, ``"auto"`` does when :func:`gpu_visible`."""
    device = device.strip().lower()
    if device.startswith("cuda"):
        return True
    if device == "cpu":
        return False
    return gpu_visible(environ, dev_dir)


def allocator_env(environ: MutableMapping[str, str] | None = None,
                  device: str = "cpu", zero: int = 0) -> dict[str, str]:
    """The variables of :data:`ALLOCATOR_ENV` that ``environ`` (default: ``os.environ``) lacks,
    for processes training on ``device`` (a ``train.device`` value) under ZeRO stage ``zero``
    (``parallel.zero``; stage 3 maps blocks from 1 MiB, :data:`ZERO3_MMAP_THRESHOLD`).

    Empty when the user opted out (``MESHTRAIN_HOST_ALLOCATOR=default``), off glibc, for a job on
    a GPU (:func:`job_uses_gpu`), or when every variable is already set (a user's own value is
    never replaced).
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(OPT_OUT_ENV, "tuned").strip().lower()
    if choice not in ("tuned", "default"):
        raise ConfigError(f'{OPT_OUT_ENV} = "{environ[OPT_OUT_ENV]}" is not a choice; valid: '
                         '"tuned" (meshtrain\'s malloc settings, the default) or "default" '
                         "(glibc's own).")
    if choice == "default" or not uses_glibc() or job_uses_gpu(device, environ):
        return {}
    wanted = dict(ALLOCATOR_ENV)
    if zero >= 3:
        wanted["MALLOC_MMAP_THRESHOLD_"] = ZERO3_MMAP_THRESHOLD
    return {key: value for key, value in wanted.items() if key not in environ}


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


@contextmanager
def glibc_default_environment() -> Iterator[None]:
    """Processes started inside the block get glibc's own ``malloc`` settings: the variables
    of :data:`ALLOCATOR_ENV` are taken out of ``os.environ`` (whoever set them) and put back on
    exit."""
    saved = {key: os.environ.pop(key) for key in ALLOCATOR_ENV if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def reexec_with_allocator_env(device: str = "auto", zero: int = 0) -> None:
    """Replace this process with itself under :data:`ALLOCATOR_ENV`, if any variable is missing.

    ``device`` is the job's ``train.device``: a job on a GPU is never re-executed
    (:func:`allocator_env` is empty for it); ``zero`` its ``parallel.zero``. Re-runs the
    interpreter with the same command line (``sys.orig_argv``: interpreter options,
    ``-m``/``-c``/script and arguments) and the same process id, so torchrun's and SLURM's
    bookkeeping are unaffected. Call it before importing torch: only the interpreter start-up
    (~50 ms) is repeated. Returns without doing anything
    when nothing is missing, after one re-exec already, or when the original command line is not
    known.
    """
    added = allocator_env(device=device, zero=zero)
    argv = getattr(sys, "orig_argv", None)
    if not added or os.environ.get(REEXEC_MARK_ENV) == "1" or not argv or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]],
              {**os.environ, **added, REEXEC_MARK_ENV: "1"})
