"""``meshtrain calibrate``: measure this machine into a hardware profile JSON.

Runs ``nproc`` local processes (:func:`meshtrain.host.local_processes.run_distributed`, gloo on CPU,
one intra-op thread each, as ``meshtrain verify`` and the tests run workers) and measures, on
rank 0's view:

- the rate of square fp32 GEMMs (best of a few sizes) with rank 0 computing alone
  (``solo_tflops``) and with every rank computing at once (``peak_tflops``, per process), in
  ``ROUNDS`` alternating rounds whose median is kept — on a shared machine a burst of load
  elsewhere then hits both alike; ``matmul_efficiency = fp32_rate = 1``;
- streaming memory bandwidth the same way: ``dst.copy_(src)`` into a preallocated buffer
  (read + write) of ``COPY_BYTES`` (main memory, not cache) — what the cost model's
  element-wise and optimizer passes move their bytes at;
- the fixed cost of one tiny eager op (dispatch, autograd-free): ``kernel_overhead_us``;
- fused causal attention (SDPA) forward and backward at a few head widths, relative to the solo
  GEMM rate (``attention_by_head_dim``);
- all-reduce, all-gather, reduce-scatter, all-to-all and send/recv time by message size, each
  call after a millisecond of compute on every rank (as in a training step; see
  :func:`_time_in_step`). Each
  collective's times are fitted to ``latency + bus_bytes / bandwidth`` (bus bytes as
  :func:`meshtrain.config.runtime_facts.bus_bytes` counts them, the nccl-tests convention the cost
  model uses). The all-reduce fit gives the profile's bandwidth and its per-step latency (the
  fitted latency divided by the ``2 ceil(log2 n)`` steps :meth:`Cluster.collective_time`
  charges), so the cost model reproduces the measured small-message time; send/recv gives the
  "inter-node" figures;
- one reference transformer block forward + backward, alone and with every rank busy, to which
  the GEMM efficiency and the concurrent rates are then fitted
  (:mod:`meshtrain.planner.calibrate.block`).

Since every process shares the machine's cores, the profile says ``comm_overlaps_compute =
False``: gloo's reductions and copies take the cores that compute. All processes share one
machine, so its "node" is the whole machine. :func:`quick_profile` is a few-second in-process
variant (compute measured, gloo figures built in) for ``parallel.auto``.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from pathlib import Path

from meshtrain.planner.calibrate.block import SMALL_BATCH, fit_to_block, reference_block_step
from meshtrain.planner.hardware.profile import HardwareProfile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
SHARED_MEMORY_ALL_REDUCE = "shared_memory_all_reduce"
"""meshtrain's shared-memory all-reduce (:mod:`meshtrain.parallel.shared_memory`), measured
beside gloo's when the processes can share memory."""
BUS_OP = {SHARED_MEMORY_ALL_REDUCE: "all_reduce"}
"""Measured operation -> the collective whose bus-byte formula it follows."""

QUICK_GLOO_GBPS = 1.0
"""Built-in all-reduce bus bandwidth of gloo over loopback for :func:`quick_profile`, GB/s: what
``meshtrain calibrate`` measured on a quiet 2-core development VM, rounded down."""
QUICK_GLOO_LATENCY_US = 100.0
"""Built-in per-step latency of a gloo collective on one machine, microseconds (as above)."""


