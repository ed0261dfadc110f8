"""``hlbp bench activations``: what each activation codec costs and loses at a stage boundary.

For the dense codecs and for every subspace variant and k/d, a pipeline replica of the run's model (the
constrained network for the variants A) trains a few inner steps with that codec, takes one SparseLoCo outer step
and loads its result, so the measurement also covers the state right after an outer step. Then, on a validation
batch, at every boundary:

- bytes per token each way, from real frames of :mod:`hlbp.protocol.activations` (header amortised);
- encode and decode time per frame;
- forward reconstruction error ‖ĥ − h‖/‖h‖ and backward ‖ĝ − g‖/‖g‖ against the uncompressed pipeline;
- the energy of h − T_fixed[x] that span(U) keeps, and for the variants A the invariant ‖(h − T[x])(I − UUᵀ)‖;
- the error of all parameter gradients of a full forward/backward through the codecs: the end-to-end measure,
  since variant A's boundary gradient loses only directions that no parameter's gradient depends on.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.data.streams import TokenStream, prepare_data, val_batches
from hlbp.peer.model.basis import off_span
from hlbp.peer.model.codec import SHORT_NAMES, CodecConfig
from hlbp.peer.model.decoder import preset
from hlbp.peer.model.pipeline import PipelineModel, initial_state, run_model_config
from hlbp.peer.model.subspace import CONSTRAINED, VARIANTS, SubspaceCodec, make_codec
from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo
from hlbp.peer.sim.pipeline import PipelineReplica, make_replica
from hlbp.peer.train.trainer import OptimConfig, micro_batches, pick_device

LOSSLESS_REL_ERR = 1e-5  # variant A over an fp32 wire must reconstruct this well to count as lossless


@dataclass
class ActivationsBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run."""

    model: str = "tiny"  # model preset
    stages: int = 4  # pipeline stages, so stages - 1 boundaries are measured
    ratios: tuple[str, ...] = ("1/8", "1/32", "1/128")  # k/d of the subspace codecs
    variants: tuple[str, ...] = VARIANTS  # subspace codecs to measure
    dense_dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")  # wire dtypes of the dense codec
    subspace_dtypes: tuple[str, ...] = ("fp32", "bf16")  # wire dtypes of the subspace codecs
    train_steps: int = 10  # inner steps under each codec (and its constraints) before measuring
    batch_size: int = 8  # sequences per frame and inner step
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak inner learning rate
    warmup: int = 5  # inner warm-up steps
    repeats: int = 10  # timing repetitions per frame; the median is reported
    seed: int = 0  # init, data, U and T_fixed
    data: str = "builtin"  # corpus spec
    vocab_size: int = 8192  # tokenizer size when one is trained
    cache_dir: Path | None = None  # data cache; None: the user cache
    device: str = "auto"  # auto, cpu or cuda[:N]

    @classmethod
    def quick(cls, **overrides: Any) -> ActivationsBenchConfig:
        base = cls(train_steps=2, batch_size=4, seq_len=64, warmup=1, repeats=3)
        return dataclasses.replace(base, **overrides)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _exact(model: PipelineModel, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                              dict[str, torch.Tensor]]:
    """Boundary states, boundary gradients and parameter gradients of the pipeline without any codec."""
    model.zero_grad(set_to_none=True)
    states, h = [], model.stages[0](x)
    for stage in model.stages[1:]:
        h.retain_grad()
        states.append(h)
        h = stage(h)
    model.loss(h, y).backward()
    grads = [s.grad.detach().clone() for s in states]
    params = {n: p.grad.detach().clone() for n, p in model.shard_parameters().items() if p.grad is not None}
    return [s.detach() for s in states], grads, params


