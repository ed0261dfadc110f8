"""``hlbp bench codec``: size, speed and error of every contribution format on real and synthetic inputs.

Inputs:

- Real: a model preset trained for ``warmup_steps`` AdamW steps, then ``rounds`` outer rounds of
  ``inner_steps`` steps as a single SparseLoCo replica (k = ``trajectory_k``). Every round but the last only
  fills the error-feedback (EF) buffers; the last round's Δ = θ0 − θ is measured. That is the message a peer
  really sends in steady state: the compressed tensor is ``e = β·e_prev + Δ``, not Δ alone.
- Synthetic: ``synthetic_tensors`` i.i.d. Gaussian matrices (about 100M values by default), one independent
  draw per round; the Gaussian is the hardest case for the index coder, since its top-k positions are uniform.

Rows, all from the same run and the same input: SparseLoCo with the entropy index format at each k of
``entropy_ks`` and with the reference packed12 format at each k of ``packed12_ks``; dense fp32 and bf16
(DiLoCo's wire formats); and zstd alone over the fp32 safetensors bytes, to show what a general-purpose
compressor gets from float noise. Sparse and dense rows go through the real wire path
(:func:`hlbp.peer.rounds.contribution.contribution_to_bytes` and back), so their byte counts include the envelope; the zstd
row is a bare frame without one.

Columns:

- bits per parameter of the whole payload, and the compression ratio against dense fp32;
- encode seconds: the outer optimizer's ``contribute`` (pseudo-gradient, EF update, top-k, 2-bit quantisation
  for SparseLoCo; pseudo-gradient and cast for dense) plus serialisation; median of ``repeats`` runs from the
  same state, after one cold run that is kept apart in the JSON (first-touch page faults of fresh buffers and
  lazy initialisation make it several times slower, and by an amount that depends on the allocator's history);
- decode seconds: parsing and validating the untrusted bytes plus rebuilding dense float32 tensors, the form
  every receiver aggregates; median likewise;
- relative error ``||x − x̂|| / ||x||`` over the whole payload, against the EF input ``e`` that SparseLoCo
  compressed and against Δ. The second is large by design: SparseLoCo sends the largest entries of ``e``, part
  of which is earlier rounds' residual, and keeps the rest of Δ for later rounds.

On a machine shared with other work, time with ``--threads 1``: with more torch threads than free cores, each
of the many small ops of the sparse codec waits for a descheduled thread, which made SparseLoCo's encode up to
10x slower on 2 busy cores, while the few large ops of the dense rows barely noticed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zstandard
from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data.streams import PreparedData, TokenStream, prepare_data
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.outer import DiLoCo, OuterConfig, SparseLoCo, pseudo_gradient
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, micro_batches, pick_device
from hlbp.protocol.dense import decode_dense, encode_dense
from hlbp.protocol.sparse import decompress

Tensors = dict[str, torch.Tensor]
clock = time.perf_counter

RUN, ROUND, SHARD = "bench-codec", 1, 0
# As long as a libp2p peer id, so the envelope header has its real size.
SENDER = "12D3KooW" + "b" * 44


@dataclass
class CodecBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run."""

    models: tuple[str, ...] = ("tiny", "small")  # presets whose real pseudo-gradients are measured
    warmup_steps: int = 20  # AdamW steps (and lr warm-up) before the first outer round
    inner_steps: int = 15  # H: AdamW steps per outer round
    rounds: int = 2  # outer rounds; all but the last fill the EF buffers, the last is measured
    trajectory_k: int = 64  # k of the SparseLoCo outer step the replica takes between rounds
    batch_size: int = 8  # sequences per AdamW step of the real inputs
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak AdamW learning rate
    schedule_steps: int = 1000  # cosine length; longer than the run, so the measured rounds sit near peak lr
    synthetic_tensors: int = 24  # Gaussian matrices of the synthetic input (0: no synthetic input)
    synthetic_shape: tuple[int, int] = (2048, 2048)  # shape of each of them
    entropy_ks: tuple[int, ...] = (32, 64, 128)  # k per 4096 measured with the entropy index format
    packed12_ks: tuple[int, ...] = (64,)  # k per 4096 measured with the reference packed12 format
    repeats: int = 3  # warm runs per row, after one cold run that is reported apart; the median is shown
    zstd_level: int = 3  # level of the zstd-only row
    seed: int = 0  # model init, data windows and the synthetic draws
    data: str = "builtin"  # corpus spec for the real inputs, as hlbp.peer.data.streams reads it
    vocab_size: int = 8192  # tokenizer size, and so the embedding and head sizes
    cache_dir: Path | None = None  # corpus and tokenizer cache; None: hlbp.peer.data.streams's default
    device: str = "auto"  # where the real inputs are trained; every codec runs on the CPU, as peers run it

    def validate(self) -> None:
        """Refuse settings that would measure nothing or fail halfway through."""
        if self.rounds < 1 or self.inner_steps < 1 or self.warmup_steps < 0 or self.repeats < 1:
            raise UserInputError("--rounds, --inner-steps and --repeats must be >= 1 and --warmup-steps >= 0")
        if self.synthetic_tensors < 0 or len(self.synthetic_shape) != 2 or min(self.synthetic_shape) < 1:
            raise UserInputError("synthetic_tensors must be >= 0 and synthetic_shape two positive dims")
        for k in (*self.entropy_ks, *self.packed12_ks, self.trajectory_k):
            if not 1 <= k <= 4096:
                raise UserInputError(f"k must be in 1..4096 (values kept per 4096), got {k}")
        if not self.models and not self.synthetic_tensors:
            raise UserInputError("nothing to measure: give at least one model or a synthetic input")

    @classmethod
    def quick(cls, **overrides: Any) -> CodecBenchConfig:
        """The tiny model only, a few short steps, and about 10M synthetic values."""
        base = cls(
            models=("tiny",), warmup_steps=5, inner_steps=5, batch_size=4, seq_len=64, synthetic_tensors=10,
            synthetic_shape=(1024, 1024), repeats=2,
        )
        return dataclasses.replace(base, **overrides)