def default_profile_path() -> Path:
    """Where ``meshtrain calibrate`` writes by default and ``parallel.auto`` looks first:
    ``$MESHTRAIN_PROFILE``, else ``$XDG_CACHE_HOME/meshtrain/profile.json`` (``~/.cache``)."""
    if os.environ.get("MESHTRAIN_PROFILE"):
        return Path(os.environ["MESHTRAIN_PROFILE"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "meshtrain" / "profile.json"


def _time_in_step(fn, repeats: int, compute) -> float:
    """Median seconds of ``fn`` when every rank runs ``compute`` (about a millisecond of
    GEMMs) before each call, as a training step's collectives sit between kernels. Back-to-back
    calls measure a warm, lock-stepped loop; between compute each call also pays the wake-up of
    a waiting process and the ranks' drift (on this VM ~2x the back-to-back time at 0.5 MB)."""
    fn()  # warm-up
    times = []
    for _ in range(max(repeats, 3)):
        compute()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_times(fns: list, window_s: float) -> list[float]:
    """Mean seconds per call of each of ``fns``, called in turn (``a b a b ...``) for at least
    ``window_s``: the machine's drift then hits all of them alike, so their *ratios* hold even
    when the absolute speed moves (after one warm-up call of each)."""
    for fn in fns:
        fn()
    totals, calls, start = [0.0] * len(fns), 0, time.perf_counter()
    while True:
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            totals[i] += time.perf_counter() - t
        calls += 1
        if time.perf_counter() - start >= window_s:
            break
    return [total / calls for total in totals]


def _median_time(fn, window_s: float, samples: int) -> float:
    """Median over ``samples`` windows of the mean seconds per call, each window calling ``fn``
    for at least ``window_s``: on a shared machine a short burst can land in a quiet or a busy
    moment, the median of longer windows is what a training step sees."""
    fn()  # warm-up
    times = []
    for _ in range(samples):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def _measure_compute(matmul_sizes: list[int], copy_bytes: list[int], window_s: float,
                     samples: int) -> dict:
    """GEMM rates, copy bandwidths and the tiny-op overhead of this process."""
    import torch

    out: dict = {"matmul": [], "copy": []}
    for n in matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = _median_time(lambda a=a, b=b: torch.mm(a, b), window_s, samples)
        out["matmul"].append({"n": n, "time_s": seconds, "tflops": 2 * n**3 / seconds / 1e12})
    for nbytes in copy_bytes:
        src, dst = torch.ones(max(nbytes // 4, 1)), torch.empty(max(nbytes // 4, 1))
        seconds = _median_time(lambda src=src, dst=dst: dst.copy_(src), window_s, samples)
        out["copy"].append({"bytes": src.numel() * 4, "gbps": 2 * src.numel() * 4 / seconds / 1e9})
    x, y = torch.ones(16), torch.ones(16)
    out["op_overhead_us"] = _median_time(lambda: torch.add(x, y), window_s / 4, samples) * 1e6
    return out


ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
"""Head widths at which calibrate times fused causal attention."""


def _measure_attention(window_s: float, samples: int) -> dict:
    """Fused causal attention (SDPA, fp32; batch 4, 8 heads, 128 positions) forward and
    forward + backward at each head width: forward TFLOP/s counting the causal half square
    (as the cost model does) and the backward / forward time ratio."""
    import torch
    import torch.nn.functional as F

    out = {}
    for d in ATTENTION_HEAD_DIMS:
        q, k, v = (torch.randn(4, 8, 128, d, requires_grad=True) for _ in range(3))

        def forward(q=q, k=k, v=v):
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        fwd = _median_time(forward, window_s, samples)
        total = _median_time(both, window_s, samples)
        out[str(d)] = {"tflops": 0.5 * 4 * 4 * 8 * 128 * 128 * d / fwd / 1e12,
                       "backward_ratio": max(total - fwd, 0.0) / fwd}
    return out


COPY_BYTES = 2**25
"""Copy size for the memory bandwidth: source and destination together exceed typical L3."""
ROUNDS = 5
"""Alternating solo / concurrent compute measurements; each figure is the median over rounds."""


def _median_of_rounds(rounds: list[dict]) -> dict:
    """Per GEMM size and copy size, the median rate over the rounds; the median op overhead."""
    first = rounds[0]
    return {
        "matmul": [{"n": row["n"], "tflops": statistics.median(
            r["matmul"][i]["tflops"] for r in rounds)} for i, row in enumerate(first["matmul"])],
        "copy": [{"bytes": row["bytes"], "gbps": statistics.median(
            r["copy"][i]["gbps"] for r in rounds)} for i, row in enumerate(first["copy"])],
        "op_overhead_us": statistics.median(r["op_overhead_us"] for r in rounds),
        "rounds": len(rounds),
    }


def _shared_memory_comm(world: int):
    """``(comm, reducer)`` for a shared-memory all-reduce over every process, or None when they
    cannot share memory (collective)."""
    import torch.distributed as dist

    from meshtrain.parallel.comm import CommLog, CountedComm
    from meshtrain.parallel.shared_memory import SharedMemoryReducer

    if world < 2:
        return None
    comm = CountedComm("dp", dist.new_group(list(range(world))), world, CommLog())
    reducer = SharedMemoryReducer.connect(comm)
    return None if reducer is None else (comm, reducer)


def _size_text(nbytes: int) -> str:
    """``4 KiB``, ``1 MiB``: a message size as the progress lines show it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def progress_steps(sizes: list[int]) -> int:
    """How many steps :func:`calibrate` reports: each compute round, attention, each size."""
    return ROUNDS + 1 + len(sizes)


def _report(show: bool, step: int, total: int, what: str) -> None:
    """One progress line on stderr (rank 0 of ``meshtrain calibrate``)."""
    if show:
        import sys

        print(f"meshtrain: calibrate [{step}/{total}] {what}", file=sys.stderr, flush=True)


def _measure_rank(sizes: list[int], matmul_sizes: list[int], repeats: int,
                  progress: bool = False) -> dict:
    """Worker body: every rank runs the same collectives; rank 0's timings are returned.
    With ``progress`` rank 0 writes one line per step on stderr (what it times, how far)."""
    import torch
    import torch.distributed as dist

    from meshtrain.config.runtime_facts import bus_bytes
    from meshtrain.parallel.comm import _all_gather_flat, _reduce_scatter_flat

    rank, world = dist.get_rank(), dist.get_world_size()
    total, step = progress_steps(sizes), 0
    show = progress and rank == 0
    gemms = ", ".join(str(n) for n in matmul_sizes)
    out: dict = {op: [] for op in COLLECTIVES}
    copy_bytes = [COPY_BYTES]
    solo, concurrent = [], []
    block, small_block = reference_block_step(), reference_block_step(SMALL_BATCH)
    block_solo, block_concurrent, small_solo = [], [], []
    for round_ in range(ROUNDS):  # alternate, so that a burst of load elsewhere hits both alike
        step += 1
        _report(show, step, total, f"round {round_ + 1}/{ROUNDS}: GEMMs ({gemms}), "
                f"{_size_text(COPY_BYTES)} copies, the reference block, alone and with every "
                f"process busy")
        if rank == 0:  # alone: the others wait at the barrier
            solo.append(_measure_compute(matmul_sizes, copy_bytes, 0.1 * repeats, 1))
            # the two sizes in turn: their ratio splits rate from per-kernel cost
            large_s, small_s = _interleaved_times([block, small_block], 0.2 * repeats)
            block_solo.append(large_s)
            small_solo.append(small_s)
        dist.barrier()
        concurrent.append(_measure_compute(matmul_sizes, copy_bytes, 0.1 * repeats, 1))
        dist.barrier()
        block_concurrent.append(_median_time(block, 0.1 * repeats, 1))
        dist.barrier()
    step += 1
    _report(show, step, total, "fused attention forward + backward at head widths "
            + ", ".join(str(d) for d in ATTENTION_HEAD_DIMS))
    if rank == 0:
        out["solo"] = _median_of_rounds(solo)
        out["attention"] = _measure_attention(0.05 * repeats, 3)
        out["block_s"] = {"solo": statistics.median(block_solo),
                          "concurrent": statistics.median(block_concurrent),
                          "small_solo": statistics.median(small_solo)}
    out["concurrent"] = _median_of_rounds(concurrent)
    dist.barrier()
    square = torch.randn(256, 256)

    def compute(square=square):
        for _ in range(25):  # ~1 ms at this VM's GEMM rate
            torch.mm(square, square)

    shared = _shared_memory_comm(world)
    for nbytes in sizes:
        elements = max(world, nbytes // 4 // world * world)
        full = torch.ones(elements)
        shard = torch.ones(elements // world)

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
        step += 1
        _report(show, step, total, f"collectives of {_size_text(elements * 4)}: "
                + ", ".join(op.replace("_", "-").replace("send", "send/recv") for op in ops)
                + (", shared-memory all-reduce" if shared is not None else ""))
        if shared is not None:  # what data-parallel gradients of fp32 buckets go through
            comm, reducer = shared
            buffer = reducer.new_buffer(comm, elements, torch.float32)
            ops[SHARED_MEMORY_ALL_REDUCE] = lambda comm=comm, buffer=buffer: comm.all_reduce(buffer)
            out.setdefault(SHARED_MEMORY_ALL_REDUCE, [])
        for op, fn in ops.items():
            dist.barrier()
            try:
                seconds = _time_in_step(fn, repeats * (4 if nbytes <= 2**16 else 2), compute)
            except RuntimeError as error:  # a backend without this collective
                out[op].append({"bytes": elements * 4, "error": str(error).splitlines()[0]})
                continue
            moved = bus_bytes(BUS_OP.get(op, op), elements * 4, world)
            out[op].append({"bytes": elements * 4, "bus_bytes": moved, "time_s": seconds,
                            "bus_gbps": moved / seconds / 1e9})
    return out if rank == 0 else {}


def fit_latency_bandwidth(rows: list[dict]) -> tuple[float, float]:
    """Least-squares fit of ``time = latency + bus_bytes / bandwidth`` over the measured sizes;
    (bandwidth GB/s, latency us). Falls back to the largest message's rate (and the smallest
    message's time as latency) when noise makes the fitted slope or intercept non-positive."""
    good = [r for r in rows if "time_s" in r]
    if not good:
        return 0.0, 0.0
    xs = [r["bus_bytes"] for r in good]
    ts = [r["time_s"] for r in good]
    n = len(good)
    mean_x, mean_t = sum(xs) / n, sum(ts) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True)) / var \
        if var > 0 else 0.0
    intercept = mean_t - slope * mean_x
    if slope <= 0 or intercept <= 0:
        largest = max(good, key=lambda r: r["bus_bytes"])
        return largest["bus_gbps"], min(ts) * 1e6
    return 1 / slope / 1e9, intercept * 1e6


def _memory_gb(nproc: int) -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / nproc


def _cpu_profile(name: str, solo: dict, concurrent: dict, all_reduce: tuple[float, float],
                 send: tuple[float, float], nproc: int, power_w: float, source: str,
                 measured: dict) -> HardwareProfile:
    """A CPU profile: measured fp32 GEMM rates as the peak, streaming copy as memory bandwidth,
    each per thread with ``nproc`` threads busy and alone (``solo_*``)."""
    bandwidth, latency = all_reduce
    shared_bw, shared_latency = fit_latency_bandwidth(measured.get(SHARED_MEMORY_ALL_REDUCE, []))
    steps = 2 * math.ceil(math.log2(max(nproc, 2)))
    send_bw, send_latency = send
    solo_gemm = max(r["tflops"] for r in solo["matmul"])
    attention = {d: [a["tflops"] / solo_gemm, a["backward_ratio"]]
                 for d, a in measured.get("attention", {}).items()}
    return HardwareProfile(
        name=name, peak_tflops=max(r["tflops"] for r in concurrent["matmul"]),
        attention_by_head_dim=attention or None,
        memory_gb=_memory_gb(nproc), hbm_gbps=concurrent["copy"][-1]["gbps"],
        solo_tflops=max(r["tflops"] for r in solo["matmul"]),
        solo_hbm_gbps=solo["copy"][-1]["gbps"], calibrated_processes=nproc,
        matmul_efficiency=1.0, kernel_overhead_us=solo["op_overhead_us"],
        intra_node_gbps=bandwidth, inter_node_gbps=send_bw or bandwidth,
        intra_node_latency_us=latency / steps, inter_node_latency_us=send_latency or latency,
        shared_memory_reduce_gbps=shared_bw, shared_memory_reduce_latency_us=shared_latency,
        power_w=power_w, reserved_gb=0.0, attention_efficiency=1.0, fp32_rate=1.0,
        comm_overlaps_compute=False, source=source, measured=measured)


def calibrate(nproc: int = 2, sizes: list[int] | None = None,
              matmul_sizes: list[int] | None = None, repeats: int = 3,
              name: str = "measured", power_w: float = 0.0,
              progress: bool = False) -> HardwareProfile:
    """Measure this machine with ``nproc`` processes and return the profile; with ``progress``,
    one line on stderr per step (``meshtrain: calibrate [3/10] ...``)."""
    from meshtrain.host.allocator import allocator_environment
    from meshtrain.host.local_processes import run_distributed

    sizes = sorted(sizes or [2**12, 2**16, 2**20, 2**24])
    matmul_sizes = matmul_sizes or [256, 512, 1024]
    with allocator_environment():  # the malloc settings `meshtrain train` gives its workers
        measured = run_distributed(nproc, _measure_rank, sizes, matmul_sizes, repeats,
                                   progress)[0]
    kernels = _cpu_profile(name, measured["solo"], measured["concurrent"],
                           fit_latency_bandwidth(measured["all_reduce"]),
                           fit_latency_bandwidth(measured["send"]), nproc, power_w,
                           f"meshtrain calibrate, {nproc} gloo processes on one machine "
                           f"({os.cpu_count()} cores), one thread each; fitted to a "
                           f"reference block", measured)
    block = measured["block_s"]
    return fit_to_block(kernels, block["solo"], block["concurrent"], block["small_solo"])


def quick_profile(nproc: int) -> HardwareProfile:
    """A second or two in this process, no workers spawned: GEMM rate, copy bandwidth and op
    overhead measured with one thread (``solo_*``) and with ``k = min(nproc, cores)`` intra-op
    threads (divided by ``k``: the per-thread share when ``k`` workers compute at once); gloo
    collectives at the built-in ``QUICK_GLOO_*`` figures."""
    import torch

    threads = torch.get_num_threads()
    busy = max(1, min(nproc, os.cpu_count() or 1))
    try:
        torch.set_num_threads(1)
        solo = _measure_compute([256, 512], [COPY_BYTES], 0.1, 3)
        attention = _measure_attention(0.02, 3)
        # k Python threads, each a single-threaded GEMM / copy (torch releases the GIL): the
        # share each of k one-thread workers gets.
        results: list[dict] = [{} for _ in range(busy)]

        def measure(i: int) -> None:
            results[i] = _measure_compute([512], [COPY_BYTES], 0.1, 3)

        pool = [threading.Thread(target=measure, args=(i,)) for i in range(busy)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        together = results[0]
    finally:
        torch.set_num_threads(threads)
    steps = 2 * math.ceil(math.log2(max(nproc, 2)))
    return _cpu_profile("quick-cpu", solo, together,
                        (QUICK_GLOO_GBPS, QUICK_GLOO_LATENCY_US * steps),
                        (QUICK_GLOO_GBPS, QUICK_GLOO_LATENCY_US), busy, 0.0,
                        f"quick in-process measurement on {os.cpu_count()} cores (GEMM, copy, op "
                        f"overhead); built-in gloo figures",
                        {"solo": solo, "concurrent": together, "attention": attention})
