"""In-process simulation of R replicas under an outer optimizer: the convergence benchmarks' engine.

No network: every replica lives in this process and contributions are passed as objects, but each one is also
encoded to wire bytes and decoded again, so that the loss reflects exactly what peers would apply and the byte
counts are real. A replica only needs ``params()``, ``load_params()`` and ``train(steps)``, so pipeline replicas
with compressed stage boundaries plug in beside full replicas.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hlbp.peer.data.streams import PreparedData, TokenStream, val_batches
from hlbp.peer.model.decoder import ModelConfig, Stage, build_model
from hlbp.peer.model.pipeline import initial_model
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.gather import GatherRule, Standing, select
from hlbp.peer.rounds.outer import Contribution, OuterConfig, make_outer
from hlbp.peer.rounds.overlap import landing_shift, phase_start
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, evaluate, micro_batches


class EngineReplica(Protocol):
    """What the simulation needs of a replica: its parameters, and H inner steps on its own data."""

    name: str
    tokens: int

    def params(self) -> dict[str, torch.Tensor]: ...

    def load_params(self, params: dict[str, torch.Tensor]) -> None: ...

    def train(self, steps: int) -> float: ...


class FullReplica:
    """A whole model with its own AdamW state and its own data stream (rank)."""

    def __init__(self, name: str, model: Stage, trainer: InnerTrainer) -> None:
        self.name, self.model, self.trainer = name, model, trainer

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_params(self, params: dict[str, torch.Tensor]) -> None:
        for n, p in self.model.named_parameters():
            p.copy_(params[n])

    def train(self, steps: int) -> float:
        return sum(self.trainer.train_step() for _ in range(steps)) / max(1, steps)


@dataclass
class EngineConfig:
    """One simulated run: R replicas, ``rounds`` outer rounds of ``inner_steps`` AdamW steps each."""

    model: ModelConfig
    outer: OuterConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    replicas: int = 4
    rounds: int = 10
    inner_steps: int = 15
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    eval_batches: int = 8
    overlap: str = "none"  # rounds overlapped with the next inner phase: none, naive or eager (rounds.overlap)
    # under eager: the inner step of the next phase after which a round's result lands (0: at that phase's end, the
    # paper's eager; a network run lands whenever its exchange finishes, rounds/overlap.py "Landing")
    land_after: int = 0
    # a round accepts at most this many contributions (0: all), chosen by the run's gather rule (rounds/gather.py);
    # a replica left out drops what it sent, as templar's miners do (the manifest's default), or keeps it in its
    # error feedback (``keep_unselected``)
    gather: int = 0
    keep_unselected: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.land_after < max(1, self.inner_steps):
            raise ValueError(f"land_after must be in [0, inner_steps), got {self.land_after}")
        if self.gather and self.overlap != "none":
            raise ValueError("a capped gather set is simulated without overlap only")


ReplicaFactory = Callable[[int, Stage, InnerTrainer], EngineReplica]


def make_full_replicas(cfg: EngineConfig, data: PreparedData, device: torch.device) -> list[EngineReplica]:
    """R full replicas starting from identical weights (seed), each drawing its own data (rank)."""
    out: list[EngineReplica] = []
    optim = dataclasses.replace(cfg.optim, total_steps=cfg.rounds * cfg.inner_steps)
    for r in range(cfg.replicas):
        model = initial_model(cfg.model, cfg.seed)  # a run's initial parameters, as every peer starts
        stream = TokenStream(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=r)
        out.append(FullReplica(f"replica-{r}", model, InnerTrainer(model, optim, micro_batches(stream, 1), device)))
    return out


def run_outer_simulation(
    cfg: EngineConfig,
    data: PreparedData,
    replicas: Sequence[EngineReplica],
    device: torch.device,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg.rounds`` outer rounds; returns per-round validation loss and wire bytes of the global model.

    Under ``cfg.overlap`` (naive or eager) a round's result reaches the global parameters one round late, as in a
    network run whose exchange overlaps the next inner phase, so a round's validation loss is that of the global
    parameters a peer holds then; after the last round the exchange in flight is applied, so every mode ends on the
    same tokens."""
    torch.manual_seed(cfg.seed)
    anchor = {n: t.detach().float().cpu().clone() for n, t in replicas[0].params().items()}
    for rep in replicas[1:]:
        rep.load_params(anchor)
    optimizers = [make_outer(dataclasses.replace(cfg.outer)) for _ in replicas]
    applier = make_outer(dataclasses.replace(cfg.outer))  # holds the (shared, deterministic) outer momentum
    evaluator = build_model(cfg.model).to(device)
    val = val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    shapes = {n: tuple(t.shape) for n, t in anchor.items()}

    def val_loss() -> float:
        with torch.no_grad():
            for n, p in evaluator.named_parameters():
                p.copy_(anchor[n])
        return evaluate(evaluator, val, device)

    history = [{"round": 0, "tokens": 0, "val_loss": val_loss(), "bytes_per_replica": 0, "seconds": 0.0}]
    if on_round:
        on_round(history[-1])
    start = time.perf_counter()
    starts = [anchor] * len(replicas)  # where each replica's inner phase starts (its own under eager overlap)
    pending: list[Contribution] = []  # under overlap: the round still being exchanged during the next phase
    rule = GatherRule(size=cfg.gather)
    standing = Standing(rule.memory)
    accepted_total = 0
    for rnd in range(1, cfg.rounds + 1):
        contributions: list[Contribution] = []
        originals: list[Contribution] = []  # as each replica's optimizer made them, before the wire
        wire = 0
        rest = cfg.inner_steps
        if cfg.overlap == "eager" and cfg.land_after and pending:
            # round rnd-1's exchange finishes land_after steps into phase rnd: its result lands in every replica
            rest -= cfg.land_after
            for rep in replicas:
                rep.train(cfg.land_after)
            anchor, pending = applier.apply(anchor, pending), []
            for i, rep in enumerate(replicas):
                shift = landing_shift(starts[i], anchor)
                rep.load_params({n: p.float().cpu() + shift[n] for n, p in rep.params().items()})
            starts = [anchor] * len(replicas)
        for rep, opt, begin in zip(replicas, optimizers, starts):
            rep.train(rest)
            c = opt.contribute(begin, rep.params(), rep.name, rep.tokens)
            originals.append(c)
            # what the wire carries is what everybody applies: encode, count, decode
            payload = contribution_to_bytes(c, cfg.outer, run="sim", round=rnd, shard=0)
            wire += len(payload)
            contributions.append(contribution_from_bytes(payload, cfg.outer, shapes))
        own = list(contributions)
        if rule.capped:
            chosen = set(select(rnd, {c.sender: frozenset({0}) for c in own}, standing.veterans(rnd), rule))
            standing.record(rnd, chosen)
            if cfg.keep_unselected:
                for opt, mine in zip(optimizers, originals):
                    if mine.sender not in chosen:
                        opt.withdraw(mine)  # left out: it stays in this replica's error feedback for a later round
            contributions = [c for c in contributions if c.sender in chosen]
        accepted_total += len(contributions)
        contributions.sort(key=lambda c: c.sender)
        if cfg.overlap == "none":
            anchor = applier.apply(anchor, contributions)
            starts = [anchor] * len(replicas)
        else:
            # round rnd is exchanged while phase rnd+1 trains: the global parameters advance by round rnd-1
            if pending:
                anchor = applier.apply(anchor, pending)
            pending = contributions
            if rnd == cfg.rounds:  # the last exchange completes after training stops: equal tokens for every mode
                anchor, pending = applier.apply(anchor, pending), []
            starts = [phase_start(cfg.overlap, cfg.outer, anchor, c, len(replicas)) for c in own]
        for rep, begin in zip(replicas, starts):
            rep.load_params(begin)
        record = {
            "round": rnd,
            "tokens": sum(rep.tokens for rep in replicas),
            "val_loss": val_loss(),
            "bytes_per_replica": wire / len(replicas),
            "seconds": round(time.perf_counter() - start, 2),
        }
        history.append(record)
        if on_round:
            on_round(record)
    n_params = sum(t.numel() for t in anchor.values())
    return {
        "history": history,
        "final_val_loss": history[-1]["val_loss"],
        "bytes_per_round_per_replica": history[-1]["bytes_per_replica"],
        "bits_per_param": 8 * history[-1]["bytes_per_replica"] / n_params,
        "params": n_params,
        "tokens": history[-1]["tokens"],
        "seconds": history[-1]["seconds"],
        "accepted_per_round": accepted_total / max(1, cfg.rounds),
    }


