"""``meshtrain train --dry-run --world N --rank R``: one rank's real runtime objects, no compute.

Builds rank R of an N-rank layout through the code a real run uses — :func:`meshtrain.run.worker.
build_mesh`, :func:`meshtrain.parallel.parallelize` (tensor/expert/pipeline splits, ZeRO flat
buckets), the pipeline executor and :class:`~meshtrain.training.optimizer.FlatAdamW` — but on the
**meta device** over torch's **fake process group**: every tensor has a shape and a dtype and no
storage, no collective moves anything, no data is read. So a 70B model on 64 ranks takes seconds
and a few hundred MB of host memory.

Bytes are read off the built objects (``numel × element_size`` of the engine's flat buffers and
shards and of the optimizer's moments and masters, the same :meth:`Trainer._memory` fields a real
run writes to ``metrics.jsonl``), never from the planner's formulas, so the planner's estimate
(:func:`meshtrain.planner.cost.memory.rank_memory`) printed beside them is a cross-check.

Collectives of one step are *measured*: one training step (forward, backward, gradient
reduction, clipping, AdamW, through :meth:`Trainer.compute_gradients`) runs on the meta tensors,
and every collective it issues is recorded by the counted comms (:mod:`meshtrain.parallel.comm`,
bus bytes per rank). Where a step cannot run on meta tensors (MoE routing reads token counts),
they are *derived* from the engine's buckets and the pipeline schedule instead (dp/edp and pp
axes only); the output says which.

Dry-run switches in the runtime: ``build_mesh(config, dry_run=(rank, world))`` (meta device,
fake process group via ``init_distributed(..., dry_run=...)``), and ``_materialize`` skips the
name-seeded init on the meta device. Here: shared-memory gradient reduction and ``train.compile``
are off (neither changes a byte), pipeline messages use tagged semantics (no store rendezvous),
and the trainer's global token count skips reading its all-reduced value.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time

import torch

from meshtrain.config import Config, ConfigError

GB = 1e9


@dataclasses.dataclass
class DryRank:
    """What :func:`build_rank` built: the trainer shell (mesh, model, engine, optimizer,
    pipeline executor) of one rank, all on the meta device."""

    trainer: object
    world: int
    rank: int


def check_args(args) -> None:
    """Refuse bad ``--dry-run`` / ``--world`` / ``--rank`` combinations (ConfigError, exit 2)."""
    if not args.dry_run:
        raise ConfigError("--world and --rank only apply with --dry-run.")
    if args.world is None:
        raise ConfigError("--dry-run needs --world N: the number of ranks to lay out.")
    if args.world < 1:
        raise ConfigError(f"--world {args.world} must be at least 1.")
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < args.world:
        raise ConfigError(f"--rank {rank} is outside a world of {args.world} ranks (valid: 0 to "
                          f"{args.world - 1}).")
    if args.nproc is not None and args.nproc != args.world:
        raise ConfigError(f"--nproc {args.nproc} and --world {args.world} disagree; a dry run "
                          f"lays out --world ranks (drop --nproc).")
    args.rank, args.nproc = rank, args.world


def build_rank(config: Config, world: int, rank: int) -> DryRank:
    """Rank ``rank``'s trainer objects for a validated ``config`` of ``world`` ranks, on meta.

    The caller must call :func:`meshtrain.parallel.mesh.shutdown_distributed` when done (the fake
    process group is this process's default group meanwhile)."""
    from meshtrain.parallel.pipeline.p2p import Exchanger
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config.train.timeline_step = 0  # writes no file
    config.parallel.dp_shared_memory = False  # shared memory needs real peers and real storage
    config.parallel.pp_shared_memory = False
    config.train.compile = False  # torch.compile changes no buffer
    mesh = build_mesh(config, dry_run=(rank, world))
    trainer = Trainer(config, mesh, with_data=False)  # model state only: no data is read
    if trainer.pipeline is not None:  # no store rendezvous on the fake group
        trainer.pipeline.exchanger = Exchanger(mesh.comm("pp"), "tagged")
    return DryRank(trainer, world, rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run_step(trainer) -> None:
    """One training step on the meta tensors (gradients, clipping, AdamW); its collectives are
    recorded by the counted comms. Mirrors :meth:`Trainer.train_step` without reading values."""
    from meshtrain.training.lr_schedule import learning_rate

    config, mesh = trainer.config, trainer.mesh
    train, m = config.train, config.parallel.microbatches
    micro = train.global_batch // (mesh.dp * m)
    global_tokens = float(train.global_batch * train.seq_len)

    def token_count(microbatches, local=None) -> float:
        count = torch.zeros(1, device=mesh.device)
        mesh.comm("dp").all_reduce(count)  # as the trainer's; a meta value cannot be read
        return global_tokens

    trainer._global_token_count = token_count
    batch = [(torch.zeros(micro, train.seq_len, dtype=torch.long, device=mesh.device),) * 2
             for _ in range(m)]
    mesh.comm_log.begin_step(1)
    result = trainer.compute_gradients(batch, micro * train.seq_len * m)
    trainer.optimizer.clip_grad_norm(train.grad_clip)
    losses = torch.stack([result["lm"], result["aux"]])
    mesh.comm("pp").all_reduce(losses)
    mesh.comm("dp_cp").all_reduce(losses)
    trainer.optimizer.step(learning_rate(0, train))
    trainer.optimizer.zero_grad()


def measured_collectives(dry: DryRank) -> dict:
    """Run one step on meta (:func:`_run_step`) and count its collectives per axis and op; when
    the step cannot run on meta tensors, :func:`derived_collectives` instead."""
    log = dry.trainer.mesh.comm_log
    log.recent = collections.deque()  # keep every record of the step, not the last 32
    try:
        _run_step(dry.trainer)
    except (NotImplementedError, RuntimeError) as error:
        reason = str(error).splitlines()[0][:160]
        return derived_collectives(dry, f"a step could not run on meta tensors ({reason})")
    axes: dict[str, dict] = {}
    for record in log.recent:
        if record.step != 1:
            continue
        _add(axes, record.axis, record.op, record.bus_bytes)
    return {"source": "measured: one step run on meta, counted by meshtrain.parallel.comm",
            "axes": axes}


def _add(axes: dict, axis: str, op: str, moved: int, calls: int = 1) -> None:
    entry = axes.setdefault(axis, {"calls": 0, "bytes": 0, "ops": {}})
    per_op = entry["ops"].setdefault(op, {"calls": 0, "bytes": 0})
    entry["calls"] += calls
    entry["bytes"] += moved
    per_op["calls"] += calls
    per_op["bytes"] += moved


def derived_collectives(dry: DryRank, why: str) -> dict:
    """One step's dp/edp collectives from the engine's buckets and ZeRO stage, and its pipeline
    messages from the schedule (tp, ep and the small scalar all-reduces are not derived)."""
    from meshtrain.config.runtime_facts import bus_bytes

    trainer = dry.trainer
    engine, m = trainer.engine, trainer.plan.microbatches
    per_mb = 1 if trainer.pipeline is not None else m  # a pipeline reduces once (sync_all)
    axes: dict[str, dict] = {}
    gatherer = engine.gatherer
    kept = (set() if gatherer is None or trainer.pipeline is not None else
            {b.index for b in gatherer.unit_buckets[gatherer.last_unit()]})
    for b in engine.buckets:
        n = engine.comms[b.axis].size
        grads = b.padded_numel * engine.grad_dtype.itemsize
        params = b.padded_numel * b.dtype.itemsize
        gathers = m if b.index in kept else 2 * m  # the last unit stays for its backward
        ops = {0: [("all_reduce", grads, 1)],
               1: [("reduce_scatter", grads, 1), ("all_gather", params, 1)],
               2: [("reduce_scatter", grads, per_mb), ("all_gather", params, 1)],
               3: [("reduce_scatter", grads, m), ("all_gather", params, gathers)]}[engine.stage]
        for op, size, calls in ops:
            if n > 1:
                _add(axes, b.axis, op, calls * bus_bytes(op, size, n), calls)
    if trainer.pipeline is not None:
        ex = trainer.pipeline
        size = _nbytes(torch.empty(ex.activation_shape, dtype=ex.dtype, device="meta"))
        for action in ex.schedule.actions[ex.pp_rank]:
            if action.kind.is_send or action.kind.is_recv:
                _add(axes, "pp", "send" if action.kind.is_send else "recv", size)
    return {"source": f"derived from the engine's buckets and the schedule: {why}; tp and ep "
                      f"collectives not included", "axes": axes}


def pipeline_message_peak(schedule, rank: int) -> int:
    """The most message buffers :class:`~meshtrain.parallel.pipeline.executor.PipelineExecutor`
    holds at once on ``rank``: a received activation or gradient from its exchange until the
    backward that consumes it, a sent input gradient until the next exchange is posted (sent
    activations are the stage outputs themselves, no extra buffer)."""
    from meshtrain.parallel.pipeline.message_order import exchanges, message_of
    from meshtrain.parallel.pipeline.schedule import ActionKind

    live: set[tuple] = set()
    sent: set[tuple] = set()
    peak = 0
    for _, item in exchanges(schedule.actions[rank]):
        if isinstance(item, list):
            live -= sent  # the previous exchange is waited for before this one is posted
            sent = set()
            for action in item:
                if action.kind.is_recv:
                    live.add(("recv", *message_of(action)))
                elif action.kind is ActionKind.SEND_GRAD:
                    sent.add(("send", *message_of(action)))
            live |= sent
            peak = max(peak, len(live))
        elif item.kind in (ActionKind.B, ActionKind.I):
            mb, s = item.microbatch, item.stage
            live -= {("recv", "act", mb, s - 1), ("recv", "grad", mb, s + 1)}
    return peak


def memory(dry: DryRank) -> dict:
    """Bytes this rank holds and allocates, read off the built objects.

    ``buffers``: non-parameter module buffers plus the gradient buckets in flight: the
    reduce-scatter outputs of every bucket (ZeRO >= 1; each pending reduction's closure keeps its
    output until :meth:`DataParallelEngine.end_microbatch`) and the two largest buckets' own
    reduction staging (autograd's gradients before their hook, and under ZeRO >= 2 the fresh
    full buffer each reduction fills). ``largest_transient``: the largest of the ZeRO-3 gather
    (the root unit and the largest pair of consecutive units: the one in use and the one
    prefetched), the pipeline's message buffers alive at once (:func:`pipeline_message_peak`)
    and, with ZeRO >= 2 under a pipeline, the full gradients
    accumulated over the micro-batches before their reduction."""
    trainer = dry.trainer
    engine, model = trainer.engine, trainer.model
    states = trainer._memory()
    g_size = engine.grad_dtype.itemsize
    separate = any(engine.grad_dtype != b.dtype for b in engine.buckets)  # fp32 main grads

    def staging(b) -> int:
        grads = [s.numel * b.dtype.itemsize for s in b.slots]
        if engine.stage < 2:  # reduced in place; separate grads: one .grad until its hook
            return max(grads) if separate else 0
        return b.padded_numel * g_size + sum(grads)

    outputs = sum(b.shard_numel * g_size for b in engine.buckets) if engine.stage else 0
    in_flight = outputs + sum(sorted((staging(b) for b in engine.buckets), reverse=True)[:2])
    module_buffers = sum(_nbytes(t) for t in model.buffers())
    transients = {}
    gatherer = getattr(engine, "gatherer", None)
    if gatherer is not None:
        def gathered(buckets) -> int:
            return sum(b.padded_numel * b.dtype.itemsize for b in buckets)

        full = [gathered(unit) for unit in gatherer.unit_buckets]
        pairs = max((a + b for a, b in zip(full, full[1:], strict=False)), default=sum(full))
        transients["zero3_gather"] = pairs + gathered(gatherer.root_buckets)
    if trainer.pipeline is not None:
        ex = trainer.pipeline
        size = _nbytes(torch.empty(ex.activation_shape, dtype=ex.dtype, device="meta"))
        transients["pp_messages"] = pipeline_message_peak(ex.schedule, ex.pp_rank) * size
        if engine.stage >= 2:
            transients["pp_accumulated_grads"] = sum(
                s.numel * (4 if separate else b.dtype.itemsize)
                for b in engine.buckets for s in b.slots)
    largest = max(transients.values(), default=0)
    out = {"param": states["param_bytes"], "grad": states["grad_bytes"],
           "optim": states["optim_bytes"], "buffers": module_buffers + in_flight,
           "largest_transient": largest}
    out["total"] = sum(out.values())
    detail = {"module_buffers": module_buffers, "grad_buckets_in_flight": in_flight,
              "grad_reduce_outputs": outputs,
              "buckets": len(engine.buckets), "transients": transients,
              "largest_transient_kind": max(transients, key=transients.get) if transients
              else None}
    return {"bytes": out, "detail": detail}


def planner_estimate(config: Config, rank_coords: dict, measured: dict) -> dict:
    """The planner's model states for this rank's pipeline stage
    (:func:`meshtrain.planner.cost.memory.rank_memory`, built as ``meshtrain estimate`` builds them)
    and the relative difference of the dry run's bytes from them."""
    from meshtrain.planner.cost.memory import rank_memory
    from meshtrain.planner.cost.workload import Workload, stage_layers

    layout = config.parallel.layout()
    stage = rank_coords["pp"]
    layers = stage_layers(config.model, layout)[stage]
    est = rank_memory(Workload.from_config(config), layout, stage, layers, 0.0,
                      config.parallel.dp_bucket_mb)
    out = {"param": int(est.param_bytes), "grad": int(est.grad_bytes),
           "optim": int(est.optim_bytes), "buffers": int(est.buffer_bytes)}
    out["model_states"] = out["param"] + out["grad"] + out["optim"]
    out["layers"] = len(layers)
    dry = dict(measured)
    dry["model_states"] = dry["param"] + dry["grad"] + dry["optim"]
    dry["buffers"] = dry["buffers"] + dry["largest_transient"]
    out["rel_diff"] = {key: (dry[key] - out[key]) / out[key] if out[key] else None
                       for key in ("param", "grad", "optim", "model_states", "buffers")}
    out["note"] = ("rel_diff = (dry run - planner) / planner; buffers compares the planner's "
                   "buffers with the dry run's buffers + largest transient")
    return out


def report(config: Config, world: int, rank: int) -> dict:
    """Build rank ``rank`` of ``world`` on meta, run one step's collectives, and return the
    JSON-ready report (layout, bytes, collectives, planner estimate)."""
    from meshtrain.parallel.mesh import shutdown_distributed

    start = time.perf_counter()
    try:
        dry = build_rank(config, world, rank)
        mem = memory(dry)
        collectives = measured_collectives(dry)
        mesh, par = dry.trainer.mesh, config.parallel
        layers = sorted(int(key) for key in dry.trainer.model.layers.keys())
    finally:
        shutdown_distributed()
    coords = {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank,
              "edp": mesh.edp_rank, "cp": mesh.cp_rank}
    layout = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep, "cp": mesh.cp,
              "replicas": mesh.replicas, "replica": mesh.replica_rank, "zero": par.zero,
              "microbatches": par.microbatches, "schedule": par.pp_schedule,
              "virtual_stages": par.virtual_stages, "sequence_parallel": par.sequence_parallel,
              "precision": config.train.precision, "grad_reduce_dtype": par.grad_reduce_dtype,
              "coords": coords, "layers": layers}
    return {"world": world, "rank": rank, "layout": layout, "bytes": mem["bytes"],
            "detail": mem["detail"], "collectives": collectives,
            "estimate": planner_estimate(config, coords, mem["bytes"]),
            "elapsed_s": round(time.perf_counter() - start, 3)}


def _gb(value: float) -> str:
    return f"{value / GB:10.3f} GB"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+8.2f} %"


