"""AdamW over fp32 master weights, and gradient clipping by the global norm.

With ``precision = "fp32"`` the model's parameters *are* the master weights. With ``bf16`` the
model holds bf16 parameters and gradients (what forward and backward compute with) while the
optimizer keeps an fp32 master copy plus fp32 Adam moments: 2 + 2 + 12 bytes per parameter, the
mixed-precision accounting of the ZeRO paper. After each step the master is rounded back into the
bf16 parameters.

Weight decay applies to matrices (ndim >= 2) only; norms and biases are not decayed.
"""

from __future__ import annotations

import torch

from meshtrain.config import TrainConfig


class MixedPrecisionAdamW:
    """AdamW whose state and update are fp32 whatever the parameters' dtype."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig):
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in self.params]
        decay = [m for m in self.masters if m.ndim >= 2]
        no_decay = [m for m in self.masters if m.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.inner = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                       betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                       foreach=True)

    @property
    def separate_master(self) -> bool:
        """True when the fp32 master is a copy (bf16 training)."""
        return any(m is not p for m, p in zip(self.masters, self.params, strict=True))

    def grads(self) -> list[torch.Tensor]:
        """The gradients the step will use (the model parameters' ``.grad``)."""
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW update at learning rate ``lr``."""
        for group in self.inner.param_groups:
            group["lr"] = lr
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        self.inner.step()
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                param.copy_(master)
                master.grad = None

    def zero_grad(self) -> None:
        """Drop every gradient (set to None, freeing the memory)."""
        for param in self.params:
            param.grad = None

    def state_bytes(self) -> int:
        """Bytes held by the optimizer: Adam moments plus a separate fp32 master, if any."""
        total = 0
        for master, param in zip(self.masters, self.params, strict=True):
            state = self.inner.state.get(master, {})
            total += sum(t.numel() * t.element_size() for t in state.values()
                         if isinstance(t, torch.Tensor) and t.ndim > 0)
            if master is not param:
                total += master.numel() * master.element_size()
        return total

    def state_dict(self) -> dict:
        """Optimizer state keyed by parameter *name*, so it does not depend on the layout."""
        per_param = {}
        for name, master in zip(self.names, self.masters, strict=True):
            state = self.inner.state.get(master)
            if state:
                per_param[name] = {k: v for k, v in state.items()}
        masters = {name: m for name, m, p in zip(self.names, self.masters, self.params,
                                                 strict=True) if m is not p}
        return {"state": per_param, "masters": masters}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore from :meth:`state_dict` (names must match)."""
        for name, master, param in zip(self.names, self.masters, self.params, strict=True):
            if name in sd.get("masters", {}):
                master.copy_(sd["masters"][name])
            elif master is not param:
                master.copy_(param)
            if name in sd["state"]:
                self.inner.state[master] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                            for k, v in sd["state"][name].items()}


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float,
                   sq_norm_reducer=None) -> torch.Tensor:
    """Scale ``grads`` so their global L2 norm is at most ``max_norm``; return the norm before.

    ``sq_norm_reducer``, when given, sums the local squared norm over the ranks that hold
    *different* pieces of the gradients (each piece counted once), so the norm equals the
    one-process norm under any layout. ``max_norm = 0`` only measures.
    """
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        sq = torch.stack(norms).square().sum()
    else:
        sq = torch.zeros(())
    if sq_norm_reducer is not None:
        sq = sq_norm_reducer(sq)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
