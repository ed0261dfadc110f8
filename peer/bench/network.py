"""``hlbp bench network``: SparseLoCo rounds on real p2pd peers against hivemind's dense all-reduce baseline.

Why: the codec benchmark counts bytes; this one asks what those bytes cost on a real stack (DHT records,
p2pd streams, the accepted-set protocol) next to the honest dense baseline, hivemind's stock
``DecentralizedAverager`` averaging fp32 pseudo-gradients of the same size (DiLoCo's exchange).

Setup, per (model preset, peer count N): one bootstrap DHT and N peer DHTs in this process (each peer's identity
file is its p2pd identity). On the same N DHTs sit N :class:`~hlbp.peer.rounds.sparseloco.RoundRunner` (SparseLoCo, one
thread each) and N ``DecentralizedAverager`` over random fp32 tensors shaped like every model parameter. After
one warm-up round of each (connections, first-touch buffers), the two methods alternate round by round, so that
the load of whatever else shares the machine falls on both alike.

What is timed (the communication part of a round, from "contributions ready" to "new parameters applied"):

- SparseLoCo: ``comm_s + wait_s`` of the runner's :class:`~hlbp.peer.rounds.sparseloco.RoundStats`. It includes encoding
  the contribution, the notice and accepted-set DHT records, fetching and decoding the payloads, applying the
  outer step, and the checksum exchange that follows. Inner training is one step on a batch of one short
  sequence, so the compute any peer waits for in ``wait_s`` is negligible next to it.
- Dense: matchmaking runs first with ``require_trigger=True``; once every peer's group is formed, each peer
  triggers and the time from ``allow_allreduce()`` to the averaged result is the all-reduce. The whole step,
  matchmaking included, is reported beside it (hivemind waits ``min_matchmaking_time`` to form a group).

A round's time is the slowest peer's; the table shows the median over rounds.

Bytes per peer per round:

- SparseLoCo: ``bytes_received`` (payload bytes fetched from the other peers), and ``bytes_sent`` (served).
- Dense: analytic, ``2·(N−1)/N · 4·params`` each way for hivemind's butterfly all-reduce (no compression).
- Both: measured, the loopback interface's transmitted bytes over the timed phase divided by N, from
  ``/proc/net/dev``. That counter is machine-wide: it includes DHT traffic, framing, and any other program's
  loopback traffic in that window, so it is an upper bound.

Physical floor: the bytes one peer receives per round (the analytic figure for dense) over the link rate. The
link rate is either given (``link_mbps``, Mbit/s) or measured once: the median rate of three fetches of a
``link_probe_mib`` MiB blob between two peers through :class:`~hlbp.peer.net.transport.P2PBlobTransport`. On
loopback the N peers share the machine's cores, so a ratio well above 1 is expected for both methods.

Shaped link (``shaped_mbps``, ``hlbp bench network --shape-mbps R``): see :mod:`hlbp.peer.bench.shaping`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.common.errors import RunFailed, UserInputError

clock = time.perf_counter
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
PROBE = "bench/link-probe"


@dataclass
class NetworkBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run."""

    models: tuple[str, ...] = ("tiny", "small")  # model presets whose parameter count sets the payload
    peers: tuple[int, ...] = (2, 4)  # swarm sizes N
    rounds: int = 4  # timed rounds of each method, after one warm-up round of each
    k: int = 64  # SparseLoCo values kept per 4096
    link_mbps: float | None = None  # link rate in Mbit/s for the floor; None measures it through P2PBlobTransport
    link_probe_mib: int = 64  # size of the blob the link measurement fetches
    seq_len: int = 64  # tokens per sequence of the single inner step (compute kept negligible)
    matchmaking_s: float = 2.0  # hivemind min_matchmaking_time of the dense averagers
    step_timeout_s: float = 120.0  # give up on one dense step or one SparseLoCo round after this long
    seed: int = 0
    cache_dir: Path | None = None  # corpus and tokenizer cache (None: the default cache)
    shaped_mbps: float | None = None  # loopback rate-limited to this (Mbit/s, shared by all peers); see run_shaped

    @classmethod
    def quick(cls, **overrides: Any) -> NetworkBenchConfig:
        """The tiny model, 2 peers, 2 timed rounds."""
        return dataclasses.replace(cls(models=("tiny",), peers=(2,), rounds=2), **overrides)

    def check(self) -> None:
        """Reject settings that cannot run, before any daemon starts."""
        if self.rounds < 1 or any(n < 2 for n in self.peers) or not self.models:
            raise UserInputError("--rounds must be >= 1, every --peers value >= 2, and --models non-empty")
        if self.link_mbps is not None and self.link_mbps <= 0:
            raise UserInputError("--link-mbps must be > 0 (or left out to measure the loopback rate)")
        if self.link_probe_mib < 1:
            raise UserInputError("--link-probe-mib must be >= 1")
        if self.step_timeout_s <= 0:
            raise UserInputError("--step-timeout-s must be > 0")
        if self.shaped_mbps is not None and self.shaped_mbps <= 0:
            raise UserInputError("--shape-mbps must be > 0 (Mbit/s), or left out for unshaped loopback")


