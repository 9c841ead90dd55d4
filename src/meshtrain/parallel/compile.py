"""``train.compile``: compile each transformer block's forward with ``torch.compile``.

Only the block's own ``forward`` is compiled (replaced on the instance, so parameter names do not
change), never the module call: the hooks the parallel engines attach to blocks (ZeRO-3 gathers,
gradient-bucket readiness) stay eager, outside the compiled graph. Activation checkpointing
(``full``) is applied first, so the compiled function contains the (non-reentrant) checkpoint;
compiling inside the checkpoint instead fails torch's recompute metadata check.

Inside a block, what talks to other ranks or has data-dependent shapes runs eagerly, between
compiled pieces (explicit graph breaks, so nothing is traced that must not be):

* tensor parallelism's region functions (Megatron's ``f``/``g`` pairs and the sequence-parallel
  gather / reduce-scatter of :mod:`meshtrain.parallel.tensor.collectives`): each is one
  collective in forward and one in backward, so the attention core, the MLP's activation and
  the norms between them are compiled while every collective stays a plain eager call;
* Mixture-of-Experts layers (routing, capacity, the all-to-all dispatch and the per-expert
  matmuls): token counts per expert change every micro-batch, which would recompile each time;
* matmuls whose weight gradient the zero-bubble schedules defer
  (:mod:`meshtrain.model.weight_grad`): their backward reads run-time state (whether a ``W``
  queue is active), which a traced backward graph would freeze.

Supported: dense and MoE models under dp / ZeRO 0-3 / tp (+SP) / pp / ep, activation
checkpointing ``none`` or ``full``. Not yet: ``selective`` checkpointing (checkpointed
submodules inside a compiled graph; :func:`meshtrain.validation.run_config.validate_train` refuses
it).

What it buys, measured on the 2-vCPU development VM (dim 256 × 4 layers, seq 256, batch 8, fp32,
one thread, dense, one process): forward + backward 0.845 s against 0.884 s eager (−4.5 %),
after 44 s of compiling (each block's first call runs eagerly, see :func:`_eager_first`; the
second compiles). On CPU it pays off only for runs of many minutes; on
a GPU, where eager element-wise kernels are a larger share of the step, it is the usual
torchtitan / Megatron choice.
"""

from __future__ import annotations

import functools

import torch

from meshtrain.parallel.state import attach_parallel_state


@functools.cache
def _mark_eager_boundaries() -> None:
    """Wrap the functions that must stay eager (tp region collectives, the cp key/value gather,
    deferrable matmuls) in ``torch.compiler.disable``, once per process (cached). Done here
    rather than at import, so runs without ``train.compile`` never import TorchDynamo (~70 MB of
    resident memory per process)."""
    from meshtrain.model import weight_grad
    from meshtrain.parallel.context import attention as context_attention
    from meshtrain.parallel.tensor import collectives

    for module, name in ((collectives, "_pair"), (context_attention, "gather_in_sequence_order"),
                         (weight_grad, "_deferrable_linear"),
                         (weight_grad, "_deferrable_expert_matmul")):
        setattr(module, name, torch.compiler.disable(getattr(module, name)))


def _eager_first(eager, compiled):
    """A block forward that runs ``eager`` on its first call and ``compiled`` after. The first
    call fills the RoPE tables the blocks share (``Attention.rope_cache``); traced with the
    table missing, the graph would guard on its absence and every block after the first would
    compile a second graph (measured: two compilations of the block code instead of one)."""
    warm = False

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        nonlocal warm
        if not warm:
            warm = True
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    return forward


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every transformer block's ``forward`` in place (its MoE layer left eager), each
    once (the model's :class:`~meshtrain.parallel.state.ParallelState` lists the compiled
    blocks); returns how many were compiled now."""
    _mark_eager_boundaries()
    done = attach_parallel_state(model).compiled
    compiled = 0
    for key, block in model.layers.items():
        name = f"layers.{key}"
        if name in done:
            continue
        moe = getattr(block, "moe", None)
        if moe is not None:
            moe.forward = torch.compiler.disable(moe.forward, recursive=True)
        block.forward = _eager_first(block.forward, torch.compile(block.forward))
        done.add(name)
        compiled += 1
    return compiled
