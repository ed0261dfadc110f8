"""``hlbp bench pipeline``: one pipeline swarm over emulated WAN links, once per activation codec.

Why: ``hlbp bench activations`` counts the bytes a codec puts on a stage boundary; this benchmark asks what those
bytes buy on the real stack when the links are the bottleneck: tokens per second, how busy the slowest stage is,
and whether the model still learns as well after the same number of tokens.

Setup, per codec: a bootstrap and ``stages`` ``hlbp join --role stage`` processes on loopback, each with its own
p2pd, built by :class:`~hlbp.peer.sim.launcher.Swarm` (the codec is in the signed manifest, so every codec gets a
fresh swarm). Every peer sits behind :mod:`hlbp.peer.net.wanlink`'s proxy (``wan_delay_ms`` one way,
``wan_mbps`` per direction), so every stage boundary crosses an emulated internet link. Stages 1..S-1 start
first; stage 0 drives ``steps`` inner steps of ``batch_size`` x ``seq_len`` tokens, each split into
``micro_batches`` micro-batches of which up to ``in_flight`` are in the chain at once, and evaluates the
validation loss before the first and after the last step (so every codec is compared after the same tokens).

What is reported per codec (all from the driver's ``summary.json`` and ``metrics.jsonl``):

- tokens/s: training tokens over the sum of the steps' wall times (evaluation and start-up excluded), and its
  ratio to dense bf16 in the same run;
- bytes per token per boundary, each way: the bytes of whole ``fwd`` messages (length prefixes, header, activation
  frame, targets) the driver sent on its stage stream, and of ``bwd`` messages it received, over the training
  tokens (:meth:`~hlbp.peer.swarm.links.StageLinks.byte_totals`). That is boundary 0; every boundary carries the same
  codec and the targets, so the others carry the same bytes. Beside it the payload formula (k values in the wire
  dtype, token ids for the subspace codecs, and the 2-byte targets forward) and the proxies' wire bytes (all
  connections through every proxy: libp2p framing, DHT and evaluation traffic included) per token and boundary;
- the bottleneck stage's busy fraction: the largest compute seconds of any stage (as the stages report them to the
  driver) over the training wall time. The driver's own figure counts only its backward passes;
- the validation loss after ``steps`` steps.

The default link rate, 1 Mbit/s per direction (:data:`DEFAULT_WAN_MBPS`), makes dense bf16 link-bound on this
2-core CPU: at d_model = 128 a dense boundary moves about 259 B per token forward (and 256 back), so 1 Mbit/s caps
it near 480 tokens/s, while the three stages compute 3,000-3,800 tokens/s with a small codec. That is the ratio a
real run sees (an H100 stage of a 7B model computes tens of thousands of tokens/s; 8 KB per token of bf16
activations over a 100 Mbit/s link is 1,500 tokens/s), scaled down to this machine's compute. Steps are large
(64 x 64 tokens in 16 micro-batches) so each step's fill and drain (the norms ride up with the last backward, the
driver's ``apply`` goes down ahead of the next step's micro-batches) is amortized.

What limits the measured numbers (default run): the last stage, which holds the LM head, does most of the work
(with 4 layers in 3 stages no split is lighter) and is busy about 85 % with k/d = 1/128; the rest is each step's
fill and drain, and the three stage processes, four p2pd daemons and the proxies share 2 cores. With k/d = 1/32
the codecs are link-bound again: a peer's proxy carries every connection it accepted, and stage 1's carried both
boundaries, so forward of one and backward of the other (about 37 B/token) shared one emulated 1 Mbit/s direction
(``proxy_bytes`` in the JSON shows it).

Several peers on one stage (``stage_peers`` 1,2: each codec runs once per count, back to back): the peers of the
``slow_stage`` each take ``slow_stage_factor`` times as long over every training pass and announce that much less
throughput (:mod:`hlbp.cli.slowstage`, a slow device that sleeps the difference, so it does not take the shared cores
from the others, as a thread limit would on a machine with cores to spare), so that stage is the bottleneck; with two
of them the driver (``--stage-peers``) splits each step's micro-batches between them and they trade gradients at its
end (:mod:`hlbp.peer.swarm.siblings`), where the trade pays: the trade is a dense fp32 gradient of the stage each
step, and over links too slow for it (``wan_mbps`` 1: tiny's middle stage takes ten seconds) the driver keeps one
peer on the stage. ``served_by`` in each row says how many peers the slow stage had at most in a step.

The driving peer's identity is derived from the seed (:func:`driver_identity`): its data order follows its key,
so every codec, and every run of the same command, trains and is scored on the same batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.common.errors import RunFailed, UserInputError
from hlbp.peer.swarm.step import Schedule

DEFAULT_WAN_MBPS = 1.0
FULL_CODECS = ("dense", "subspace-a@1/32", "subspace-b@1/32", "subspace-a-drift@1/32",
               "subspace-a@1/128", "subspace-b@1/128", "subspace-a-drift@1/128")
QUICK_CODECS = ("dense", "subspace-a@1/32")
SCHEDULES = tuple(s.value for s in Schedule)
TARGET_SPEEDUP = 5.0  # the target: the best subspace codec at >= 5x dense bf16 tokens/s
TARGET_BUSY = 0.8  # and the bottleneck stage busy >= 80 %
TARGET_BYTES = 2  # bytes per target id on the wire (vocabularies up to 65,536)
WARM_STEPS = 2  # steps that pay one-time costs, left out of the steady rate (see run_codec)
TARGET_STAGE_PEERS = 1.5  # two peers on the bottleneck stage: >= 1.5x the swarm's tokens/s with one


@dataclass
class PipelineBenchConfig:
    """The swarm every codec gets; ``quick`` shrinks it to a CI-sized smoke run."""

    stages: int = 3
    codecs: tuple[str, ...] = FULL_CODECS  # "kind" or "kind@k/d"
    steps: int = 10  # inner steps of every codec (same tokens for each)
    model: str = "tiny"
    batch_size: int = 64  # sequences per inner step: big steps amortize the per-step synchronisation
    seq_len: int = 64
    micro_batches: int = 16
    schedules: tuple[str, ...] = ("uniform",)  # --micro-batch-schedule of the driver; each codec runs once per one
    in_flight: int | None = None  # None: all of a step's micro-batches
    wan_delay_ms: float = 10.0  # one way; the round trip is twice this
    wan_mbps: float = DEFAULT_WAN_MBPS  # per peer and direction
    seed: int = 0
    threads: int = 1  # torch threads per stage process
    timeout_s: float = 600.0  # per codec
    stage_peers: tuple[int, ...] = (1,)  # peers on ``slow_stage``; each codec runs once per count
    slow_stage: int = 1  # the stage whose peers are slowed (when ``slow_stage_factor`` > 1) and may be several
    slow_stage_factor: float = 1.0  # how many times as long ``slow_stage``'s peers take over a training pass
    cache_dir: Path | None = None

    @classmethod
    def quick(cls, **overrides: Any) -> PipelineBenchConfig:
        """Dense bf16 and subspace A at 1/32 only, 6 steps of 8 sequences."""
        return dataclasses.replace(cls(codecs=QUICK_CODECS, steps=6, batch_size=8, micro_batches=4), **overrides)

    def check(self) -> None:
        """Reject settings that cannot run, before any process starts."""
        if not 2 <= self.stages <= 4:
            raise UserInputError("--stages must be 2, 3 or 4")
        if self.steps < 1 or self.micro_batches < 1 or self.in_flight is not None and self.in_flight < 1:
            raise UserInputError("--steps, --micro-batches and --in-flight must be >= 1")
        if self.micro_batches > self.batch_size:
            raise UserInputError("--micro-batches must not exceed --batch-size (one sequence at least each)")
        if self.wan_delay_ms < 0 or self.wan_mbps <= 0:
            raise UserInputError("--wan-delay-ms must be >= 0 and --wan-mbps > 0")
        if not self.codecs:
            raise UserInputError("--codecs must name at least one codec")
        if not self.schedules or any(s not in SCHEDULES for s in self.schedules) \
                or len(set(self.schedules)) != len(self.schedules):
            raise UserInputError(f"--schedules must name each of {', '.join(SCHEDULES)} at most once")
        if not self.stage_peers or any(not 1 <= n <= 4 for n in self.stage_peers) \
                or len(set(self.stage_peers)) != len(self.stage_peers):
            raise UserInputError("--stage-peers must name distinct counts of 1 to 4")
        if not 1 <= self.slow_stage < self.stages or not self.slow_stage_factor >= 1:
            raise UserInputError("--slow-stage must be a stage after the driver's and --slow-stage-factor >= 1")
        for spec in self.codecs:
            parse_codec(spec, 128)


def parse_codec(spec: str, d_model: int) -> tuple[str, int, str]:
    """(kind, absolute k, k/d label) of ``"kind"`` or ``"kind@k/d"``; dense has k = d_model."""
    from hlbp.peer.model.basis import resolve_rank
    from hlbp.peer.model.codec import CodecConfig

    kind, _, ratio = spec.partition("@")
    CodecConfig(kind)  # rejects unknown kinds with the list of known ones
    if kind == "dense":
        if ratio:
            raise UserInputError(f"the dense codec takes no k/d ({spec!r})")
        return kind, d_model, "1"
    return kind, resolve_rank(ratio or "1/32", d_model), ratio or "1/32"


def formula_bytes(kind: str, k: int) -> dict[str, float]:
    """Payload bytes per token each way, without headers: k values in the wire dtype (bf16 dense, fp32 subspace),
    plus 2-byte token ids (subspace) and 2-byte targets forward (each row's first input id, 2 bytes a row, is
    left out: under 0.04 B/token from 64 tokens a row)."""
    values = k * (2 if kind == "dense" else 4)
    return {"forward": values + (0 if kind == "dense" else 2) + TARGET_BYTES, "backward": values}


def driver_identity(seed: int) -> bytes:
    """The driving peer's identity file, derived from the run's seed: the same key for every codec and every run.

    The driver's data order is its data rank, a hash of its peer id (``hlbp.peer.node.join.data_rank``), so with a
    fresh key per swarm each codec trained on different batches and the validation loss column compared data orders
    as much as codecs (7.20-7.48 for one codec in three runs at one seed). A benchmark key only: it is written
    into the bench's own temporary directory and never used outside it."""
    from hlbp.protocol.identity import Identity

    return Identity(hashlib.sha256(f"hlbp bench pipeline driver {seed}".encode()).digest()).to_file_bytes()