# ---------------------------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------------------------


def loopback_tx_bytes() -> int | None:
    """Bytes transmitted on ``lo`` since boot (Linux ``/proc/net/dev``), or None where that is unavailable."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def dense_allreduce_bytes(params: int, peers: int) -> float:
    """Bytes each peer sends (and receives) in one butterfly all-reduce of ``params`` fp32 values."""
    return 2 * (peers - 1) / peers * 4 * params


def measure_link(sender: Any, receiver: Any, sender_id: str, mib: int, repeats: int = 3) -> float:
    """Bytes per second of one blob fetch through P2PBlobTransport (median of ``repeats`` after a warm-up)."""
    size = mib << 20
    sender.put(PROBE, os.urandom(size))  # random bytes, so no layer could compress them
    try:
        sender.put(PROBE + "/small", b"x")
        receiver.fetch(sender_id, PROBE + "/small", 1 << 10, 30.0)  # opens the connection outside the timing
        rates = []
        for _ in range(repeats):
            t0 = clock()
            body = receiver.fetch(sender_id, PROBE, size, 120.0)
            rates.append(len(body) / (clock() - t0))
        return statistics.median(rates)
    finally:
        sender.drop([PROBE, PROBE + "/small"])


def _run_threads(targets: list[Callable[[], Any]], timeout: float) -> list[Any]:
    """Run each callable in its own thread; return their results, or raise the first failure."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def wrap(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a peer did not finish within {timeout:.0f} s")
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------------------------------------------------
# The swarm: N peers, each with a DHT, a blob transport, a RoundRunner and a DecentralizedAverager
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class BenchSwarm:
    """The live objects of one (model, N) configuration; built and torn down by :func:`swarm`."""

    dhts: list[Any]
    transports: list[Any]
    runners: list[Any]
    averagers: list[Any]
    dense_tensors: list[list[torch.Tensor]]
    params: int
    stop: threading.Event


