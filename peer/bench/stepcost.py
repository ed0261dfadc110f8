"""What ``hlbp join --recompute`` saves and costs in one training step of a preset's whole model: the bytes autograd
and checkpoint hold from the forward for the backward, and the step's time, with each block's activations held
and with the blocks run again in the backward, side by side in one process.

The held bytes are counted exactly (every tensor saved for the backward, each storage once, the parameters left
out; under recompute each block's input, which checkpoint keeps, counted once whether or not autograd's hooks
see it), so they compare across runs and token shapes. The steps are timed alternately, a step of one then a step of the other on the same
batches, so a change of the box's load meets both alike; the figure is the median over the steps. The memory of
whole peers through real rounds is the rest of ``hlbp bench memory`` (a run with ``--recompute`` against one
without).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hlbp.peer.model.decoder import Stage, build_model, preset
from hlbp.peer.train.trainer import autocast, pick_device


def held_for_backward(model: Stage, x: torch.Tensor, y: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The bytes ``model``'s forward of (x, y) holds for its backward beyond the parameters, and the loss (whose
    backward the caller runs). Under ``model.recompute`` that is what autograd saves outside the blocks plus each
    block's input."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:  # each storage once: a view saves no bytes of its own
            held[ptr] = t.untyped_storage().nbytes()
        return t

    def block_input(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        pack(args[0])  # checkpoint keeps it, whether or not autograd's hooks see it: counted once either way

    hooks = [b.register_forward_pre_hook(block_input)
             for b in model.blocks.values()] if model.recompute and torch.is_grad_enabled() else []
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss_of(x, y)
    finally:
        for h in hooks:
            h.remove()
    # the pre-hooks also run in the backward's recomputation, which has not happened yet: one input per block
    return sum(held.values()), loss


def recompute_cost(name: str, batch_size: int, seq_len: int, steps: int, seed: int = 0, threads: int = 1,
                   device: torch.device | None = None) -> dict[str, Any]:
    """For preset ``name`` at a batch of ``batch_size`` x ``seq_len`` random tokens: the bytes per parameter its
    forward holds for the backward and the seconds a step (forward, backward, AdamW) takes, with the activations
    held and with the blocks recomputed (the median over ``steps`` alternating steps after one warm-up step of
    each), and the ratios. ``threads``: torch's CPU threads meanwhile (the memory bench's peers run with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measured(name, batch_size, seq_len, steps, seed, device or pick_device())
    finally:
        torch.set_num_threads(before)


def _measured(name: str, batch_size: int, seq_len: int, steps: int, seed: int,
              device: torch.device) -> dict[str, Any]:
    config = preset(name)
    torch.manual_seed(seed)
    model = build_model(config).to(device)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g) for _ in range(steps + 1)]
    times: dict[bool, list[float]] = {False: [], True: []}
    held: dict[bool, int] = {}
    for i, batch in enumerate(batches):
        x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
        for recompute in (False, True):
            model.recompute = recompute
            start = time.perf_counter()
            with autocast(device):
                nbytes, loss = held_for_backward(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            held.setdefault(recompute, nbytes)
            if i:  # the first step of each is the warm-up
                times[recompute].append(time.perf_counter() - start)
    held_s, recomputed_s = statistics.median(times[False]), statistics.median(times[True])
    return {"preset": name, "batch": [batch_size, seq_len], "steps": steps, "device": device.type, "params": n,
            "held_bytes_per_param": held[False] / n, "recomputed_bytes_per_param": held[True] / n,
            "held_s": held_s, "recomputed_s": recomputed_s, "ratio": recomputed_s / held_s}