def _summary(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    found = list(out_dir.glob("*/*/summary.json"))
    if not found:
        return None
    steps = []
    metrics = found[0].parent / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if rec.get("event") == "step" and "seconds" in rec:
                steps.append(rec)
    return json.loads(found[0].read_text(encoding="utf-8")), steps


def _proxy_bytes(sw: Any) -> dict[str, dict[str, int]]:
    """Bytes each peer's WAN proxy carried, by peer name (a peer's announced port is its proxy's)."""
    stats = sw.wan.stats() if sw.wan is not None else {}
    out = {}
    for name, proc in [("bootstrap", sw.bootstrap), *((n, r.proc) for n, r in sw.replicas.items())]:
        args = proc.args if proc is not None else []
        if "--announce-maddrs" in args:
            port = int(args[args.index("--announce-maddrs") + 1].rsplit("/", 1)[-1])
            if port in stats:
                out[name] = {"inbound": stats[port].inbound, "outbound": stats[port].outbound}
    return out


def run_codec(cfg: PipelineBenchConfig, spec: str, d_model: int, workdir: Path,
              schedule: str = "uniform", peers: int = 1) -> dict[str, Any]:
    """One swarm with codec ``spec``: start it, with ``peers`` peers on ``cfg.slow_stage``, let stage 0 drive
    ``cfg.steps`` steps cutting each step's batch as ``schedule`` says, and measure."""
    from hlbp.peer.sim.launcher import SimConfig, Swarm, poll

    kind, k, ratio = parse_codec(spec, d_model)
    sim = SimConfig(n_stages=cfg.stages, model=cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                    seed=cfg.seed, threads=cfg.threads, run_id=f"bench-pipeline-{kind}-{k}", cache_dir=cfg.cache_dir,
                    wan_delay_ms=cfg.wan_delay_ms, wan_mbps=cfg.wan_mbps, codec=kind,
                    codec_k=0 if kind == "dense" else k)
    started = time.monotonic()
    with Swarm(sim, workdir) as sw:
        sw.start()
        slow = [sys.executable, "-m", "hlbp.cli.slowstage", str(cfg.slow_stage_factor)] \
            if cfg.slow_stage_factor > 1 else None
        servers = {}
        for s in range(cfg.stages - 1, 0, -1):
            for j in range(peers if s == cfg.slow_stage else 1):
                name = f"s{s}" + "abcd"[j] * (j > 0)
                servers[name] = (s, sw.add_stage(name, s, program=slow if s == cfg.slow_stage else None, swarm=0))
        for _, server in servers.values():
            server.proc.wait_for(r"announced in", sim.startup_timeout_s)
        extra = ["--micro-batches", str(cfg.micro_batches), "--micro-batch-schedule", schedule,
                 "--eval-every", str(cfg.steps), "--stage-peers", str(peers)]
        if cfg.in_flight is not None:
            extra += ["--in-flight", str(cfg.in_flight)]
        key = workdir / "s0.key"  # where the launcher looks for s0's identity before it creates one
        key.write_bytes(driver_identity(cfg.seed))
        key.chmod(0o400)
        driver = sw.add_stage("s0", 0, *extra, max_steps=cfg.steps, swarm=0)
        try:
            driver.proc.wait_for(r"^driver: ", cfg.timeout_s)
            summary, steps = poll(lambda: _summary(driver.out_dir), 60, "the driver's summary.json")
        except RunFailed as exc:
            raise RunFailed(f"{spec}: the driver did not finish: {exc}\n{driver.proc.output[-3000:]}") from exc
        proxies = _proxy_bytes(sw)
        stage_of = {m[0].group(1): s for s, server in servers.values()
                    if (m := server.proc.find(r"^connected as (\S+)"))}
    if summary["steps"] < cfg.steps or summary["steps_abandoned"] or not steps:
        raise RunFailed(f"{spec}: {summary['steps']} of {cfg.steps} steps done, "
                        f"{summary['steps_abandoned']} abandoned")
    train_s = sum(r["seconds"] for r in steps)
    tokens = summary["tokens"]
    busy: dict[str, float] = {}
    for p, s in summary["busy_s"].items():  # a stage's peers together: with two, each is busy about half as long
        where = "stage 0" if p == "driver" else f"stage {stage_of.get(p, '?')}"
        busy[where] = busy.get(where, 0.0) + s / train_s / (peers if stage_of.get(p) == cfg.slow_stage else 1)
    bottleneck = max(busy, key=lambda s: busy[s])
    served_by = [len(r["serving"][cfg.slow_stage - 1]) if "serving" in r else 1 for r in steps]
    # the first steps pay once: a peer's first pass allocates and compiles (at a slow-stage factor of 120, its four
    # times the CPU is seconds), and its first optimizer step and sibling trade land in the next step, which waits
    # for them; the steady rate leaves them out, so that arms with different peer counts compare their running speed
    warm, steady = (steps[:WARM_STEPS], steps[WARM_STEPS:]) if len(steps) > WARM_STEPS else ([], steps)
    sent, received = summary["stream_bytes"]["sent"], summary["stream_bytes"]["received"]
    boundaries = cfg.stages - 1
    if not proxies:
        raise RunFailed("no WAN proxy carried any bytes")
    return {
        "codec": spec, "schedule": schedule, "stage_peers": peers, "kind": kind, "k": k, "k_over_d": ratio, "tokens": tokens, "steps": summary["steps"],
        "microbatches": summary["microbatches"], "microbatches_retried": summary["microbatches_retried"],
        "train_seconds": train_s, "tokens_per_s": tokens / train_s,
        "tokens_per_s_wall": summary["tokens_per_s"],
        # a step record's tokens count the whole run's so far
        "tokens_per_s_steady": (steps[-1]["tokens"] - (warm[-1]["tokens"] if warm else 0))
        / sum(r["seconds"] for r in steady),
        "warm_steps": len(warm), "step_seconds": [r["seconds"] for r in steps],
        "bytes_per_token": {"forward": sent.get("fwd", 0) / tokens, "backward": received.get("bwd", 0) / tokens},
        "formula_bytes_per_token": formula_bytes(kind, k),
        "stream_bytes": summary["stream_bytes"],
        "wire_bytes_per_token_boundary": sum(p["inbound"] + p["outbound"] for p in proxies.values()) / tokens
        / boundaries,
        "proxy_bytes": proxies,  # per peer's proxy: bytes towards it (inbound) and from it, whole run
        "busiest_link_bytes_per_token": max(max(p["inbound"], p["outbound"]) for p in proxies.values()) / tokens,
        "busy": busy, "bottleneck": bottleneck, "bottleneck_busy": busy[bottleneck],
        # the most peers the slow stage had in one step (the driver shares a stage only where the trade pays)
        "served_by": max(served_by, default=1),
        "served_by_step": served_by,
        # after the last step, or None: a driver stopped before its final evaluation finished has only the one
        # before training, which is not a result (a link-bound dense chain can take longer than the stop allows)
        "val_losses": summary["val_losses"], "data_rank": summary["data_rank"],
        "val_loss": summary["val_losses"][-1] if len(summary["val_losses"] or []) >= 2 else None,
        "seconds": time.monotonic() - started,
    }


def write_png(path: Path, rows: list[dict[str, Any]], title: str) -> bool:
    """Tokens/s and bytes per token by codec, side by side; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    several = len({r["schedule"] for r in rows}) > 1
    shared = len({r["stage_peers"] for r in rows}) > 1
    labels = [r["codec"].replace("subspace-", "").replace("@", "\n") + (f"\n{r['schedule']}" if several else "")
              + (f"\nx{r['stage_peers']} peers" if shared else "") for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(labels, [r["tokens_per_s"] for r in rows], color="tab:blue")
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["bytes_per_token"]["forward"] for r in rows], 0.4, label="forward")
    b.bar([i + 0.2 for i in x], [r["bytes_per_token"]["backward"] for r in rows], 0.4, label="backward")
    b.set_xticks(list(x), labels)
    b.set_yscale("log")
    b.set_ylabel("bytes / token / boundary (measured)")
    b.set_title("stage-stream bytes")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_pipeline_bench(cfg: PipelineBenchConfig, out: Path | None, console: Console) -> dict[str, Any]:
    """Run the swarm once per codec, print the table, and write JSON (and a PNG beside it) when ``out`` is set."""
    from hlbp.peer.model.decoder import preset

    cfg.check()
    d_model = preset(cfg.model).d_model
    rows = []
    t_all = time.monotonic()
    for spec in cfg.codecs:
        for schedule in cfg.schedules:  # side by side: one codec's schedules and peer counts run back to back
            for peers in cfg.stage_peers:
                console.print(f"[bold]{spec}[/] ({schedule} micro-batches, {peers} peer(s) on stage "
                              f"{cfg.slow_stage}): {cfg.stages} stages x {cfg.steps} steps of {cfg.model}, "
                              f"{cfg.wan_mbps:g} Mbit/s and {cfg.wan_delay_ms:g} ms per link")
                with tempfile.TemporaryDirectory(prefix="hlbp-bench-pipeline-") as work:
                    rows.append(run_codec(cfg, spec, d_model, Path(work), schedule, peers))
                r = rows[-1]
                console.print(f"  {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_steady']:,.0f} after "
                              f"{r['warm_steps']} warm-up steps), {r['bytes_per_token']['forward']:.1f} B/token "
                              f"forward, {r['bottleneck']} busy {r['bottleneck_busy']:.0%}, val loss {r['val_loss']}"
                              + (f", stage {cfg.slow_stage} served by {r['served_by']}" if peers > 1 else ""))
    # each row against dense cut alike, with as many peers on the slow stage
    dense_by = {(r["schedule"], r["stage_peers"]): r for r in rows if r["kind"] == "dense"}
    dense = next(iter(dense_by.values()), None)
    link_bps = cfg.wan_mbps * 1e6 / 8
    for r in rows:
        base = dense_by.get((r["schedule"], r["stage_peers"]))
        r["speedup_vs_dense"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["link_use_forward"] = r["tokens_per_s"] * r["bytes_per_token"]["forward"] / link_bps
        r["busiest_link_use"] = r["tokens_per_s"] * r["busiest_link_bytes_per_token"] / link_bps
    def label(r: dict[str, Any]) -> str:
        return " ".join([r["codec"], *([r["schedule"]] if len(cfg.schedules) > 1 else []),
                         *([f"x{r['stage_peers']} peers"] if len(cfg.stage_peers) > 1 else [])])

    table = [[label(r), r["k"], r["tokens_per_s"], r["speedup_vs_dense"] or "",
              r["bytes_per_token"]["forward"], r["bytes_per_token"]["backward"],
              f"{r['formula_bytes_per_token']['forward']:g}/{r['formula_bytes_per_token']['backward']:g}",
              r["busiest_link_bytes_per_token"], f"{r['link_use_forward']:.0%} / {r['busiest_link_use']:.0%}",
              f"{r['bottleneck_busy']:.0%} ({r['bottleneck']})",
              "not finished" if r["val_loss"] is None else r["val_loss"]] for r in rows]
    title = (f"pipeline: {cfg.stages} stages of {cfg.model} (d={d_model}), {cfg.steps} steps x "
             f"{cfg.batch_size}x{cfg.seq_len} tokens, {cfg.micro_batches} micro-batches "
             f"({'/'.join(cfg.schedules)}), in flight "
             f"{cfg.in_flight or cfg.micro_batches}; links {cfg.wan_mbps:g} Mbit/s each way, RTT "
             f"{2 * cfg.wan_delay_ms:g} ms; {os.cpu_count()} cores, {cfg.threads} torch thread(s) per stage")
    wide = Console(file=console.file, width=max(console.width, 150))
    print_table(wide, title, ["codec", "k", "tokens/s", "x dense", "B/tok fwd", "B/tok bwd", "formula f/b",
                              "busiest link B/tok", "link use f/max", "bottleneck busy", "val loss"], table)
    verdict = targets(rows)
    compared = schedule_ratios(rows)
    shared = stage_peer_ratios(rows)
    lines = [("B/tok: measured on the stage stream (whole fwd / bwd messages, boundary 0) per training token; "
              "formula: payload only (values, ids, targets). busiest link B/tok: the most bytes one proxy carried one way "
              "(libp2p framing, DHT and evaluation included) per training token. link use: boundary 0's forward "
              "bytes/s, and the busiest link's (an upper bound), over the link rate. A peer's proxy carries every "
              "connection it accepted, so two boundaries can share one emulated link.")]
    if dense is not None:
        cap = link_bps / dense["bytes_per_token"]["forward"]
        lines.append(f"{cfg.wan_mbps:g} Mbit/s makes dense bf16 link-bound here: its "
                     f"{dense['bytes_per_token']['forward']:.0f} B/token forward cap it at {cap:,.0f} tokens/s "
                     f"(measured {dense['tokens_per_s']:,.0f}, link {dense['link_use_forward']:.0%} used), while "
                     f"the stages compute {max(r['tokens_per_s'] for r in rows):,.0f} tokens/s with a small codec.")
    if verdict["best"] is not None:
        lines.append(f"targets: best subspace {verdict['best']} at {verdict['speedup']:.2f}x dense (target "
                     f">= {TARGET_SPEEDUP:g}x: {'met' if verdict['speedup_met'] else 'MISSED'}); its bottleneck "
                     f"busy {verdict['busy']:.0%} (target >= {TARGET_BUSY:.0%}: "
                     f"{'met' if verdict['busy_met'] else 'MISSED'}); all its stages together busy "
                     f"{verdict['busy_sum']:.2f} of {os.cpu_count()} cores (p2pd, proxies and the per-step "
                     "synchronisation take the rest; see the module docstring).")
    for c in compared:
        lines.append(f"{c['codec']}: tapered / uniform micro-batches {c['tokens_per_s_ratio']:.2f}x tokens/s, "
                     f"bottleneck busy {c['busy_points']:+.1f} points, val loss {c['val_loss']['tapered']} against "
                     f"{c['val_loss']['uniform']}")
    for c in shared:
        lines.append(f"{c['codec']} ({c['schedule']}): {c['peers']} peers on stage {cfg.slow_stage} against one, "
                     f"{c['tokens_per_s_ratio']:.2f}x tokens/s (target >= {TARGET_STAGE_PEERS:g}x with two: "
                     f"{'met' if c['met'] else 'MISSED'}; "
                     + (f"{c['steady_tokens_per_s_ratio']:.2f}x" if c["steady_tokens_per_s_ratio"] else "n/a")
                     + f" after {WARM_STEPS} warm-up steps), val loss {c['val_loss']['many']} against "
                     f"{c['val_loss']['one']}")
    for line in lines:
        wide.print(line)
    result = {"rows": rows, "targets": verdict, "schedule_ratios": compared, "stage_peer_ratios": shared, "d_model": d_model, "link_bytes_per_s": link_bps,
              "runtime_s": time.monotonic() - t_all}
    doc = write_result(out, "pipeline", dataclasses.asdict(cfg), result)
    if out is not None:
        png = Path(out).with_suffix(".png")
        if write_png(png, rows, title):
            wide.print(f"plot: {png}")
        else:
            wide.print("plot skipped: matplotlib is not installed")
    return doc


def stage_peer_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per codec and schedule run with one peer on the slow stage and with more: tokens/s of more over one, and
    both validation losses (the same batches: equal up to the order in which the parts of a gradient are added)."""
    out = []
    for spec, schedule in dict.fromkeys((r["codec"], r["schedule"]) for r in rows):
        by = {r.get("stage_peers", 1): r for r in rows if (r["codec"], r["schedule"]) == (spec, schedule)}
        if 1 not in by:
            continue
        for n, r in sorted(by.items()):
            if n > 1:
                ratio = r["tokens_per_s"] / by[1]["tokens_per_s"]
                steady = r.get("tokens_per_s_steady"), by[1].get("tokens_per_s_steady")
                out.append({"codec": spec, "schedule": schedule, "peers": n, "tokens_per_s_ratio": ratio,
                            "steady_tokens_per_s_ratio": steady[0] / steady[1] if all(steady) else None,
                            "met": n < 2 or ratio >= TARGET_STAGE_PEERS,
                            "val_loss": {"one": by[1]["val_loss"], "many": r["val_loss"]}})
    return out


def schedule_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per codec run under both schedules: tapered over uniform tokens/s, the bottleneck's busy points gained, and
    both validation losses (the same tokens, so equal up to the order micro-batches' gradients are summed in)."""
    out = []
    for spec in dict.fromkeys(r["codec"] for r in rows):
        by = {r["schedule"]: r for r in rows if r["codec"] == spec and r.get("stage_peers", 1) == 1}
        if set(by) >= set(SCHEDULES):
            t, u = by["tapered"], by["uniform"]
            out.append({"codec": spec, "tokens_per_s_ratio": t["tokens_per_s"] / u["tokens_per_s"],
                        "busy_points": 100 * (t["bottleneck_busy"] - u["bottleneck_busy"]),
                        "val_loss": {"tapered": t["val_loss"], "uniform": u["val_loss"]}})
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets against the fastest subspace codec: speed-up over dense and bottleneck busy fraction."""
    sub = [r for r in rows if r["kind"] != "dense" and r.get("speedup_vs_dense") is not None]
    if not sub:
        return {"best": None}
    best = max(sub, key=lambda r: r["tokens_per_s"])
    return {"best": best["codec"], "speedup": best["speedup_vs_dense"], "busy": best["bottleneck_busy"],
            "busy_sum": sum(best["busy"].values()),
            "speedup_met": best["speedup_vs_dense"] >= TARGET_SPEEDUP, "busy_met": best["bottleneck_busy"] >= TARGET_BUSY}
