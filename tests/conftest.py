"""Suite-wide settings: reuse spawned gloo workers across multi-process tests (see
meshtrain.distributed_run.WorkerPool); each test still gets fresh meshes and groups."""

import os

os.environ.setdefault("MESHTRAIN_REUSE_WORKERS", "1")

# Pipeline messages are matched as NCCL matches them (per pair, in order, no tags) and every
# send waits until its receive is posted (NCCL's rendezvous), so no test passes only because
# gloo matches tags and buffers sends (meshtrain.parallel.pipeline.p2p).
os.environ.setdefault("MESHTRAIN_P2P_SEMANTICS", "nccl-rendezvous")