@contextmanager
def swarm(cfg: NetworkBenchConfig, model: str, n: int, data: Any) -> Iterator[BenchSwarm]:
    """Start N peers on loopback; every daemon and thread is stopped on exit, also after an error."""
    from hivemind.averaging import DecentralizedAverager

    from hlbp.peer.data.streams import TokenStream
    from hlbp.peer.model.decoder import preset, split
    from hlbp.peer.model.pipeline import initial_model
    from hlbp.peer.net.dht import SafeDHT
    from hlbp.peer.net.transport import P2PBlobTransport
    from hlbp.peer.net.validation import load_or_create_identity
    from hlbp.peer.rounds.diloco import sigint_preserved
    from hlbp.peer.rounds.outer import OuterConfig
    from hlbp.peer.rounds.rules import Expected
    from hlbp.peer.rounds.sparseloco import RoundConfig, RoundRunner
    from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, micro_batches

    model_cfg = preset(model, vocab_size=data.vocab_size, max_seq_len=cfg.seq_len)
    with torch.device("meta"):
        stages = split(model_cfg, 2)
    shards = [[name for name, _ in s.named_parameters()] for s in stages]
    stop = threading.Event()
    sw = BenchSwarm([], [], [], [], [], 0, stop)
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="hlbp-bench-net-"))  # removed last
        root = SafeDHT(start=True, host_maddrs=LOCAL)  # its p2pd as every peer's (dht.P2PD_ENV)
        stack.callback(root.shutdown)
        initial = [str(m) for m in root.get_visible_maddrs()]
        run_id = f"bench-net-{model}-{n}-{os.getpid()}"
        for i in range(n):
            path = Path(tmp) / f"peer{i}.key"
            identity = load_or_create_identity(path)
            dht = SafeDHT(start=True, host_maddrs=LOCAL, initial_peers=initial, identity_path=str(path),
                          check_if_identity_free=False)
            stack.callback(dht.shutdown)
            transport = P2PBlobTransport(dht)
            stack.callback(transport.close)
            net = initial_model(model_cfg, cfg.seed)  # every replica starts from the run's initial parameters
            stream = TokenStream(data.train, cfg.seq_len, 1, seed=cfg.seed, rank=i)
            trainer = InnerTrainer(net, OptimConfig(total_steps=1000, warmup_steps=5), micro_batches(stream, 1),
                                   torch.device("cpu"))
            round_cfg = RoundConfig(run_id=run_id, inner_steps=1, deadline_s=cfg.step_timeout_s / 4,
                                    min_deadline_s=1.0, checks_wait_s=10.0)
            runner = RoundRunner(dht, identity, transport, trainer, OuterConfig(k=cfg.k), shards, round_cfg, stop,
                                 expected=lambda: Expected(n))
            tensors = [torch.randn(p.shape) for p in net.parameters()]
            with sigint_preserved():  # hivemind would leave Ctrl-C ignored in this process
                averager = DecentralizedAverager(
                    tensors, dht, start=True, prefix=f"bench_dense_{model}_{n}_{os.getpid()}", target_group_size=n,
                    min_group_size=n, min_matchmaking_time=cfg.matchmaking_s, request_timeout=1.0,
                    allow_state_sharing=False,  # its periodic DHT declarations race the shutdown and log errors
                )
            stack.callback(averager.shutdown)
            sw.dhts.append(dht)
            sw.transports.append(transport)
            sw.runners.append(runner)
            sw.averagers.append(averager)
            sw.dense_tensors.append(tensors)
            sw.params = sum(t.numel() for t in tensors)
        stack.callback(stop.set)  # runs first on exit: any runner still waiting stops polling
        yield sw


def sparse_round(sw: BenchSwarm, timeout: float) -> dict[str, Any]:
    """One SparseLoCo round on every peer at once; per-peer seconds and bytes from their RoundStats."""
    tx0 = loopback_tx_bytes()
    stats = _run_threads([lambda r=r: r.run(1)[-1] for r in sw.runners], timeout)
    tx = _delta(tx0, loopback_tx_bytes())
    if not all(s.accepted and s.in_sync and s.members == len(sw.runners) for s in stats):
        raise RunFailed(f"a SparseLoCo round did not include every peer in sync: {stats}")
    if len({tuple(sorted(s.checksums.items())) for s in stats}) != 1:
        raise RunFailed("SparseLoCo peers disagree on the new parameters")
    return {
        "comm_s": [s.comm_s + s.wait_s for s in stats],
        "wait_s": [s.wait_s for s in stats],
        "compute_s": [s.compute_s for s in stats],
        "bytes_received": [s.bytes_received for s in stats],
        "bytes_sent": [s.bytes_sent for s in stats],
        "lo_tx_bytes": tx,
    }


