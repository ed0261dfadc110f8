"""``hlbp bench convergence``: SparseLoCo against DiLoCo and a single AdamW run at an equal token budget.

Every method starts from the same weights (seed) and sees the same number of tokens: R replicas × rounds × H
inner steps × batch. The single AdamW run takes R times the batch for rounds × H steps, the data-parallel ideal
that no low-communication method can beat on loss; it shows what communicating rarely costs.

Two sweeps. The default ("short", 12 rounds) compares k and the two aggregation forms. ``--long`` is the long
horizon the paper's claims are about: 150 rounds of H = 15 with warm-up over a fraction of the run and cosine to
0.1x, where each method gets its own small tuning sweep (DiLoCo's outer lr; SparseLoCo's k and inner lr, and on
request its α and β), and with ``--ablations`` the density rule for small tensors and median-norm clipping
against their defaults. SparseLoCo runs use the manifest's defaults (aggregation, clipping, small-tensor rule)
unless a row says otherwise. The JSON holds every method's curve, written as each method finishes; next to it a
PNG draws them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hlbp.peer.bench.report import finish_loss_plot, print_table, write_result
from hlbp.peer.bench.verdicts import best_of, noloco_verdict, overlap_verdict, stale_verdict, verdict
from hlbp.peer.data.streams import prepare_data
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.noloco import NoLoCoConfig
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.rounds.overlap import OVERLAPS
from hlbp.peer.sim.engine import EngineConfig, make_full_replicas, run_outer_simulation, run_single_adamw
from hlbp.peer.sim.noloco import run_noloco_simulation
from hlbp.peer.sim.stale import Staleness, StaleReplica, StaleSteps
from hlbp.peer.train.trainer import OptimConfig, pick_device
from hlbp.protocol.manifest import Hyperparameters
from hlbp.protocol.sparse import transmitted_fraction


@dataclass
class ConvergenceBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run, ``long`` is the long horizon."""

    model: str = "tiny"
    replicas: int = 4
    rounds: int = 12
    inner_steps: int = 15
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3  # inner AdamW peak learning rate (DiLoCo's and the single AdamW run's; see lr_mults)
    warmup: int = 20  # warm-up steps of the inner schedule ...
    warmup_frac: float | None = None  # ... or this fraction of the whole run's inner steps (the long horizon)
    eval_batches: int = 8  # validation batches of batch_size x seq_len, the same for every method
    seed: int = 0
    sweep: str = "short"  # "short": the k x aggregation grid; "long": every method's small tuning sweep
    ks: tuple[int, ...] = (32, 64, 128)
    aggregations: tuple[str, ...] = ("mean", "selectors")
    lr_mults: tuple[float, ...] = (1.0, 1.25)  # long sweep: SparseLoCo inner lr as multiples of DiLoCo's
    diloco_lrs: tuple[float, ...] = (0.6, 0.7)  # long sweep: DiLoCo Nesterov outer learning rates
    alphas: tuple[float, ...] = (1.0,)  # SparseLoCo outer learning rates (each one a row of every SparseLoCo sweep)
    betas: tuple[float, ...] = (0.95,)  # SparseLoCo error-feedback decays (likewise)
    clip_median: bool = Hyperparameters.clip_median  # SparseLoCo median-norm clipping (the manifest's default)
    small_tensors: str = Hyperparameters.small_tensors  # SparseLoCo's rule for 1-D tensors (the manifest's)
    only: tuple[str, ...] = ()  # run only methods whose label contains one of these substrings (baselines stay)
    ablations: bool = False  # long sweep: also the small-tensor rule and clipping against their defaults (3 runs)
    diloco_lr: float = 0.7
    diloco_momentum: float = 0.9
    data: str = "builtin"
    vocab_size: int = 8192
    cache_dir: Path | None = None
    device: str = "auto"
    jobs: int = 1  # methods run at once, each in its own process with one torch thread
    print_every: int = 1  # progress line every this many rounds
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls, **overrides: Any) -> ConvergenceBenchConfig:
        base = cls(rounds=3, inner_steps=5, batch_size=4, seq_len=64, warmup=5, ks=(64,))
        return dataclasses.replace(base, **overrides)

    @classmethod
    def long(cls, quick: bool = False, **overrides: Any) -> ConvergenceBenchConfig:
        """The long horizon: 150 rounds of H = 15, warm-up over 5 % of the run then cosine to 0.1x, and a small
        tuning sweep per method (7 runs; ``ablations`` adds 3). Batch 4 x 128 keeps the 4.6M tokens per method near
        one pass over the built-in corpus (3.2M training tokens); each run takes about 16 minutes on one core, so
        the 7 runs about an hour with 2 jobs on 2 cores, 10 with the ablations about 100 minutes. On one H100 with
        16 cores, 14 runs at once (``jobs=14``, sharing the GPU under CUDA MPS) took 6 minutes. ``quick``: 3
        rounds of H = 3."""
        base = cls(rounds=150, inner_steps=15, batch_size=4, seq_len=128, warmup_frac=0.05, eval_batches=32,
                   sweep="long", ks=(64, 128), aggregations=("selectors",))
        if quick:
            base = dataclasses.replace(base, rounds=3, inner_steps=3, seq_len=64, eval_batches=4, ks=(64,))
        else:
            base = dataclasses.replace(base, print_every=10)
        return dataclasses.replace(base, **overrides)

    @classmethod
    def overlap(cls, quick: bool = False, **overrides: Any) -> ConvergenceBenchConfig:
        """Overlapped rounds: DiLoCo and SparseLoCo (k = 64, the manifest's defaults) each without overlap, with a
        naive one-round delay and with eager updates, 30 rounds of H = 30 (the paper's setting for the naive
        penalty). ``quick``: 3 rounds of H = 3."""
        base = cls(rounds=30, inner_steps=30, batch_size=4, seq_len=128, warmup_frac=0.05, eval_batches=32,
                   sweep="overlap", ks=(64,), aggregations=("selectors",), print_every=5)
        if quick:
            base = dataclasses.replace(base, rounds=3, inner_steps=3, seq_len=64, eval_batches=4, print_every=1)
        return dataclasses.replace(base, **overrides)

    @classmethod
    def noloco(cls, quick: bool = False, **overrides: Any) -> ConvergenceBenchConfig:
        """NoLoCo, dense and sparse (k = 64), beside DiLoCo, SparseLoCo and the single AdamW run: 40 rounds of
        H = 15 with R = 4, warm-up over 5 % then cosine to 0.1x. ``quick``: 3 rounds of H = 3."""
        return cls._forty_rounds("noloco", quick, overrides)

    @classmethod
    def state(cls, quick: bool = False, **overrides: Any) -> ConvergenceBenchConfig:
        """A peer's own state in bfloat16: SparseLoCo (k = 64) with float32 error feedback and AdamW moments, with
        bf16 error feedback, with it and AdamW's second moment in bf16, and with it and both moments in bf16,
        beside DiLoCo and the single AdamW run: 40 rounds of H = 15 with R = 4, warm-up over 5 % then cosine to
        0.1x (the NoLoCo sweep's horizon). ``quick``: 3 rounds of H = 3."""
        return cls._forty_rounds("state", quick, overrides)

    @classmethod
    def stale(cls, quick: bool = False, **overrides: Any) -> ConvergenceBenchConfig:
        """Stale inner gradients (what an asynchronous pipeline schedule would apply, :mod:`hlbp.peer.sim.stale`):
        the single AdamW run and SparseLoCo (k = 64), each with fresh gradients, one-step-stale ones and stale ones
        with a weight look-ahead, beside DiLoCo: 40 rounds of H = 15 with R = 4, warm-up over 5 % then cosine to
        0.1x (the NoLoCo sweep's horizon). ``quick``: 3 rounds of H = 3."""
        return cls._forty_rounds("stale", quick, overrides)

    @classmethod
    def _forty_rounds(cls, sweep: str, quick: bool, overrides: dict[str, Any]) -> ConvergenceBenchConfig:
        """The horizon the NoLoCo, state and stale sweeps share: 40 rounds of H = 15 with R = 4 at batch 4 x 128,
        warm-up over 5 % then cosine to 0.1x, SparseLoCo at k = 64 with the selectors; ``quick``: 3 rounds of
        H = 3."""
        base = cls(rounds=40, inner_steps=15, batch_size=4, seq_len=128, warmup_frac=0.05, eval_batches=16,
                   sweep=sweep, ks=(64,), aggregations=("selectors",), print_every=5)
        if quick:
            base = dataclasses.replace(base, rounds=3, inner_steps=3, seq_len=64, eval_batches=4, print_every=1)
        return dataclasses.replace(base, **overrides)

    @property
    def warmup_steps(self) -> int:
        """Warm-up steps of the inner schedule (from ``warmup_frac`` when it is set)."""
        if self.warmup_frac is None:
            return self.warmup
        return max(1, round(self.warmup_frac * self.rounds * self.inner_steps))


