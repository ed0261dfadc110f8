"""AdamW whose moments may be kept in bfloat16 between steps: 2 bytes per parameter less for each.

A full replica holds, per parameter, its value, its gradient during a step, AdamW's two moments, the round's
anchor and the error feedback (docs/design.md, "Memory per parameter"); the moments are the largest part that is
the peer's own, never sent and never checksummed, so their precision is this peer's choice. Each step widens one
parameter's moments to float32 a block of :data:`BLOCK_VALUES` values at a time, runs torch's fused AdamW kernel on
that block, and narrows them back: the arithmetic is float32 as before (elementwise, so a block's values are the
whole parameter's bit for bit), the transient is one block's moments (at most 8 MiB, not the embedding's 16-32 MiB on
`small`, beside the gradients at a step's peak), and what is lost is the stored moments' rounding to
bfloat16 between steps (8 significant bits). ``hlbp bench convergence --state`` measures the loss this
costs at equal tokens: +0.3 % on average over five seeds for the second moment alone, more for both
(:data:`MOMENT_LAYOUTS`; docs/results.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.adam import adam

MOMENTS = ("exp_avg", "exp_avg_sq")

BLOCK_VALUES = 1 << 20
"""Values of a parameter stepped at once when a moment is stored narrower than float32 (a multiple of any vector
width, so a block's values meet the kernel's vector lanes as the whole parameter's do)."""

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes a peer may keep its own optimizer state in: the inner AdamW's moments, SparseLoCo's error feedback."""

MOMENT_LAYOUTS = {
    "fp32": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},  # torch's AdamW: 8 bytes per parameter
    "v-bf16": {"exp_avg": torch.float32, "exp_avg_sq": torch.bfloat16},  # 6: the second moment in bf16
    "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},  # 4: both
}
"""How AdamW's moments may be stored (``OptimConfig.moments``): each moment's dtype between steps."""


class CompactAdamW(torch.optim.AdamW):
    """:class:`torch.optim.AdamW` (decoupled weight decay, no amsgrad) with each moment stored in the dtype
    ``layout`` names (a key of :data:`MOMENT_LAYOUTS`).

    The state has AdamW's own keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints save and load it as
    they do AdamW's; a loaded state is narrowed to the layout again (torch widens it to the parameter's dtype)."""

    def __init__(self, params: Iterable[Any], layout: str = "bf16", **kwargs: Any) -> None:
        kwargs.pop("fused", None)
        super().__init__(params, **kwargs)
        self.dtypes = MOMENT_LAYOUTS[layout]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for key in MOMENTS:
                        state[key] = torch.zeros_like(p, dtype=self.dtypes[key], memory_format=torch.preserve_format)
                self._step_one(p, state, group, beta1, beta2)
        return loss

    def _step_one(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], beta1: float,
                  beta2: float) -> None:
        """One AdamW step of parameter ``p``, each block of :func:`_blocks` from the same step count."""
        before = state["step"].clone()
        for value, grad, *moments in _blocks(p, state):
            wide = [m.float() for m in moments]  # the stored tensors themselves when float32
            step = before.clone()  # the kernel adds one to it
            adam([value], [grad], [wide[0]], [wide[1]], [], [step], fused=True,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            for stored, w in zip(moments, wide):
                if w is not stored:
                    stored.copy_(w)
            del wide
        state["step"].copy_(step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENTS:
                if key in state and state[key].dtype != self.dtypes[key]:
                    state[key] = state[key].to(self.dtypes[key])


def _blocks(p: torch.Tensor, state: dict[str, Any]) -> Iterator[list[torch.Tensor]]:
    """(value, gradient, moments...) of ``p``: views of :data:`BLOCK_VALUES` values at a time where a moment is
    narrower than float32, else the whole tensors (also where one is not contiguous, so it cannot be viewed flat)."""
    tensors = [p, p.grad, *(state[key] for key in MOMENTS)]
    narrow = any(state[key].dtype != torch.float32 for key in MOMENTS)
    if not (narrow and p.numel() > BLOCK_VALUES and all(t.is_contiguous() for t in tensors)):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, p.numel(), BLOCK_VALUES):
        yield [t[start:start + BLOCK_VALUES] for t in flat]