def _param_grad_error(model: PipelineModel, x: torch.Tensor, y: torch.Tensor, exact: dict[str, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    model.loss(model(x), y).backward()
    got = model.shard_parameters()
    num = sum(float((got[n].grad.double() - g.double()).pow(2).sum()) for n, g in exact.items())
    den = sum(float(g.double().pow(2).sum()) for g in exact.values())
    return (num / max(den, 1e-300)) ** 0.5


def _trained_replica(cfg: ActivationsBenchConfig, data: Any, base_model: Any, codec: CodecConfig,
                     device: torch.device) -> PipelineReplica:
    """A pipeline replica trained a few steps under ``codec``, then moved through one SparseLoCo outer step."""
    config = run_model_config(base_model, codec, cfg.stages)
    state = initial_state(base_model, cfg.seed)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup, total_steps=max(cfg.train_steps, 1))
    stream = TokenStream(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=0)
    rep = make_replica("bench", config, codec, cfg.stages, state, optim, micro_batches(stream, 1), device)
    rep.train(cfg.train_steps)
    outer = SparseLoCo(OuterConfig())
    anchor = {n: t.float().cpu() for n, t in state.items()}
    contribution = outer.contribute(anchor, rep.params(), rep.name, rep.tokens)
    rep.load_params(outer.apply(anchor, [contribution]))
    return rep


def _measure(cfg: ActivationsBenchConfig, rep: PipelineReplica, codec: CodecConfig, x: torch.Tensor,
             y: torch.Tensor) -> dict[str, Any]:
    """Every number of one row: ``codec`` swapped in at every boundary of the trained replica."""
    model = rep.model
    config = model.stages[0].config
    embed = model.stages[0].embed.weight.detach()
    base = getattr(model.stages[0], "fixed_table", None)
    codecs = [make_codec(codec, config.d_model, config.vocab_size, config.max_seq_len, base, embed)
              for _ in model.codecs]
    trained = model.codecs[0]
    for c in codecs:  # the replica's own T_fixed, as rebuilt after its outer step
        if isinstance(c, SubspaceCodec) and isinstance(trained, SubspaceCodec):
            c.set_table(trained.table)
    codecs = [c.to(x.device) for c in codecs]
    states, grads, exact_params = _exact(model, x, y)
    tokens = x.numel()
    rows: list[dict[str, Any]] = []
    for c, h, g in zip(codecs, states, grads):
        fwd = c.encode_forward(h, x)
        bwd = c.encode_backward(g)
        row = {
            "forward_bytes_per_token": len(fwd) / tokens,
            "backward_bytes_per_token": len(bwd) / tokens,
            "encode_forward_ms": 1e3 * _median_s(lambda c=c, h=h: c.encode_forward(h, x), cfg.repeats),
            "decode_forward_ms": 1e3 * _median_s(lambda c=c, fwd=fwd: c.decode_forward(fwd), cfg.repeats),
            "encode_backward_ms": 1e3 * _median_s(lambda c=c, g=g: c.encode_backward(g), cfg.repeats),
            "decode_backward_ms": 1e3 * _median_s(lambda c=c, bwd=bwd: c.decode_backward(bwd), cfg.repeats),
            "forward_rel_err": _rel(c.decode_forward(fwd).tensor, h),
            "backward_rel_err": _rel(c.decode_backward(bwd).tensor, g),
        }
        if isinstance(c, SubspaceCodec):
            resid = h - c.table[x]
            row["energy_kept"] = 1.0 - float(off_span(resid, c.basis).pow(2).sum() / resid.pow(2).sum())
            row["off_span_rel"] = float(off_span(resid, c.basis).norm() / resid.norm())
        rows.append(row)
    original = model.codecs
    model.codecs = nn.ModuleList(codecs)
    param_err = _param_grad_error(model, x, y, exact_params)
    model.codecs = original
    # bytes and errors: the worst boundary; times: the median boundary, so one scheduler hiccup does not set them
    worst = {key: (statistics.median if key.endswith("_ms") else max)(r[key] for r in rows) for key in rows[0]}
    result = {
        "codec": codec.kind,
        "wire_dtype": codec.dtype,
        "ratio": None if codec.kind == "dense" else codec.rank,
        "k": codec.k(config.d_model),
        "d_model": config.d_model,
        "tokens_per_frame": tokens,
        "boundaries": rows,
        "param_grad_rel_err": param_err,
        **{(f"median_{k}" if k.endswith("_ms") else f"max_{k}"): v for k, v in worst.items()},
    }
    if codec.kind in CONSTRAINED and codec.dtype in ("fp32", "fp64"):
        result["lossless"] = worst["forward_rel_err"] < LOSSLESS_REL_ERR
    return result


def run_activations_bench(
    cfg: ActivationsBenchConfig, out: Path | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Measure every codec, print the table and return (and optionally write) the full JSON document."""
    console = console or Console(stderr=True)
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size)
    base_model = preset(cfg.model, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    x, y = (t.to(device) for t in val_batches(data.val, cfg.seq_len, cfg.batch_size, 1)[0])
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    plans: list[tuple[CodecConfig, list[CodecConfig]]] = [
        (CodecConfig("dense", seed=cfg.seed), [CodecConfig("dense", wire_dtype=d, seed=cfg.seed)
                                               for d in cfg.dense_dtypes])
    ]
    for variant in cfg.variants:
        for ratio in cfg.ratios:
            trained = CodecConfig(variant, ratio, seed=cfg.seed)
            plans.append((trained, [dataclasses.replace(trained, wire_dtype=d) for d in cfg.subspace_dtypes]))
    for trained_with, measured in plans:
        rep = _trained_replica(cfg, data, base_model, trained_with, device)
        for codec in measured:
            res = _measure(cfg, rep, codec, x, y)
            res["label"] = codec.label(base_model.d_model)
            results.append(res)
            console.print(f"  {res['label']:24s} fwd {res['max_forward_bytes_per_token']:8.2f} B/token  "
                          f"rel err {res['max_forward_rel_err']:.2e}  {time.perf_counter() - start:6.1f}s")
    dense_bf16 = next((r["max_forward_bytes_per_token"] for r in results
                       if r["codec"] == "dense" and r["wire_dtype"] == "bf16"), None)
    rows = []
    for r in results:
        rows.append([
            r["label"], r["max_forward_bytes_per_token"], r["max_backward_bytes_per_token"],
            (dense_bf16 / r["max_forward_bytes_per_token"]) if dense_bf16 else "-",
            f"{r['median_encode_forward_ms']:.3f}/{r['median_decode_forward_ms']:.3f}",
            f"{r['median_encode_backward_ms']:.3f}/{r['median_decode_backward_ms']:.3f}",
            r["max_forward_rel_err"], r["max_backward_rel_err"], r["param_grad_rel_err"],
            r.get("max_energy_kept", 1.0), {True: "yes", False: "NO"}.get(r.get("lossless"), "-"),
        ])
    print_table(
        console,
        f"activations: {cfg.model} (d={base_model.d_model}), worst of {cfg.stages - 1} boundaries (times: median), "
        f"{x.numel()} tokens/frame, after {cfg.train_steps} inner steps + 1 SparseLoCo step",
        ["codec", "fwd B/tok", "bwd B/tok", "bf16/this", "fwd enc/dec ms", "bwd enc/dec ms", "fwd rel err",
         "bwd rel err", "param-grad err", "energy kept", "lossless"],
        rows,
    )
    config = dataclasses.asdict(cfg)
    config["model_config"] = dataclasses.asdict(base_model)
    config["tokenizer_hash"] = data.tokenizer_hash
    config["torch_threads"] = torch.get_num_threads()
    config["variant_names"] = SHORT_NAMES
    return write_result(out, "activations", config, {"rows": results, "seconds": time.perf_counter() - start})