@dataclass
class CodecInput:
    """One pseudo-gradient to encode, with those of the rounds before it, which fill the EF buffers."""

    name: str
    anchor: Tensors  # θ at the start of the measured round (float32, CPU)
    local: Tensors  # θ at its end; anchor − local is the measured Δ
    earlier: list[Tensors]  # Δ of the earlier rounds, oldest first
    tokens: int  # tokens behind the measured round, carried in the envelope
    info: dict[str, Any] = field(default_factory=dict)  # what the input is, for the JSON

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected tensor shapes, as a receiver knows them from the run manifest."""
        return {n: tuple(t.shape) for n, t in self.anchor.items()}

    @property
    def params(self) -> int:
        """Number of values in the pseudo-gradient."""
        return sum(t.numel() for t in self.anchor.values())


def _zeros_like(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """Broadcast zeros without memory: the ``local`` of an input that is its own pseudo-gradient."""
    return {n: torch.zeros((), dtype=torch.float32).expand(t.shape) for n, t in tensors.items()}


def _snapshot(model: torch.nn.Module) -> Tensors:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def real_input(name: str, cfg: CodecBenchConfig, data: PreparedData, device: torch.device,
               log: Callable[[str], None] = lambda _: None) -> CodecInput:
    """Train preset ``name`` as one SparseLoCo replica; return its last round's (θ0, θ) and the earlier Δs."""
    torch.manual_seed(cfg.seed)
    model_cfg = preset(name, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    model = build_model(model_cfg)
    stream = TokenStream(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.schedule_steps)
    trainer = InnerTrainer(model, optim, micro_batches(stream, 1), device)
    start = time.perf_counter()
    for _ in range(cfg.warmup_steps):
        trainer.train_step()
    outer = SparseLoCo(OuterConfig(k=cfg.trajectory_k))
    earlier: list[Tensors] = []
    losses: list[float] = []
    for rnd in range(1, cfg.rounds + 1):
        anchor, round_start_tokens = _snapshot(model), trainer.tokens
        losses.append(sum(trainer.train_step() for _ in range(cfg.inner_steps)) / cfg.inner_steps)
        local = _snapshot(model)
        if rnd < cfg.rounds:
            earlier.append(pseudo_gradient(anchor, local))
            step = outer.apply(anchor, [outer.contribute(anchor, local)])
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(step[n])
    seconds = time.perf_counter() - start
    steps = cfg.warmup_steps + cfg.rounds * cfg.inner_steps
    shown = " ".join(f"{x:.3f}" for x in losses)
    log(f"  {name}: {steps} AdamW steps in {seconds:.1f}s, train loss per round {shown}")
    info = {
        "kind": "real", "model": name, "model_config": dataclasses.asdict(model_cfg),
        "warmup_steps": cfg.warmup_steps, "inner_steps": cfg.inner_steps, "rounds": cfg.rounds,
        "train_loss_per_round": losses, "train_seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / steps, 3),
    }
    return CodecInput(name, anchor, local, earlier, trainer.tokens - round_start_tokens, info)


def synthetic_input(cfg: CodecBenchConfig) -> CodecInput:
    """I.i.d. N(0, 1) pseudo-gradients, an independent draw per round; the measured one is its own anchor."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = tuple(cfg.synthetic_shape)

    def draw() -> Tensors:
        return {f"synthetic.{i}": torch.randn(shape, generator=g) for i in range(cfg.synthetic_tensors)}

    earlier = [draw() for _ in range(cfg.rounds - 1)]
    anchor = draw()
    info = {"kind": "synthetic", "distribution": "iid N(0, 1)", "tensors": cfg.synthetic_tensors,
            "shape": list(shape)}
    return CodecInput("synthetic", anchor, _zeros_like(anchor), earlier, 0, info)


def _ef_after(inp: CodecInput, ocfg: OuterConfig) -> Tensors:
    """The EF buffers of a SparseLoCo replica that sent the input's earlier rounds."""
    opt = SparseLoCo(ocfg)
    for delta in inp.earlier:
        opt.contribute(delta, _zeros_like(delta))
    return opt.ef


def _rel_err(ref: Mapping[str, torch.Tensor], approx: Mapping[str, torch.Tensor]) -> float:
    """``||ref − approx|| / ||ref||`` over all tensors together, accumulated in float64."""
    num = den = 0.0
    for n, r in ref.items():
        num += float(torch.linalg.vector_norm((r - approx[n]).double()) ** 2)
        den += float(torch.linalg.vector_norm(r.double()) ** 2)
    return math.sqrt(num / den) if den > 0 else 0.0


def _row(label: str, payload_bytes: int, inp: CodecInput, times: dict[str, list[float]], **extra: Any
         ) -> dict[str, Any]:
    """A result row: size, median warm times, the cold first run, every sample, and the row's own fields."""
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    cold = {k: v[0] for k, v in times.items()}
    return {
        "format": label, "bytes": payload_bytes, "bits_per_param": 8 * payload_bytes / inp.params,
        "encode_s": med["message_s"] + med["serialize_s"], "decode_s": med["parse_s"] + med["densify_s"],
        "cold_encode_s": cold["message_s"] + cold["serialize_s"],
        "cold_decode_s": cold["parse_s"] + cold["densify_s"],
        **med, "samples": times, **extra,
    }


def _record(times: dict[str, list[float]], *stamps: float) -> None:
    """Append the four phase durations between five ``perf_counter`` stamps."""
    for key, t0, t1 in zip(("message_s", "serialize_s", "parse_s", "densify_s"), stamps, stamps[1:]):
        times.setdefault(key, []).append(t1 - t0)


def measure_sparse(inp: CodecInput, k: int, fmt: str, ef: Tensors, repeats: int) -> dict[str, Any]:
    """SparseLoCo at ``k`` in index format ``fmt``; every run starts from the same EF buffers ``ef``."""
    ocfg = OuterConfig(k=k)
    delta = pseudo_gradient(inp.anchor, inp.local)
    # what contribute compresses, computed with the same float32 operations
    e_in = {n: ef[n] * ocfg.beta + d if n in ef else d for n, d in delta.items()}
    times: dict[str, list[float]] = {}
    for _ in range(1 + repeats):  # the first run is the cold one
        opt = SparseLoCo(ocfg)
        opt.ef = {n: t.clone() for n, t in ef.items()}
        t0 = clock()
        c = opt.contribute(inp.anchor, inp.local, SENDER, inp.tokens)
        t1 = clock()
        payload = contribution_to_bytes(c, ocfg, RUN, ROUND, SHARD, index_format=fmt)
        t2 = clock()
        back = contribution_from_bytes(payload, ocfg, inp.shapes, RUN, ROUND, SHARD)
        t3 = clock()
        recon = {n: decompress(s) for n, s in back.tensors.items()}
        _record(times, t0, t1, t2, t3, clock())
    exact = all(torch.equal(recon[n], decompress(s)) for n, s in c.tensors.items())
    nnz = sum(s.nnz for s in c.tensors.values())
    return _row(
        f"sparseloco k={k} {fmt}", len(payload), inp, times, k=k, index_format=fmt, nnz=nnz,
        bits_per_kept_value=8 * len(payload) / max(1, nnz), rel_err_vs_e=_rel_err(e_in, recon),
        rel_err_vs_delta=_rel_err(delta, recon), round_trip_exact=exact,
    )


def measure_dense(inp: CodecInput, wire_dtype: str, repeats: int) -> dict[str, Any]:
    """DiLoCo's dense wire format; what it decodes to is already the dense float32 that receivers use."""
    ocfg = OuterConfig(kind="diloco", wire_dtype=wire_dtype)  # type: ignore[arg-type]
    delta = pseudo_gradient(inp.anchor, inp.local)
    times: dict[str, list[float]] = {}
    for _ in range(1 + repeats):  # the first run is the cold one
        t0 = clock()
        c = DiLoCo(ocfg).contribute(inp.anchor, inp.local, SENDER, inp.tokens)
        t1 = clock()
        payload = contribution_to_bytes(c, ocfg, RUN, ROUND, SHARD)
        t2 = clock()
        back = contribution_from_bytes(payload, ocfg, inp.shapes, RUN, ROUND, SHARD)
        t3 = clock()
        _record(times, t0, t1, t2, t3, t3)
    exact = all(torch.equal(back.tensors[n], c.tensors[n].float()) for n in delta)
    err = _rel_err(delta, back.tensors)
    return _row(f"dense {wire_dtype}", len(payload), inp, times, rel_err_vs_e=err, rel_err_vs_delta=err,
                round_trip_exact=exact)


def measure_zstd(inp: CodecInput, level: int, repeats: int) -> dict[str, Any]:
    """zstd at ``level`` straight over the fp32 safetensors bytes: a bare frame, no envelope."""
    ocfg = OuterConfig(kind="diloco", wire_dtype="fp32")
    delta = pseudo_gradient(inp.anchor, inp.local)
    times: dict[str, list[float]] = {}
    for _ in range(1 + repeats):  # the first run is the cold one
        t0 = clock()
        c = DiLoCo(ocfg).contribute(inp.anchor, inp.local, SENDER, inp.tokens)
        t1 = clock()
        frame = zstandard.ZstdCompressor(level=level).compress(encode_dense(c.tensors, "fp32"))
        t2 = clock()
        back = decode_dense(zstandard.ZstdDecompressor().decompress(frame), inp.shapes, "fp32")
        t3 = clock()
        _record(times, t0, t1, t2, t3, t3)
    exact = all(torch.equal(back[n], delta[n]) for n in delta)
    err = _rel_err(delta, back)
    return _row(f"zstd-{level} fp32", len(frame), inp, times, rel_err_vs_e=err, rel_err_vs_delta=err,
                round_trip_exact=exact)


def measure_input(inp: CodecInput, cfg: CodecBenchConfig, log: Callable[[str], None] = lambda _: None
                  ) -> dict[str, dict[str, Any]]:
    """Every row for one input, keyed by format label, in table order."""
    rows: dict[str, dict[str, Any]] = {}
    for k in sorted(set(cfg.entropy_ks) | set(cfg.packed12_ks)):
        ef = _ef_after(inp, OuterConfig(k=k))
        for fmt, ks in (("entropy", cfg.entropy_ks), ("packed12", cfg.packed12_ks)):
            if k in ks:
                row = measure_sparse(inp, k, fmt, ef, cfg.repeats)
                rows[row["format"]] = row
                log(f"  {inp.name}: {row['format']:28s} {row['bits_per_param']:.4f} bits/param")
        del ef
    for row in (measure_dense(inp, "fp32", cfg.repeats), measure_dense(inp, "bf16", cfg.repeats),
                measure_zstd(inp, cfg.zstd_level, cfg.repeats)):
        rows[row["format"]] = row
        log(f"  {inp.name}: {row['format']:28s} {row['bits_per_param']:.4f} bits/param")
    fp32 = rows["dense fp32"]["bytes"]
    for row in rows.values():
        row["ratio_vs_fp32"] = fp32 / row["bytes"]
    return rows


def _inputs(cfg: CodecBenchConfig, data: PreparedData | None, device: torch.device, log: Callable[[str], None]
            ) -> Iterator[CodecInput]:
    """The inputs one after another, so that only one is in memory at a time (the synthetic one is 400 MB)."""
    for name in cfg.models:
        assert data is not None  # prepared whenever a model is asked for
        yield real_input(name, cfg, data, device, log)
    if cfg.synthetic_tensors > 0:
        yield synthetic_input(cfg)


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on every platform
        return None


def _table_row(r: dict[str, Any]) -> list[str]:
    """Fixed decimals, so the table fits 80 columns; the JSON keeps full precision."""
    return [
        r["format"].removeprefix("sparseloco "), f"{r['bits_per_param']:.4f}", f"{r['ratio_vs_fp32']:.1f}",
        f"{r['encode_s']:.3f}", f"{r['decode_s']:.3f}",
        f"{r['rel_err_vs_e']:.4f}", f"{r['rel_err_vs_delta']:.4f}",
    ]


def _fmt_load(load: list[float] | None) -> str:
    return " ".join(f"{x:.2f}" for x in load) if load else "n/a"


def run_codec_bench(
    cfg: CodecBenchConfig, out: Path | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Measure every input, print a table per input, and return (and optionally write) the JSON document."""
    cfg.validate()
    console = console or Console(stderr=True)
    start, load_start = time.perf_counter(), _load_average()
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size) if cfg.models else None
    inputs: dict[str, Any] = {}
    for inp in _inputs(cfg, data, device, console.print):
        rows = measure_input(inp, cfg, console.print)
        inputs[inp.name] = {"params": inp.params, "tensors": len(inp.anchor), "tokens": inp.tokens,
                            "info": inp.info, "rows": rows}
        del inp  # let it go before the next one is built
    load_end = _load_average()
    for name, res in inputs.items():
        print_table(
            console,
            f"codec: {name}, {res['params'] / 1e6:.2f}M params, {cfg.repeats} repeats (median), "
            f"load average {_fmt_load(load_start)} -> {_fmt_load(load_end)}",
            ["format", "bits/param", "vs fp32", "enc s", "dec s", "err e", "err Δ"],
            [_table_row(r) for r in res["rows"].values()],
        )
    config = dataclasses.asdict(cfg)
    config["tokenizer_hash"] = data.tokenizer_hash if data is not None else None
    config["torch_threads"] = torch.get_num_threads()
    result = {"inputs": inputs, "load_average": {"start": load_start, "end": load_end},
              "seconds": round(time.perf_counter() - start, 2)}
    return write_result(out, "codec", config, result)
