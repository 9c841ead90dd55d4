"""What communication hides behind compute, axis by axis, as each runtime schedules it.

Communication on one process group runs in issue order, one collective after another (one NCCL
stream per group; gloo's one worker thread on CPU). Two patterns hide it:

- **Bucketed reduction** (:func:`bucketed_exposed`): a backward pass produces gradients in
  ``pieces`` equal buckets; each bucket's reduction starts once its last gradient exists and the
  backward keeps running. Bucket ``k`` of ``n`` is ready at ``k/n`` of the window, so the queue
  finishes at ``max_k (k W/n + (n-k+1) C/n)``: what outlasts the window is
  ``max(C/n, C - W (n-1)/n)`` — the last bucket's reduction is always exposed.
- **Prefetch** (:func:`prefetched_exposed`): unit ``i + 1``'s parameters are gathered while
  unit ``i`` computes (ZeRO-3 / FSDP). The first unit's gather waits in full, each later one
  only for what exceeds the unit before it.

What overlaps where, per stack (:class:`~meshtrain.planner.cost.workload.RuntimeTraits`):

- **dp, meshtrain** (:mod:`meshtrain.parallel.data.engine`): ZeRO 0-1 accumulate locally and
  reduce bucket by bucket during the *last* micro-batch's backward only; ZeRO-2 reduce-scatters
  during *every* micro-batch's backward and waits at its end; ZeRO-3 (one bucket per unit,
  :mod:`meshtrain.parallel.data.zero3`) prefetches the next unit's gather in forward, and in
  backward gathers the previous unit while the current unit's gradients are reduce-scattered.
  The ZeRO 1-2 parameter all-gather after the update is exposed. With pipeline parallelism the
  first stage finishes last, so its reduction has only its own last backward to hide behind.
- **dp, torchtitan 2024** (FSDP2): ZeRO-3 with one unit per block, the same prefetch pattern.
- **dp, Megatron-LM 2021**: gradients all-reduced after backward, not overlapped.
- **tp, cp, ep**: blocking collectives between the kernels that need them in meshtrain
  (:mod:`meshtrain.parallel.tensor.collectives`, the cp K/V all-gather, the MoE all-to-alls),
  Megatron-LM 2021/2022, Megatron-DeepSpeed and torchtitan 2024: exposed. Megatron-Core 2024
  (Transformer Engine userbuffers) and torchtitan 2025 (async tensor parallelism) pipeline each
  tp collective with the GEMMs in ``tp`` steps, and Megatron-Core's ring context parallelism
  its K/V exchange with attention in ``cp`` steps (:func:`pipelined_exposed`).
- **pp**: each exchange is posted (``batch_isend_irecv``) and the receiver waits for it right
  before the compute that consumes it, so the transfer sits on the dependency chain between
  stages: exposed (what the sender computes meanwhile does not shorten the receiver's wait) —
  except under Megatron-Core's interleaved schedule with ``overlap_p2p_comm``, which posts them
  a chunk ahead: only what outlasts one chunk's compute is exposed.
- **dp, Megatron-Core 2024**: the distributed optimizer's reduce-scatter bucket by bucket
  behind the last micro-batch's backward, and its parameter all-gather behind the next step's
  forward (``overlap_param_gather``: prefetched, the first bucket exposed).

On a profile whose communication cannot run beside compute (CPUs: ``comm_overlaps_compute =
False``) nothing is hidden: the cores that would compute run gloo's reductions.

Hidden is not free on a GPU either: a collective that runs beside compute takes SMs (NCCL's
kernels) and memory bandwidth from the kernels it overlaps, so they run slower while it does.
:func:`contended` charges the step a fraction ``HardwareProfile.overlap_contention`` of every
hidden second; what each estimate reports as ``exposed_s`` includes that charge.
"""

from __future__ import annotations

OVERLAP_AXES = ("dp", "tp", "cp", "ep", "pp")
"""Axes of an estimate's ``overlap`` table."""


def bucketed_exposed(comm: float, window: float, pieces: int) -> float:
    """Seconds of ``comm`` (split in ``pieces`` equal reductions issued as each ``1/pieces`` of
    ``window`` compute finishes, run one after another) that outlast the window."""
    if comm <= 0:
        return 0.0
    n = max(pieces, 1)
    return max(comm / n, comm - window * (n - 1) / n)


def prefetched_exposed(comm: float, compute: float, pieces: int) -> float:
    """Seconds of ``comm`` (``pieces`` equal gathers, each prefetched during the previous
    unit's ``compute / pieces``; the first one has nothing before it) that compute waits for."""
    if comm <= 0:
        return 0.0
    n = max(pieces, 1)
    return comm / n + (n - 1) * max((comm - compute) / n, 0.0)


def zero3_exposed(gather: float, reduce: float, forward: float, backward: float,
                  units: int) -> float:
    """Exposed seconds of one micro-batch's ZeRO-3 traffic: ``gather`` (all units' all-gather,
    once forward and once backward) and ``reduce`` (their reduce-scatter). Forward prefetches
    the next unit; backward gathers the previous unit and reduce-scatters the current one
    behind each unit's backward, the first gather and the last reduce-scatter exposed."""
    n = max(units, 1)
    exposed_forward = prefetched_exposed(gather, forward, n)
    exposed_backward = (gather + reduce) / n + (n - 1) * max((gather + reduce - backward) / n,
                                                             0.0)
    return exposed_forward + exposed_backward


def pipelined_exposed(comm: float, compute: float, steps: int) -> float:
    """Seconds of ``comm`` left exposed when it runs as ``steps`` ring steps pipelined with
    ``compute`` (Transformer Engine's userbuffer tp overlap, async tensor parallelism, ring
    context parallelism): the first step waits in full, the others hide behind the compute up
    to its length."""
    if comm <= 0:
        return 0.0
    n = max(steps, 1)
    return comm / n + max(comm * (n - 1) / n - compute, 0.0)


def paired_exposed(each: float, slots: tuple[float, ...]) -> float:
    """Seconds left exposed of ``len(slots)`` collectives of ``each`` seconds when each runs
    beside one compute slot of another micro-batch and hides behind it up to the slot's length
    (an MoE block's four all-to-alls under Megatron-Core's expert-parallel overlap, which pairs
    one micro-batch's forward with another's backward as DeepSeek-V3's DualPipe does)."""
    return sum(max(each - slot, 0.0) for slot in slots)


def contended(exposed: float, comm: float, contention: float) -> float:
    """Seconds ``comm`` costs the step when ``exposed`` of it waits in the open and the rest runs
    beside compute, slowing it by ``contention`` of its own time (``HardwareProfile.
    overlap_contention``)."""
    return exposed + contention * max(comm - exposed, 0.0)


def overlap_entry(total: float, exposed: float) -> dict:
    """One axis of the ``overlap`` table: ``total_s``, ``overlapped_s``, ``exposed_s``."""
    exposed = min(max(exposed, 0.0), total)
    return {"total_s": total, "overlapped_s": total - exposed, "exposed_s": exposed}
