"""One stage's compute, with no network: forward, backward with exactly-once accumulation, and the step.

A :class:`StageWorker` holds a :class:`~hlbp.peer.model.decoder.Stage`, its AdamW, and what backward needs per
micro-batch of the current step (the input and the output graph), up to ``max_stored`` micro-batches. The shell
(:mod:`hlbp.peer.swarm.server`, :mod:`hlbp.peer.swarm.driver`) decodes frames, calls these methods on one compute
thread, and encodes the results.

Exactly once: a micro-batch can reach a stage twice in one step, when the driver re-runs it through another chain
after a stage peer died. The first backward of a micro-batch accumulates the stage's parameter gradients; a later
one only computes the gradient of the stage's input (the weights do not change within a step, so it is the same
gradient), so a step's gradient counts every micro-batch once no matter how many times it was retried. A fresh
standby that replaced a dead peer accumulates every micro-batch the driver re-runs through it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from hlbp.peer.model.decoder import Stage
from hlbp.peer.model.subspace import SubspaceConstraint
from hlbp.peer.swarm.shares import fresh_lineage, next_lineage
from hlbp.peer.train.trainer import OptimConfig, autocast, lr_at, make_adamw


class StageStateError(RuntimeError):
    """A request that this stage's state cannot serve (an unknown micro-batch, a step it did not accumulate)."""


@dataclass
class _Saved:
    attempt: int
    inp: torch.Tensor | None  # leaf with requires_grad (None on the first stage: its input is token ids)
    out: torch.Tensor  # output (hidden states), or the weighted loss on the last stage


@dataclass(frozen=True)
class OwnPart:
    """A stage's accumulated gradient of a step (per parameter, None where none) and the micro-batches in it."""

    grads: dict[str, torch.Tensor | None]
    accumulated: frozenset[int]


