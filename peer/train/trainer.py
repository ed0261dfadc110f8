"""The inner trainer: AdamW with warm-up and cosine decay, clipping, micro-batch accumulation, evaluation.

:class:`InnerTrainer` is the piece a full replica reuses between outer rounds: it owns a model, its AdamW state
and a data stream, and ``train_step(step)`` is a pure function of the step number and that state (the stream is
random-access), which is what makes checkpoints resume exactly.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.decoder import forward_parts
from hlbp.peer.model.subspace import SubspaceConstraint
from hlbp.peer.train.adamw import MOMENT_LAYOUTS, CompactAdamW
from hlbp.peer.train.checkpoint import load_module, optimizer_from_tensors, optimizer_to_tensors
from hlbp.peer.train.turns import Turns


@dataclass
class OptimConfig:
    """Inner optimizer and schedule. Defaults suit the tiny preset on CPU."""

    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at total_steps
    warmup_steps: int = 30  # linear warm-up from 0
    total_steps: int = 300  # length of the cosine schedule
    weight_decay: float = 0.1  # decoupled weight decay on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    grad_accum: int = 1  # micro-batches per optimizer step
    moments: str = "fp32"  # how AdamW's moments are stored between steps: fp32, v-bf16 or bf16 (MOMENT_LAYOUTS)

    def validate(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserInputError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserInputError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise UserInputError("--warmup must be >= 0 and --steps >= 1")
        if self.grad_accum < 1:
            raise UserInputError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise UserInputError("--grad-clip and --weight-decay must be >= 0")
        if self.moments not in MOMENT_LAYOUTS:
            raise UserInputError(f"AdamW moments must be stored as one of {', '.join(MOMENT_LAYOUTS)}, "
                                 f"got {self.moments!r}")


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine to the floor."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` is CUDA when present, else CPU; an unavailable explicit choice is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserInputError(f"--device {name!r} is not a device; use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return device


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; full fp32 on CPU, where bf16 matmuls are slower than fp32 on most hosts."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and none on norms (1-D parameters).

    The fused kernel (CPU and CUDA) updates each tensor in one pass; the multi-tensor ("foreach") one allocates
    temporaries as large as all parameters together, 4 bytes per parameter at the step's peak (docs/design.md,
    "Memory"). ``cfg.moments`` other than "fp32" keeps moments in bfloat16 between steps (:class:`CompactAdamW`)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.moments != "fp32":
        return CompactAdamW(groups, layout=cfg.moments, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


# (step, micro-batch index) -> (inputs, targets)
BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class SparseShift(Protocol):
    """A shift of the parameters that can say, per parameter, where it is not zero: (flat positions, sorted and
    unique, int64; the values there), or None where it cannot without making the parameter
    (:class:`hlbp.peer.rounds.overlap.LandingShift`)."""

    def at_positions(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class InnerTrainer:
    """A model, its AdamW state and a batch source; one ``train_step`` is one optimizer step.

    ``batch_fn(step, micro)`` returns the (inputs, targets) micro-batch for a step; it must be deterministic so
    that a resumed run sees exactly the data an uninterrupted one would have seen.

    ``constraint``: variant A's :class:`~hlbp.peer.model.subspace.SubspaceConstraint` over ``model``'s parameters
    (a full replica of an A run trains the constrained network as the stage peers do): every step is followed by
    its ``reproject``, and whoever loads new global parameters into the model calls its ``sync``.

    ``turns``: where each step takes its turn beside the forward passes a peer's round exchange runs in another
    thread (:class:`~hlbp.peer.train.turns.Turns`); None: steps take no turn.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, batch_fn: BatchFn, device: torch.device,
                 constraint: SubspaceConstraint | None = None, turns: Turns | None = None) -> None:
        cfg.validate()
        self.turns = turns
        self.model = model.to(device)
        self.cfg = cfg
        self.batch_fn = batch_fn
        self.device = device
        self.optimizer = make_adamw(self.model, cfg)
        self.constraint = constraint
        if constraint is not None:
            constraint.sync()  # its references now live where the model does
        self.step = 0  # optimizer steps taken so far
        self.tokens = 0  # training tokens consumed so far

    def train_step(self, grad_at: Mapping[str, torch.Tensor] | None = None) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean training loss.

        ``grad_at`` (name -> tensor, every parameter): the step's gradient is taken at these weights instead of the
        model's own, and then steps the model's own: what a pipeline whose stages run ahead of their updates
        applies (an asynchronous schedule's stale gradient, :mod:`hlbp.peer.sim.stale`)."""
        if self.turns is None:
            return self._train_step(grad_at)
        with self.turns.step():
            return self._train_step(grad_at)

    def _train_step(self, grad_at: Mapping[str, torch.Tensor] | None) -> float:
        self.model.train()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        own = None
        if grad_at is not None:
            own = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(grad_at[n])
        total = 0.0
        for micro in range(self.cfg.grad_accum):
            x, y = (t.to(self.device, non_blocking=True) for t in self.batch_fn(self.step, micro))
            with autocast(self.device):
                loss = self.model.loss_of(x, y) / self.cfg.grad_accum
            loss.backward()
            total += loss.item()
            self.tokens += y.numel()
        if own is not None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(own[n])
            del own
        if not math.isfinite(total):
            raise FloatingPointError(f"training loss became {total} at step {self.step}; lower --lr")
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        # the gradients are not needed past the step: between steps (where a round contributes and applies) they
        # would hold 4 bytes per parameter for nothing
        self.optimizer.zero_grad(set_to_none=True)
        if self.constraint is not None:
            self.constraint.reproject()
        self.step += 1
        return total

    def warm_up(self) -> None:
        """One forward and backward pass on the next step's batch, with nothing changed: no optimizer step, no
        tokens counted, gradients dropped. A process's first pass is slower than the rest (allocations,
        autograd's first graph: about twice on the tiny model); a peer joining a run under way takes it early."""
        self.model.train()
        x, y = (t.to(self.device) for t in self.batch_fn(self.step, 0))
        with autocast(self.device):
            self.model.loss_of(x, y).backward()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def load_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Copy ``params`` (name -> tensor, at least every parameter of the model: a round's global parameters)
        into the model; with a constraint, later steps keep their changes in span(U) relative to these."""
        for n, p in self.model.named_parameters():
            p.copy_(params[n])
        if self.constraint is not None:
            self.constraint.sync()

    @torch.no_grad()
    def shift_params(self, delta: Mapping[str, torch.Tensor]) -> None:
        """Add ``delta`` (name -> tensor, a subset of the parameters) to the model in place, keeping the optimizer's
        state: an overlapped round's result landing in the middle of an inner phase (rounds/overlap.py).

        Where ``delta`` also says a parameter's shift at the few positions it is not zero (:class:`SparseShift`),
        only those are read and changed: the same sums there, and elsewhere the parameter is left as it is (a
        dense add of zero would only turn a -0.0 into 0.0)."""
        if self.constraint is not None:
            raise RuntimeError("a constrained (stage) trainer cannot shift its parameters: stage peers do not overlap")
        params = dict(self.model.named_parameters())
        sparse = delta if isinstance(delta, SparseShift) else None
        for n in delta:
            p = params[n]
            at = sparse.at_positions(n) if sparse is not None and p.is_contiguous() else None
            if at is None:
                p.add_(delta[n].to(device=p.device, dtype=p.dtype))
                continue
            positions, values = at[0].to(p.device), at[1].to(device=p.device, dtype=p.dtype)
            flat = p.view(-1)
            flat[positions] = flat[positions] + values

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over fixed validation batches (token-weighted)."""
        return evaluate(self.model, batches, self.device)

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Model and optimizer tensors plus a JSON header, for :func:`hlbp.peer.train.checkpoint.save_checkpoint`."""
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        opt_tensors, opt_desc = optimizer_to_tensors(self.optimizer)
        tensors.update(opt_tensors)
        return tensors, {"step": self.step, "tokens": self.tokens, "optimizer": opt_desc}

    def load_state(self, tensors: Mapping[str, torch.Tensor], header: dict) -> None:
        """Restore what :meth:`state_tensors` saved; a checkpoint of another model is a user error. The model's
        tensors are copied in one at a time (``tensors`` may read each from the file: a resume then holds one
        tensor of the checkpoint beside the model, not all of it)."""
        load_module(self.model, tensors, "model.")
        step, tokens, desc = header.get("step"), header.get("tokens", 0), header.get("optimizer")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in (step, tokens)):
            raise UserInputError("checkpoint header's step and tokens must be non-negative integers; delete it")
        if not isinstance(desc, dict):
            raise UserInputError("checkpoint header lacks the optimizer description; delete it")
        optimizer_from_tensors(self.optimizer, tensors, desc)
        self.step, self.tokens = step, tokens
        if self.constraint is not None:
            self.constraint.sync()  # later steps keep their changes in span(U) relative to the restored weights


def warm_runtime(config: Any, optim: OptimConfig, device: torch.device, batch_size: int, seq_len: int) -> None:
    """One training step of a one-block model of ``config``'s width on ``device``, thrown away: it loads what the
    runtime loads on first use, a fixed cost of the process whatever the model's size. On CUDA that is the kernels
    of a forward and backward pass under autocast, cuBLAS and the optimizer's kernels (measured on one H200: about
    460 MiB of host memory on the small and the 125m presets alike); on the CPU, autograd's and the kernels' first
    allocations (measured on this project's 2-core box: about 90 MiB, 3.5 bytes per parameter of the small preset, 1
    of the 125m). A peer calls it before it marks its memory baseline (:func:`hlbp.peer.common.memory.mark_baseline`,
    which then gives the freed memory back), so that the budget per parameter counts what the model's size costs,
    not the runtime. The global random state is as before. ``config``: a
    :class:`hlbp.peer.model.decoder.ModelConfig`."""
    with torch.random.fork_rng(devices=[]):  # the one-block model's init draws from the global generator
        throwaway_step(config, optim, device, batch_size, seq_len)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def throwaway_step(config: Any, optim: OptimConfig, device: torch.device, batch_size: int, seq_len: int) -> float:
    """One AdamW step of a fresh one-block model of ``config``'s width, on ``device``, on random tokens;
    returns its loss. Everything it made is dropped on return (:func:`warm_runtime`)."""
    from hlbp.peer.model.decoder import build_model

    one = config.replace(n_layers=1, subspace_layers=None if config.subspace_layers is None else
                         min(1, config.subspace_layers))
    model = build_model(one).to(device)  # built where a run's model is (its seeded tables use CPU generators)
    opt = make_adamw(model, optim)
    x = torch.randint(0, one.vocab_size, (batch_size, min(seq_len, one.max_seq_len)), device=device)
    with torch.enable_grad(), autocast(device):  # also where its caller turned gradients off
        loss = model.loss_of(x, x)
        loss.backward()
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that holds no parameter memory: its parameters are on the meta device and its buffers
    (constant tables such as the rotary ones) are ``model``'s own, shared. :func:`evaluate_params` runs it on
    given parameter tensors, so scoring a second set of parameters beside a model in training costs no copy of
    them (docs/design.md, "Memory")."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                            for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(model, memo)


@torch.no_grad()
def evaluate_params(shell: nn.Module, params: Mapping[str, torch.Tensor],
                    batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Token-weighted mean loss of ``shell`` (a :func:`skeleton` of a model or stage) run on ``params`` (name ->
    tensor, at least every parameter; moved to ``device`` only where they are elsewhere) over ``batches``.

    The batches go through the forward pass one step at a time (:func:`~hlbp.peer.model.decoder.forward_parts`),
    each step's parameters read from ``params`` only for it: scoring parameters that a store reads from a file or
    a view computes on demand (a round's candidate) holds one block's of them at a time, not a copy of the model
    beside the one in training (docs/design.md, "Memory per parameter"). The loss is bit for bit the whole
    forward's."""
    shell.eval()
    hidden = [x.to(device) for x, _ in batches]
    parts = forward_parts(shell)  # type: ignore[arg-type]
    total, count = 0.0, 0
    for part, names in parts[:-1]:
        tensors = {"stage." + n: params[n].to(device) for n in names}
        with autocast(device):
            hidden = [torch.func.functional_call(part, tensors, (h,)) for h in hidden]
        del tensors  # before the next part's are read
    part, names = parts[-1]
    tensors = {"stage." + n: params[n].to(device) for n in names}
    for h, (_, y) in zip(hidden, batches):  # the logits of one batch at a time
        y = y.to(device)
        with autocast(device):
            total += shell.loss(torch.func.functional_call(part, tensors, (h,)), y).item() * y.numel()
        count += y.numel()
    return total / max(1, count)


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Token-weighted mean loss of ``model`` (a whole model or a last stage fed inputs) over ``batches``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device):
            total += model.loss(model(x), y).item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(1, count)


class Throughput:
    """Tokens per second over a sliding window of recent steps, for progress display."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.samples: list[tuple[float, int]] = []

    def add(self, tokens: int) -> None:
        self.samples.append((time.perf_counter(), tokens))
        del self.samples[: -self.window - 1]

    @property
    def tokens_per_s(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, _), (t1, _) = self.samples[0], self.samples[-1]
        return sum(n for _, n in self.samples[1:]) / max(t1 - t0, 1e-9)


def micro_batches(stream, grad_accum: int) -> BatchFn:
    """Adapter: a batch function over (step, micro) from a random-access stream of ``batch(index)``."""
    return lambda step, micro: stream.batch(step * grad_accum + micro)
