"""Suite-wide settings: reuse spawned gloo workers across multi-process tests (see
meshtrain.distributed_run.WorkerPool); each test still gets fresh meshes and groups."""

import os

os.environ.setdefault("MESHTRAIN_REUSE_WORKERS", "1")