@dataclass(frozen=True)
class Method:
    """One run of the benchmark: its label, outer optimizer (None: the single AdamW baseline, or NoLoCo when
    ``noloco`` is set) and inner lr."""

    label: str
    outer: OuterConfig | None
    lr_mult: float = 1.0
    # "adamw", "diloco", "sparseloco" or "noloco": the sweep a method's best is chosen within ("adamw-stale" and
    # "sparseloco-stale": the stale sweep's arms, never a best)
    family: str = "sparseloco"
    overlap: str = "none"  # rounds overlapped with the next inner phase (hlbp.peer.rounds.overlap)
    noloco: NoLoCoConfig | None = None  # pairs instead of rounds (hlbp.peer.rounds.noloco)
    moments: str = "fp32"  # how each replica's inner AdamW stores its moments (OptimConfig.moments)
    staleness: Staleness = Staleness.FRESH  # where each inner step's gradient is taken (hlbp.peer.sim.stale)


def _sparseloco(cfg: ConvergenceBenchConfig, k: int, agg: str, alpha: float | None = None, beta: float | None = None,
                **changes: Any) -> OuterConfig:
    """A SparseLoCo setting of the sweep (α and β: the sweep's first unless given)."""
    alpha = cfg.alphas[0] if alpha is None else alpha
    beta = cfg.betas[0] if beta is None else beta
    base = OuterConfig(kind="sparseloco", k=k, aggregation=agg, alpha=alpha, beta=beta,  # type: ignore[arg-type]
                       clip_median=cfg.clip_median, small_tensors=cfg.small_tensors)
    return dataclasses.replace(base, **changes)