def dense_round(sw: BenchSwarm, timeout: float) -> dict[str, Any]:
    """One dense all-reduce: matchmaking first, then every peer triggers and is timed to its averaged result."""
    from hivemind.averaging.control import AveragingStage

    n = len(sw.averagers)
    for i, tensors in enumerate(sw.dense_tensors):  # a fresh pseudo-gradient each round, like a real peer's
        with torch.no_grad():
            for t in tensors:
                t.normal_(generator=torch.Generator().manual_seed(i * 7919 + t.numel()))
    t_start = clock()
    controls = [a.step(wait=False, require_trigger=True, timeout=timeout) for a in sw.averagers]
    deadline = time.monotonic() + timeout
    while not all(c.stage == AveragingStage.AWAITING_TRIGGER or c.done() for c in controls):
        if time.monotonic() > deadline:
            for c in controls:
                c.cancel()
            raise TimeoutError(f"dense matchmaking did not finish within {timeout:.0f} s")
        time.sleep(0.01)
    matched = clock()
    barrier = threading.Barrier(n)
    tx0 = loopback_tx_bytes()

    def reduce(control: Any) -> tuple[float, float, int]:
        barrier.wait()
        t0 = clock()
        control.allow_allreduce()
        group = control.result(timeout)
        t1 = clock()
        return t1 - t0, t1 - t_start, len(group or {})

    out = _run_threads([lambda c=c: reduce(c) for c in controls], timeout)
    tx = _delta(tx0, loopback_tx_bytes())
    if any(size != n for _, _, size in out):
        raise RunFailed(f"a dense step averaged in a group smaller than {n}: {[s for *_, s in out]}")
    return {
        "comm_s": [a for a, _, _ in out],
        "step_s": [b for _, b, _ in out],
        "matchmaking_s": matched - t_start,
        "lo_tx_bytes": tx,
    }


# ---------------------------------------------------------------------------------------------------------------
# Summary and command
# ---------------------------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(rounds: list[dict[str, Any]], n: int, link_bps: float, wire_bytes: float | None,
              shared_link: bool = False) -> dict[str, Any]:
    """Median over rounds of the slowest peer's time, mean bytes per peer, and the ratio to the floor.

    ``wire_bytes`` is the analytic payload each peer receives per round; None takes the measured
    ``bytes_received`` (SparseLoCo). ``shared_link``: all N peers' traffic crosses the one link of ``link_bps``
    (the shaped namespace), so the floor is N times one peer's bytes over the rate.
    """
    per_round = [max(r["comm_s"]) for r in rounds]
    received = wire_bytes if wire_bytes is not None else _median([statistics.mean(r["bytes_received"])
                                                                   for r in rounds])
    sent = wire_bytes if wire_bytes is not None else _median([statistics.mean(r["bytes_sent"]) for r in rounds])
    lo = [r["lo_tx_bytes"] / n for r in rounds if r["lo_tx_bytes"] is not None]
    floor = received * (n if shared_link else 1) / link_bps
    comm = _median(per_round)
    out = {
        "comm_s_median": comm,
        "comm_s_rounds": per_round,
        "bytes_received_per_peer": received,
        "bytes_sent_per_peer": sent,
        "bytes_analytic": wire_bytes is not None,
        "lo_bytes_per_peer": _median(lo) if lo else None,
        "floor_s": floor,
        "wall_over_floor": comm / floor if floor > 0 else float("nan"),
        "rounds": rounds,
    }
    if "wait_s" in rounds[0]:  # SparseLoCo: how much of comm_s was waiting for the round to close
        out["wait_s_median"] = _median([max(r["wait_s"]) for r in rounds])
    if "step_s" in rounds[0]:
        out["step_s_median"] = _median([max(r["step_s"]) for r in rounds])
    return out