class StageWorker:
    """A stage, its optimizer and its per-micro-batch state for the step under way (see the module docstring)."""

    def __init__(self, stage: Stage, optim: OptimConfig, device: torch.device, max_stored: int = 64) -> None:
        self.stage = stage.to(device)
        self.device = device
        self.optim = optim
        self.optimizer = make_adamw(self.stage, optim)
        self.max_stored = max_stored
        config = stage.config
        params = dict(self.stage.named_parameters())
        self.constraint = SubspaceConstraint(params, config) if config.subspace_rank else None
        self.session = -1
        self.step = -1  # the session's step counter this state belongs to
        self.saved: OrderedDict[int, _Saved] = OrderedDict()
        self.accumulated: set[int] = set()  # micro-batches whose gradients are in .grad this step
        self.steps_applied = 0
        # what this stage's AdamW state has seen (hlbp.peer.swarm.shares): peers that serve a stage together and
        # find theirs unequal clear their moments together
        self.lineage = fresh_lineage()
        self.dropped = 0  # stored micro-batches evicted because more than max_stored were in flight

    # --- step bookkeeping ---------------------------------------------------------------------------------------

    def begin(self, session: int, step: int) -> None:
        """Make (session, step) the current step; state of another session or step is discarded first."""
        if (session, step) != (self.session, self.step):
            self.reset()
            self.session, self.step = session, step

    def reset(self) -> None:
        """Forget the step under way: stored graphs, accumulated gradients (an abandoned or superseded step)."""
        self.saved.clear()
        self.accumulated.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def _store(self, mb: int, saved: _Saved) -> None:
        self.saved.pop(mb, None)
        self.saved[mb] = saved
        while len(self.saved) > self.max_stored:
            self.saved.popitem(last=False)
            self.dropped += 1

    # --- compute --------------------------------------------------------------------------------------------------

    def forward(self, mb: int, attempt: int, x: torch.Tensor, train: bool = True) -> torch.Tensor:
        """The stage's output for input ``x`` (token ids on the first stage, hidden states otherwise).

        With ``train`` the graph is kept for :meth:`backward` under (mb, attempt), replacing an older attempt.
        """
        x = x.to(self.device)
        self.stage.train(train)
        if not train:
            with torch.no_grad(), autocast(self.device):
                return self.stage(x).detach()
        inp = None
        if not self.stage.is_first:
            inp = x.detach().requires_grad_(True)
            x = inp
        with autocast(self.device):
            out = self.stage(x)
        self._store(mb, _Saved(attempt, inp, out))
        return out.detach()

    def loss_backward(self, mb: int, attempt: int, x: torch.Tensor, targets: torch.Tensor,
                      weight: float) -> tuple[float, torch.Tensor | None]:
        """Last stage: loss of ``x`` against ``targets`` scaled by ``weight``, backward at once; returns the
        unscaled loss and the gradient of the input."""
        if not self.stage.is_last:
            raise StageStateError("only the last stage computes the loss")
        x = x.to(self.device)
        inp = None
        if not self.stage.is_first:
            inp = x.detach().requires_grad_(True)
            x = inp
        self.stage.train(True)
        with autocast(self.device):
            loss = self.stage.loss_of(x, targets.to(self.device))
        value = float(loss.detach())
        grad = self._backward(mb, _Saved(attempt, inp, loss * weight), None)
        return value, grad

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, targets: torch.Tensor) -> float:
        """Last stage: the loss of ``x`` against ``targets`` with nothing kept."""
        self.stage.train(False)
        with autocast(self.device):
            return float(self.stage.loss(self.stage(x.to(self.device)), targets.to(self.device)))

    @torch.no_grad()
    def forward_at(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The stage's output for ``x`` with ``params`` (name -> tensor, e.g. a round's candidate) in place of its
        own weights, which stay untouched; nothing is kept."""
        own = {n: params[n].to(device=p.device, dtype=p.dtype) for n, p in self.stage.named_parameters()}
        self.stage.train(False)
        with autocast(self.device):
            return torch.func.functional_call(self.stage, own, (x.to(self.device),)).detach()

    @torch.no_grad()
    def eval_loss_at(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, targets: torch.Tensor) -> float:
        """Last stage: the loss of ``x`` against ``targets`` with ``params`` in place of its own weights."""
        out = self.forward_at(params, x)
        with autocast(self.device):
            return float(self.stage.loss(out, targets.to(self.device)))

    def backward(self, mb: int, attempt: int, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` given dL/d(output); returns dL/d(input) (None on the first stage)."""
        saved = self.saved.get(mb)
        if saved is None or saved.attempt != attempt:
            raise StageStateError(f"no stored forward of micro-batch {mb} attempt {attempt} in step {self.step}")
        del self.saved[mb]
        return self._backward(mb, saved, grad_out.to(self.device, saved.out.dtype))

    def _backward(self, mb: int, saved: _Saved, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        if mb not in self.accumulated:
            saved.out.backward(grad_out)
            self.accumulated.add(mb)
            return None if saved.inp is None else saved.inp.grad.detach()
        if saved.inp is None:  # first stage, already accumulated: nothing to compute
            return None
        (grad,) = torch.autograd.grad(saved.out, saved.inp, grad_out)
        return grad.detach()

    # --- the step ------------------------------------------------------------------------------------------------

    def sumsq(self) -> float:
        """Squared norm of this stage's accumulated gradient (the stages sum theirs for global clipping)."""
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(sum(g.detach().double().pow(2).sum() for g in grads))

    def apply(self, lr: float, scale: float) -> bool:
        """One AdamW step at ``lr`` with gradients multiplied by ``scale``; returns False (and steps nothing)
        when a gradient is not finite. Clears the step's state either way."""
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        ok = all(bool(torch.isfinite(g).all()) for g in grads) and math.isfinite(scale)
        if ok:
            if scale != 1.0:
                torch._foreach_mul_(grads, scale)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.constraint is not None:
                self.constraint.reproject()
            self.steps_applied += 1
        self.reset()
        return ok

    def forget_moments(self, lineage: bytes | None = None) -> None:
        """Clear AdamW's state (its moments and step count), as a fresh standby's: what it learned from a phase whose
        gradients came through a peer caught lying must not steer the next steps. ``lineage``: the state's new
        lineage (default: one no other peer shares)."""
        self.optimizer.state.clear()
        self.lineage = fresh_lineage() if lineage is None else lineage

    def applied_with(self, session: int, step: int, peers: list[str] | tuple[str, ...]) -> None:
        """Step (``session``, ``step``) was applied (or skipped) with ``peers`` serving the stage: the lineage
        moves on."""
        self.lineage = next_lineage(self.lineage, session, step, peers)

    # --- several peers of one stage -----------------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """This stage's accumulated gradient of the step under way, by name of each trained parameter (zeros where
        one got none): this peer's part of a trade (hlbp.peer.swarm.shares). Frozen tensors (a subspace codec's
        fixed basis) are left out: a zero gradient would make AdamW decay them."""
        return {n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).float()
                for n, p in self.stage.named_parameters() if p.requires_grad}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of :meth:`gradients`."""
        return {n: tuple(p.shape) for n, p in self.stage.named_parameters() if p.requires_grad}

    def take_gradients(self, total: Mapping[str, torch.Tensor], count: int) -> None:
        """Replace the accumulated gradient with ``total``, the whole step's (every peer's part added), so every one
        of the step's ``count`` micro-batches counts as accumulated here (a re-run only passes its gradient back).
        A parameter no micro-batch reached keeps no gradient, as one peer's step leaves it (AdamW skips it)."""
        for n, p in self.stage.named_parameters():
            if n in total and (p.grad is not None or bool(total[n].any())):
                p.grad = total[n].to(device=p.device, dtype=p.dtype).clone()
        self.accumulated = set(range(count))

    def own_part(self) -> OwnPart:
        """The accumulated gradient as it stands (the tensors themselves: :meth:`take_gradients` puts new ones in
        their place) and the micro-batches in it: what a peer of a shared stage takes back with
        :meth:`restore_part` when a step it traded is re-run."""
        return OwnPart({n: p.grad for n, p in self.stage.named_parameters()}, frozenset(self.accumulated))

    def restore_part(self, part: OwnPart) -> None:
        """Put back the gradient and micro-batches :meth:`own_part` returned (a parameter that had none, none)."""
        for n, p in self.stage.named_parameters():
            p.grad = part.grads.get(n)
        self.accumulated = set(part.accumulated)

    def parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.stage.named_parameters())