def _ab(alpha: float, beta: float) -> str:
    """The label suffix of a SparseLoCo row whose α or β is not the reference's (1 and 0.95)."""
    return (f" a={alpha:g}" if alpha != 1.0 else "") + (f" b={beta:g}" if beta != 0.95 else "")


def _sparseloco_grid(cfg: ConvergenceBenchConfig, aggs: tuple[str, ...], lr_mults: tuple[float, ...]) -> list[Method]:
    """The SparseLoCo rows of a sweep: every k x aggregation x inner lr multiple x α x β. The label names the
    aggregation in the short sweep and the inner lr in the long one (which runs one aggregation)."""
    return [Method(f"sparseloco k={k} {agg if cfg.sweep == 'short' else 'lr x' + format(m, 'g')}{_ab(a, b)}",
                   _sparseloco(cfg, k, agg, a, b), m)
            for k in cfg.ks for agg in aggs for m in lr_mults for a in cfg.alphas for b in cfg.betas]


def methods(cfg: ConvergenceBenchConfig) -> list[Method]:
    """Every run of the benchmark, baselines first."""
    out = [Method("adamw (1 replica, R x batch)", None, family="adamw")]
    a = _ab(cfg.alphas[0], cfg.betas[0])
    if cfg.sweep == "long":
        for lr in cfg.diloco_lrs:
            out.append(Method(f"diloco outer lr {lr:g}", OuterConfig(kind="diloco", outer_lr=lr,
                                                                    momentum=cfg.diloco_momentum), family="diloco"))
        agg = cfg.aggregations[0]
        out += _sparseloco_grid(cfg, (agg,), cfg.lr_mults)
        if cfg.ablations:
            # the density rule for small tensors and median-norm clipping, each against its default at lr x1
            other = "dense" if cfg.small_tensors == "topk" else "topk"
            for k in cfg.ks:
                out.append(Method(f"sparseloco k={k} lr x1 small {other}{a}",
                                  _sparseloco(cfg, k, agg, small_tensors=other)))
            out.append(Method(f"sparseloco k={cfg.ks[0]} lr x1 clip {'off' if cfg.clip_median else 'on'}{a}",
                              _sparseloco(cfg, cfg.ks[0], agg, clip_median=not cfg.clip_median)))
    elif cfg.sweep == "noloco":
        # NoLoCo beside the round-based methods on the same tokens, seeds and schedule: dense as the paper has it,
        # and with SparseLoCo's payload at the sweep's k
        out.append(Method("diloco", OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr, momentum=cfg.diloco_momentum),
                          family="diloco"))
        out.append(Method(f"sparseloco k={cfg.ks[0]}", _sparseloco(cfg, cfg.ks[0], cfg.aggregations[0])))
        out.append(Method("noloco dense", None, family="noloco", noloco=NoLoCoConfig()))
        out.append(Method(f"noloco sparse k={cfg.ks[0]}", None, family="noloco",
                          noloco=NoLoCoConfig(sparse=True, k=cfg.ks[0], small_tensors=cfg.small_tensors)))
    elif cfg.sweep == "state":
        # the same SparseLoCo with the peer's own state (error feedback, AdamW's moments) in float32 and in bf16
        out.append(Method("diloco", OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr, momentum=cfg.diloco_momentum),
                          family="diloco"))
        k, agg = cfg.ks[0], cfg.aggregations[0]
        out.append(Method(f"sparseloco k={k} fp32 state", _sparseloco(cfg, k, agg)))
        out.append(Method(f"sparseloco k={k} ef bf16", _sparseloco(cfg, k, agg, ef_dtype="bf16")))
        out.append(Method(f"sparseloco k={k} ef+v bf16", _sparseloco(cfg, k, agg, ef_dtype="bf16"),
                          moments="v-bf16"))
        out.append(Method(f"sparseloco k={k} ef+moments bf16", _sparseloco(cfg, k, agg, ef_dtype="bf16"),
                          moments="bf16"))
    elif cfg.sweep == "stale":
        # fresh, one-step-stale and look-ahead gradients, for the single run and for SparseLoCo's replicas
        out.append(Method("diloco", OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr, momentum=cfg.diloco_momentum),
                          family="diloco"))
        for mode in (Staleness.STALE, Staleness.LOOKAHEAD):
            out.append(Method(f"adamw {mode.value}", None, family="adamw-stale", staleness=mode))
        for mode in Staleness:
            family = "sparseloco" if mode is Staleness.FRESH else "sparseloco-stale"  # the verdict's best: fresh
            out.append(Method(f"sparseloco k={cfg.ks[0]} {mode.value}", _sparseloco(cfg, cfg.ks[0],
                              cfg.aggregations[0]), family=family, staleness=mode))
    elif cfg.sweep == "overlap":
        # each outer method without overlap, with a naive one-round delay and with eager updates, same tokens
        dl = OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr, momentum=cfg.diloco_momentum)
        for mode in OVERLAPS:
            out.append(Method(f"diloco overlap {mode}", dl, family="diloco", overlap=mode))
        for mode in OVERLAPS:
            out.append(Method(f"sparseloco k={cfg.ks[0]} overlap {mode}{a}",
                              _sparseloco(cfg, cfg.ks[0], cfg.aggregations[0]), overlap=mode))
    else:
        out.append(Method("diloco fp32", OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr,
                                                     momentum=cfg.diloco_momentum), family="diloco"))
        out += _sparseloco_grid(cfg, cfg.aggregations, (1.0,))
    # the baselines always run; in the overlap sweep DiLoCo's rows are a study of their own, filtered like the rest
    n_base = sum(1 for m in out if m.family == "adamw" or (m.family == "diloco" and cfg.sweep != "overlap"))
    if cfg.only:
        out = out[:n_base] + [m for m in out[n_base:] if any(o in m.label for o in cfg.only)]
    return out