def run_single_adamw(
    cfg: EngineConfig, data: PreparedData, device: torch.device, on_round: Callable[[dict[str, Any]], None] | None = None,
    stepper: Callable[[InnerTrainer], Callable[[], float]] | None = None,
) -> dict[str, Any]:
    """The data-parallel ideal: one AdamW run with R times the batch over the same total tokens. ``stepper(trainer)``
    gives the function that takes one step (default: ``trainer.train_step``; a stale-gradient schedule's,
    :mod:`hlbp.peer.sim.stale`)."""
    model = initial_model(cfg.model, cfg.seed)  # the replicas' initial parameters: every method starts alike
    total_steps = cfg.rounds * cfg.inner_steps
    optim = dataclasses.replace(cfg.optim, total_steps=total_steps, grad_accum=cfg.replicas)
    stream = TokenStream(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=0)
    trainer = InnerTrainer(model, optim, micro_batches(stream, cfg.replicas), device)
    step = trainer.train_step if stepper is None else stepper(trainer)
    val = val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    history = [{"round": 0, "tokens": 0, "val_loss": evaluate(model, val, device), "seconds": 0.0}]
    if on_round:
        on_round(history[-1])
    start = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        for _ in range(cfg.inner_steps):
            step()
        history.append({
            "round": rnd, "tokens": trainer.tokens, "val_loss": evaluate(model, val, device),
            "seconds": round(time.perf_counter() - start, 2),
        })
        if on_round:
            on_round(history[-1])
    return {
        "history": history, "final_val_loss": history[-1]["val_loss"], "tokens": trainer.tokens,
        "seconds": history[-1]["seconds"], "bytes_per_round_per_replica": 0,
    }