def format_report(rep: dict) -> str:
    """The readable table of :func:`report`."""
    lay, b, est = rep["layout"], rep["bytes"], rep["estimate"]
    c = lay["coords"]
    layers = lay["layers"]
    span = f"{layers[0]}-{layers[-1]}" if layers else "none"
    group = (f"replica {lay['replica']}/{lay['replicas']} " if lay.get("replicas", 1) > 1
             else "")
    lines = [f"meshtrain dry run: rank {rep['rank']} of {rep['world']} ({group}"
             f"pp {c['pp']}/{lay['pp']} "
             f"dp {c['dp']}/{lay['dp']} cp {c['cp']}/{lay['cp']} tp {c['tp']}/{lay['tp']} "
             f"ep {c['ep']}/{lay['ep']}), "
             f"ZeRO-{lay['zero']}, {lay['microbatches']} micro-batch(es), {lay['precision']}; "
             f"{len(layers)} layers ({span}; planner assumes {est['layers']})",
             f"{'':24}{'dry run':>13}{'planner':>13}{'diff':>11}"]
    rows = [("parameters", "param"), ("gradients", "grad"), ("optimizer state", "optim")]
    for label, key in rows:
        lines.append(f"{label:24}{_gb(b[key])}{_gb(est[key])} {_pct(est['rel_diff'][key])}")
    states = b["param"] + b["grad"] + b["optim"]
    lines.append(f"{'model states':24}{_gb(states)}{_gb(est['model_states'])} "
                 f"{_pct(est['rel_diff']['model_states'])}")
    d = rep["detail"]
    lines.append(f"{'buffers':24}{_gb(b['buffers'])}   (module {d['module_buffers'] / GB:.3f} "
                 f"GB + gradient buckets in flight {d['grad_buckets_in_flight'] / GB:.3f} GB)")
    kind = d["largest_transient_kind"] or "none"
    lines.append(f"{'largest transient':24}{_gb(b['largest_transient'])}   ({kind}; the "
                 f"planner's buffers: {est['buffers'] / GB:.3f} GB)")
    lines.append(f"{'total':24}{_gb(b['total'])}   (activations not included)")
    col = rep["collectives"]
    lines.append(f"collectives of one step ({col['source']}):")
    for axis, entry in sorted(col["axes"].items()):
        for op, per in sorted(entry["ops"].items()):
            lines.append(f"  {axis:5}{op:16}{per['calls']:8d} calls {_gb(per['bytes'])} bus")
    lines.append(f"built and stepped in {rep['elapsed_s']:.2f} s")
    return "\n".join(lines)


def main(config: Config, world: int, rank: int, as_json: bool) -> int:
    """Print the dry run of rank ``rank`` (table, or one JSON document); returns 0."""
    rep = report(config, world, rank)
    print(json.dumps(rep, indent=2) if as_json else format_report(rep))
    return 0