def transmitted_fractions(shapes: dict[str, tuple[int, ...]], k: int, small_tensors: str) -> dict[str, Any]:
    """Per tensor, the share of its values a SparseLoCo contribution carries, and the total over all values."""
    per = {n: transmitted_fraction(s, k, small_tensors) for n, s in shapes.items()}
    numel = {n: math.prod(s) for n, s in shapes.items()}
    total = sum(per[n] * numel[n] for n in shapes) / max(1, sum(numel.values()))
    return {"per_tensor": per, "total": total, "values": round(total * sum(numel.values()))}


def write_plot(path: Path, results: dict[str, Any], meths: list[Method], title: str) -> bool:
    """Validation loss against tokens for every method; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    palette = plt.get_cmap("tab10").colors
    for i, m in enumerate(x for x in meths if x.label in results):
        h = results[m.label]["history"]
        color = "k" if m.family == "adamw" else palette[i % len(palette)]
        ls = {"adamw": "-", "diloco": "-.", "noloco": ":"}.get(
            m.family, "--" if ("small" in m.label or "clip" in m.label) else "-")
        ls = {"naive": ":", "eager": "--"}.get(m.overlap, ls)
        xs, ys = [r["tokens"] / 1e6 for r in h], [r["val_loss"] for r in h]
        for ax in (a, b):
            ax.plot(xs, ys, ls, color=color, lw=1.2, label=m.label)
    b.set_xlim(left=0.5 * max(r["tokens"] for r in results[meths[0].label]["history"]) / 1e6)
    tail = [r["val_loss"] for res in results.values() for r in res["history"][len(res["history"]) // 2:]]
    if tail:
        b.set_ylim(min(tail) - 0.02, max(tail) + 0.02)
    finish_loss_plot(fig, a, b, title, path, legend_size=7)
    return True


def run_method(
    cfg: ConvergenceBenchConfig, m: Method, threads: int | None = None, console: Console | None = None
) -> dict[str, Any]:
    """One method's run: its result with the per-round history, best validation loss and what it transmits."""
    if threads:
        torch.set_num_threads(threads)
    console = console or Console(stderr=True)
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size)
    model = preset(cfg.model, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    optim = OptimConfig(lr=cfg.lr * m.lr_mult, warmup_steps=cfg.warmup_steps, moments=m.moments)
    sim = EngineConfig(
        model=model, outer=m.outer or OuterConfig(), optim=optim, replicas=cfg.replicas, rounds=cfg.rounds,
        inner_steps=cfg.inner_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
        eval_batches=cfg.eval_batches, overlap=m.overlap,
    )

    def show(rec: dict[str, Any]) -> None:
        if rec["round"] % cfg.print_every == 0 or rec["round"] == cfg.rounds:
            console.print(f"  {m.label:36s} round {rec['round']:3d}  val {rec['val_loss']:.4f}  {rec['seconds']:7.1f}s")

    if m.noloco is not None:
        res = run_noloco_simulation(sim, m.noloco, data, make_full_replicas(sim, data, device), device, on_round=show)
    elif m.outer is None:
        stepper = None if m.staleness is Staleness.FRESH else (lambda t: StaleSteps(t, m.staleness).step)
        res = run_single_adamw(sim, data, device, on_round=show, stepper=stepper)
    else:
        replicas = make_full_replicas(sim, data, device)
        if m.staleness is not Staleness.FRESH:
            replicas = [StaleReplica(r, m.staleness) for r in replicas]
        res = run_outer_simulation(sim, data, replicas, device, on_round=show)
    res["best_val_loss"] = min(r["val_loss"] for r in res["history"])
    res["inner_lr"] = optim.lr
    sparse = m.outer if m.outer is not None and m.outer.kind == "sparseloco" else m.noloco
    if sparse is not None and (m.noloco is None or m.noloco.sparse):
        shapes = {n: tuple(t.shape) for n, t in build_model(model).named_parameters()}
        res["transmitted"] = transmitted_fractions(shapes, sparse.k, sparse.small_tensors)
    return res


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit in the main thread, so ``with`` blocks (a worker pool) clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _config_doc(cfg: ConvergenceBenchConfig) -> dict[str, Any]:
    """The settings as stored beside the results: the config, the model's shape and the tokenizer's hash."""
    config = dataclasses.asdict(cfg)
    config["warmup_steps"] = cfg.warmup_steps
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size)
    config["model_config"] = dataclasses.asdict(preset(cfg.model, vocab_size=data.vocab_size,
                                                       max_seq_len=max(cfg.seq_len, 8)))
    config["tokenizer_hash"] = data.tokenizer_hash
    config["torch_threads"] = 1 if cfg.jobs > 1 else torch.get_num_threads()
    return config