def run_network_bench(cfg: NetworkBenchConfig, out: Path | None, console: Console) -> dict[str, Any]:
    """Run every (model, N) configuration, print the table, and write the JSON document when ``out`` is set."""
    from hlbp.peer.data.streams import prepare_data

    cfg.check()
    load_before = os.getloadavg()
    t_all = clock()
    data = prepare_data("builtin", cache_dir=cfg.cache_dir)
    shared = cfg.shaped_mbps is not None
    if shared:
        link_bps = cfg.shaped_mbps * 1e6 / 8
        link_source = f"tbf-shaped loopback, {cfg.shaped_mbps:g} Mbit/s shared by all N peers"
    else:
        link_bps = cfg.link_mbps * 1e6 / 8 if cfg.link_mbps else None
        link_source = "given (--link-mbps)" if link_bps else None
    results: list[dict[str, Any]] = []
    for model in cfg.models:
        for n in cfg.peers:
            console.print(f"[bold]{model}[/], {n} peers: starting the swarm")
            with swarm(cfg, model, n, data) as sw:
                if link_bps is None:
                    link_bps = measure_link(sw.transports[0], sw.transports[1], sw.transports[0].peer_id,
                                            cfg.link_probe_mib)
                    link_source = f"measured: {cfg.link_probe_mib} MiB blob fetch through P2PBlobTransport"
                    console.print(f"link rate {link_bps / 1e6:.0f} MB/s ({link_source})")
                sparse_round(sw, cfg.step_timeout_s)  # warm-up: connections, buffers, the first window
                dense_round(sw, cfg.step_timeout_s)
                sparse, dense = [], []
                for r in range(cfg.rounds):  # alternate, so background load falls on both methods alike
                    sparse.append(sparse_round(sw, cfg.step_timeout_s))
                    dense.append(dense_round(sw, cfg.step_timeout_s))
                    console.print(f"  round {r}: sparse {max(sparse[-1]['comm_s']):.3f} s, "
                                  f"dense all-reduce {max(dense[-1]['comm_s']):.3f} s")
                params = sw.params
            s = summarise(sparse, n, link_bps, None, shared)
            d = summarise(dense, n, link_bps, dense_allreduce_bytes(params, n), shared)
            results.append({
                "model": model, "peers": n, "params": params, "sparseloco": s, "dense": d,
                "sparse_over_dense_bytes": s["bytes_received_per_peer"] / d["bytes_received_per_peer"],
                "sparse_over_dense_time": s["comm_s_median"] / d["comm_s_median"],
            })
    load_after = os.getloadavg()
    rows, ratios = [], []
    for r in results:
        for method, key in (("sparse", "sparseloco"), ("dense", "dense")):
            m = r[key]
            lo = m["lo_bytes_per_peer"]
            rows.append([r["model"], r["peers"], method, m["bytes_received_per_peer"] / 1e3,
                         m["bytes_sent_per_peer"] / 1e3, "-" if lo is None else lo / 1e3,
                         m["comm_s_median"], m.get("step_s_median", "-"), m["floor_s"] * 1e3, m["wall_over_floor"]])
        lo_s, lo_d = r["sparseloco"]["lo_bytes_per_peer"], r["dense"]["lo_bytes_per_peer"]
        ratios.append([r["model"], r["peers"], r["sparse_over_dense_bytes"],
                       "-" if not (lo_s and lo_d) else lo_s / lo_d, r["sparse_over_dense_time"]])
    wide = Console(file=console.file, width=max(console.width, 132))  # 10 columns do not fit 80 (non-tty default)
    print_table(wide, f"network, per peer per round (link {link_bps / 1e6:.3g} MB/s, {link_source}; "
                f"load {load_before[0]:.2f} -> {load_after[0]:.2f})",
                ["model", "N", "method", "kB recv", "kB sent", "kB lo", "comm s", "step s", "floor ms", "x floor"],
                rows)
    print_table(wide, "sparse / dense", ["model", "N", "payload bytes", "lo bytes", "comm s"], ratios)
    wide.print("dense kB recv/sent: analytic 2(N-1)/N x 4 x params. kB lo: loopback tx bytes / N, "
               + ("the namespace's own lo. " if shared else "machine-wide. ")
               + "comm s: slowest peer, median over rounds. step s: dense incl. matchmaking. x floor: comm s / floor"
               + (" (floor: N x kB recv over the shared link; latency not emulated)." if shared else "."))
    result = {
        "link_bytes_per_s": link_bps, "link_source": link_source, "loadavg_before": load_before,
        "loadavg_after": load_after, "runtime_s": clock() - t_all, "configs": results,
    }
    return write_result(out, "network", dataclasses.asdict(cfg), result)
