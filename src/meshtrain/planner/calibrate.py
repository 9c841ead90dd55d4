"""``meshtrain calibrate``: measure this machine into a hardware profile JSON.

Runs ``nproc`` local processes (:func:`meshtrain.distributed_run.run_distributed`, gloo on CPU)
and measures, on rank 0's view:

- the matmul rate of square fp32 GEMMs (best of a few sizes) and a memory-copy bandwidth;
- all-reduce, all-gather, reduce-scatter, all-to-all and send/recv time by message size, turned
  into *bus* bandwidth with :func:`meshtrain.parallel.comm.bus_bytes` (the nccl-tests convention
  the cost model uses), the largest message giving the bandwidth and the smallest the latency.

The result is a :class:`~meshtrain.planner.hardware.HardwareProfile` whose ``peak_tflops`` is the
*measured* GEMM rate (so ``matmul_efficiency`` is 1), usable as ``--hardware profile.json``. Since
all processes share one machine, intra- and inter-node figures are the same measurement.
"""

from __future__ import annotations

import os
import time

from meshtrain.planner.hardware import HardwareProfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _measure_rank(sizes: list[int], matmul_sizes: list[int], repeats: int) -> dict:
    """Worker body: every rank runs the same collectives; rank 0's timings are returned."""
    import torch
    import torch.distributed as dist

    from meshtrain.parallel.comm import _all_gather_flat, _reduce_scatter_flat, bus_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"matmul": [], "copy": [], **{op: [] for op in COLLECTIVES}}
    for n in matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = _time(lambda a=a, b=b: torch.mm(a, b), repeats)
        out["matmul"].append({"n": n, "time_s": seconds, "tflops": 2 * n**3 / seconds / 1e12})
    for nbytes in sizes:
        elements = max(world, nbytes // 4 // world * world)
        full = torch.ones(elements)
        shard = torch.ones(elements // world)
        copy_s = _time(lambda full=full: full.clone(), repeats)
        out["copy"].append({"bytes": elements * 4, "gbps": 2 * elements * 4 / copy_s / 1e9})

        def send(full=full):
            if rank == 0:
                dist.send(full, 1)
            elif rank == 1:
                dist.recv(full, 0)

        ops = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, shard=shard: _all_gather_flat(full, shard),
            "reduce_scatter": lambda full=full, shard=shard: _reduce_scatter_flat(shard, full),
            "all_to_all": lambda full=full: dist.all_to_all_single(torch.empty_like(full), full),
            "send": send,
        }
        for op, fn in ops.items():
            dist.barrier()
            try:
                seconds = _time(fn, repeats)
            except RuntimeError as error:  # a backend without this collective
                out[op].append({"bytes": elements * 4, "error": str(error).splitlines()[0]})
                continue
            moved = bus_bytes("send" if op == "send" else op, elements * 4, world)
            out[op].append({"bytes": elements * 4, "time_s": seconds,
                            "bus_gbps": moved / seconds / 1e9})
    return out if rank == 0 else {}


def _bandwidth_and_latency(rows: list[dict]) -> tuple[float, float]:
    good = [r for r in rows if "time_s" in r]
    if not good:
        return 0.0, 0.0
    return max(r["bus_gbps"] for r in good), min(r["time_s"] for r in good) * 1e6


def calibrate(nproc: int = 2, sizes: list[int] | None = None,
              matmul_sizes: list[int] | None = None, repeats: int = 3,
              name: str = "measured", power_w: float = 0.0) -> HardwareProfile:
    """Measure this machine with ``nproc`` processes and return the profile."""
    from meshtrain.distributed_run import run_distributed

    sizes = sizes or [2**12, 2**16, 2**20, 2**24]
    matmul_sizes = matmul_sizes or [256, 512, 1024]
    measured = run_distributed(nproc, _measure_rank, sizes, matmul_sizes, repeats)[0]
    peak = max(r["tflops"] for r in measured["matmul"])
    all_reduce_bw, latency = _bandwidth_and_latency(measured["all_reduce"])
    send_bw, send_latency = _bandwidth_and_latency(measured["send"])
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / nproc
    return HardwareProfile(
        name=name, peak_tflops=peak, memory_gb=memory_gb,
        hbm_gbps=max(r["gbps"] for r in measured["copy"]), matmul_efficiency=1.0,
        kernel_overhead_us=1.0, intra_node_gbps=all_reduce_bw, inter_node_gbps=send_bw or
        all_reduce_bw, intra_node_latency_us=latency, inter_node_latency_us=send_latency or
        latency, power_w=power_w, reserved_gb=0.0, attention_efficiency=1.0,
        source=f"meshtrain calibrate, {nproc} gloo processes on one machine",
        measured=measured)