def run_convergence_bench(
    cfg: ConvergenceBenchConfig, out: Path | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Run every method, print the table and return (and optionally write) the full JSON document."""
    console = console or Console(stderr=True)
    meths = methods(cfg)
    for m in meths:
        if m.outer is not None:
            m.outer.validate()  # a bad setting (k outside 1..4096) fails before the runs, not after them
        if m.noloco is not None:
            m.noloco.validate()
    config = _config_doc(cfg)
    finished: dict[str, Any] = {}

    def keep(label: str, res: dict[str, Any]) -> None:
        # every finished method is on disk at once: a sweep of hours cut short (a spot machine, a time limit)
        # keeps what it finished ("complete": false until the end)
        finished[label] = res
        if out is not None and len(finished) < len(meths):
            write_result(out, "convergence", config, {"runs": finished, "complete": False})

    if cfg.jobs > 1:
        # one process per method at a time, one torch thread each: the methods are independent and seeded alike
        ctx = multiprocessing.get_context("spawn")
        # the pool's exit terminates its workers, also when SIGTERM ends the run (they used to outlive it and keep
        # two cores busy for an hour)
        with _sigterm_exits(), ctx.Pool(processes=cfg.jobs) as pool:
            runs = [pool.apply_async(run_method, (cfg, m, 1), callback=functools.partial(keep, m.label))
                    for m in meths]
            results = {m.label: r.get() for m, r in zip(meths, runs)}
    else:
        results = {}
        for m in meths:
            results[m.label] = run_method(cfg, m, None, console)
            keep(m.label, results[m.label])
    ref_label = best_of(results, meths, "diloco") or meths[0].label
    dense = max(1.0, results[ref_label]["bytes_per_round_per_replica"])
    ref = results[ref_label]["final_val_loss"]
    rows = []
    for label, res in results.items():
        b = res["bytes_per_round_per_replica"]
        sent = res.get("transmitted", {}).get("total")
        rows.append([
            label, res["final_val_loss"], res["best_val_loss"], res["final_val_loss"] / ref, int(b),
            (dense / b) if b else "-", f"{100 * sent:.2f} %" if sent is not None else "-",
            f"{res['final_spread']:.2e}" if "final_spread" in res else "-", res["seconds"],
        ])
    title = (f"convergence: {cfg.model}, R={cfg.replicas}, H={cfg.inner_steps}, {cfg.rounds} rounds, batch "
             f"{cfg.batch_size}x{cfg.seq_len}, {results[meths[0].label]['tokens']:,} tokens each, warm-up "
             f"{cfg.warmup_steps} steps then cosine to 0.1x")
    print_table(
        console, title,
        ["method", "final val loss", "best val loss", f"final / {ref_label}", "bytes/round/replica",
         "dense/this", "values sent", "spread", "seconds"],
        rows,
    )
    v = overlap_verdict(results, meths) if cfg.sweep == "overlap" else verdict(results, meths)
    if v:
        console.print(v["line"])
    nv = noloco_verdict(results, meths)
    if nv:
        console.print(nv["line"])
    sv = stale_verdict(results, meths)
    if sv:
        console.print(sv["line"])
    doc = write_result(out, "convergence", config, {"runs": results, "verdict": v, "noloco": nv, "stale": sv,
                                                    "complete": True})
    if out is not None and write_plot(Path(out).with_suffix(".png"), results, meths, title):
        console.print(f"plot: {Path(out).with_suffix('.png')}")
    return doc