def clip_scale(total_sumsq: float, max_norm: float) -> float:
    """The factor :func:`torch.nn.utils.clip_grad_norm_` applies for a global squared norm ``total_sumsq``."""
    if max_norm <= 0:
        return 1.0
    if not math.isfinite(total_sumsq):
        return float("nan")
    return min(1.0, max_norm / (math.sqrt(total_sumsq) + 1e-6))


def wire_norm(total_sumsq: float) -> float:
    """A step's squared gradient norm as a message carries it: at most 1e300, and a non-finite one as 1e300 (the
    step's factor then skips it everywhere, :func:`wire_scale`)."""
    return min(total_sumsq, 1e300) if math.isfinite(total_sumsq) else 1e300


def wire_scale(total_sumsq: float, max_norm: float) -> float:
    """The clipping factor a step's ``apply`` or ``done`` carries for a global squared norm: :func:`clip_scale`, or
    0 (skip the step) where that is not finite."""
    scale = clip_scale(total_sumsq, max_norm)
    return scale if math.isfinite(scale) else 0.0


def finish_fault(lr: float, opt_step: int, max_norm: float, optim: OptimConfig) -> str | None:
    """Why a step's ``finish`` (from the driver, relayed down) must not be run here, or None.

    Every stage holds the run's schedule (``optim``, from the manifest), so it derives the rate of optimizer step
    ``opt_step`` itself and knows the run's clipping norm: a driver that names another rate or norm would step every
    stage of its chain as it chose (the last stage's ``done`` only repeats the driver's rate). ``opt_step`` is the
    driver's count, which no stage can check; whatever it is, the rate stays on the schedule, at most its peak."""
    if opt_step < 0:
        return f"its finish names optimizer step {opt_step}"
    want = lr_at(opt_step, optim)
    if lr != want:
        return f"its finish names learning rate {lr:.6g}, the schedule's at step {opt_step} is {want:.6g}"
    if max_norm != optim.grad_clip:
        return f"its finish names clipping norm {max_norm:.6g}, the run's is {optim.grad_clip:.6g}"
    return None


def done_fault(done_lr: float, done_scale: float, done_sumsq: float, lr: float, max_norm: float,
               forwarded_sumsq: float) -> str | None:
    """Why a step's ``done`` (from the chain's last stage, relayed up) must not be applied here, or None.

    A stage knows the step's learning rate (the driver's, from the finish it forwarded) and the squared gradient
    norm it forwarded down, and every stage computes the clipping scale with the same function. So a ``done``
    whose rate differs, whose total norm is below what this stage already counted, or whose scale is not the one
    its norm gives, was made up: applying it would step this stage's weights as its sender chose (a rate of 10
    made an honest driver's contribution break the round bound by 18-41x).
    """
    if done_lr != lr:
        return f"its done names learning rate {done_lr:.6g}, the step's is {lr:.6g}"
    if not done_sumsq >= forwarded_sumsq * (1 - 1e-9):
        return f"its done's squared gradient norm {done_sumsq:.6g} is below the {forwarded_sumsq:.6g} counted here"
    expect = clip_scale(done_sumsq, max_norm)
    expect = expect if math.isfinite(expect) else 0.0
    if not abs(done_scale - expect) <= 1e-9 * max(1.0, expect):
        return f"its done's clipping scale {done_scale:.6g} is not the {expect:.6g} its norm gives"
    return None
