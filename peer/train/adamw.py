"""AdamW whose moments may be kept in bfloat16 between steps: 2 bytes per parameter less for each.

A full replica holds, per parameter, its value, its gradient during a step, AdamW's two moments, the round's
anchor and the error feedback (docs/design.md, "Memory per parameter"); the moments are the largest part that is
the peer's own, never sent and never checksummed, so their precision is this peer's choice. Each step widens one
parameter's moments to float32, runs torch's fused AdamW kernel on that parameter, and narrows them back: the
arithmetic is float32 as before, the transient is one parameter's moments, and what is lost is the stored moments'
rounding to bfloat16 between steps (8 significant bits). ``hlbp bench convergence --state`` measures the loss this
costs at equal tokens: none within noise for the second moment alone, more for both (:data:`MOMENT_LAYOUTS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam

MOMENTS = ("exp_avg", "exp_avg_sq")

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
                wide = [state[key].float() for key in MOMENTS]  # the stored tensors themselves when float32
                adam([p], [p.grad], [wide[0]], [wide[1]], [], [state["step"]], fused=True,
                     decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
                for key, value in zip(MOMENTS, wide):
                    if value is not state[key]:
                        state[key].copy_(value)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENTS:
                if key in state and state[key].dtype != self.dtypes[key]:
                    state[key] = state[key].to(self.dtypes[key])
