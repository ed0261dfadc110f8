"""A full replica inside a run: the manifest's model and data, the inner trainer, and outer rounds.

``run_replica`` is what ``hlbp join`` runs after the peer has announced itself as a full replica. It builds
everything from the signed manifest (so every replica starts from identical weights), then hands over to
:class:`hlbp.peer.rounds.sparseloco.RoundRunner` until stopped or until ``rounds`` rounds are done, and leaves a summary.

The model is the run's (:func:`replica_model`): in a run whose activation codec is a variant A the full replicas
train the constrained network the stage peers train, with its constraint re-projected after every inner step, so
that every replica of the run optimizes one function (docs/algorithms.md §3 A); full replicas never compress
activations, only the swarms' links do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hlbp.peer.common import memory
from hlbp.peer.common.files import atomic_write_bytes
from hlbp.peer.common.spill import require_room
from hlbp.peer.data.streams import TokenStream, prepare_data, val_batches
from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import ModelConfig, Stage, preset, split
from hlbp.peer.model.pipeline import initial_model, run_model_config
from hlbp.peer.model.subspace import SubspaceConstraint, fixed_table, make_codec
from hlbp.peer.net.prometheus import MetricsServer, PeerMetrics
from hlbp.peer.net.reach import AddressBook, Reachability
from hlbp.peer.net.transport import P2PBlobTransport
from hlbp.peer.node.audits import PipelineAudits
from hlbp.peer.node.join import TrainContext, data_rank
from hlbp.peer.rounds.diloco import DenseRoundRunner
from hlbp.peer.rounds.guard import GuardConfig
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import Expected
from hlbp.peer.rounds.sparseloco import RoundConfig, RoundRunner, RoundStats
from hlbp.peer.swarm.auditor import AuditConfig
from hlbp.peer.swarm.server import max_body_bytes
from hlbp.peer.train.adamw import STATE_DTYPES
from hlbp.peer.train.export import ModelInfo, write_model_info
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.peer.train.trainer import (
    InnerTrainer,
    OptimConfig,
    evaluate,
    evaluate_params,
    micro_batches,
    pick_device,
    skeleton,
    warm_runtime,
)
from hlbp.peer.train.turns import Turns, side_turn

logger = logging.getLogger(__name__)


@dataclass
class ReplicaOptions:
    """Per-peer settings that are not the run's (the manifest fixes the rest)."""

    rounds: int | None = None  # leave after this many outer rounds; None: until stopped
    eval_batches: int = 4  # validation batches scored after every round (0: none)
    threads: int | None = None  # torch CPU threads
    checkpoint_every_s: float = 300.0  # save at most this often (0: every round); always on SIGTERM and at the end
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: any free port); None: off
    metrics_host: str = "127.0.0.1"
    device: str = "auto"
    wait_replicas: int = 0  # fresh run: before round 0, wait until this many replicas (us included) are announced
    wait_replicas_timeout_s: float = 120.0  # ... but start anyway after this long
    # how this peer stores its own optimizer state, never sent or checksummed (a key of STATE_LAYOUTS)
    state_dtype: str = "bf16"
    state_on_disk: bool = True  # the anchor and error feedback in files under the out dir (common.spill), not memory
    recompute: bool = False  # each block's forward run again in the backward, its activations not held (Stage)
    # a fault test's change to the runner's parts before it starts (it wraps them: tests/peer/rounds/faulty_peer.py);
    # production: None
    faults: Callable[[Any], None] | None = None


def wait_for_replicas(count: Callable[[], int], want: int, timeout_s: float, stop: threading.Event,
                      echo: Any = print, what: str = "announced") -> bool:
    """Wait until ``count()`` (replicas, us included, that are ``what``) reaches ``want``, at most ``timeout_s``.

    Why: replicas started together would otherwise begin round 0 as each finishes joining, and the first one,
    seeing nobody else announced, closes round 0 alone; the others then sync and sit it out. Returns whether
    they all came; after the timeout the run starts with whoever is there.
    """
    deadline = time.monotonic() + timeout_s
    have = count()
    if have < want:
        echo(f"waiting for {want} replicas before round 0 ({have} {what}, at most {timeout_s:g} s)")
    while have < want and not stop.is_set():
        if time.monotonic() >= deadline:
            echo(f"starting with {have} of {want} replicas: the others were not {what} within {timeout_s:g} s")
            return False
        stop.wait(0.5)
        have = count()
    return have >= want


def codec_config(m: Any) -> CodecConfig:
    """The run's activation codec (manifest ``codec``) as a :class:`CodecConfig`."""
    return CodecConfig(kind=m.codec.name, rank=str(m.codec.k) if m.codec.k else "1/32",
                       wire_dtype=m.codec.dtype or None, seed=m.seed)


def pipeline_audits(m: Any, config: ModelConfig, model: Stage, transport: P2PBlobTransport,
                    anchor: Callable[[], Mapping[str, torch.Tensor] | None], metrics: Any,
                    stage_of: Callable[[str], int | None], turns: Turns | None = None,
                    published: Callable[[str, int], tuple[int, str] | None] = lambda peer, shard: None,
                    ) -> PipelineAudits:
    """The audits this full replica runs on the run's stage peers when it coordinates (hlbp.peer.node.audits),
    with the run's codec and the largest stage frame the run allows; ``stage_of``: the stage a peer announces;
    ``turns``: where each recomputation waits for the training step under way; ``published``: a peer's latest
    published checksum of a shard and its round."""
    cc = codec_config(m)
    table = fixed_table(config.vocab_size, config.d_model, config.subspace_seed, config.subspace_table_std) \
        if config.subspace_rank else None
    tokens = m.hparams.batch_size * m.hparams.seq_len
    codec = make_codec(cc, config.d_model, config.vocab_size, config.max_seq_len, table,
                       model.embed.weight.detach().cpu().clone(), max_tokens=tokens)
    return PipelineAudits(config, [tuple(b) for b in m.stages], codec, config.vocab_size,
                          max_body_bytes(codec, tokens, config.vocab_size), transport.fetch, anchor, metrics,
                          stage_of=stage_of, turns=turns, published=published)


def latest_checksum(records: RoundRecords, peer: str, shard: int) -> tuple[int, str] | None:
    """The round and checksum of ``shard`` that ``peer`` last published (its checksum record holds its latest round
    only), or None."""
    rec = next((c for c in records.latest_checks() if c.peer == peer), None)
    return None if rec is None or shard not in rec.checksums else (rec.round, rec.checksums[shard])


def replica_config(m: Any, vocab_size: int) -> ModelConfig:
    """The shape of the model a full replica of run ``m`` trains (see :func:`replica_model`)."""
    bounds = [tuple(s) for s in m.stages]
    base = preset(m.model, **dict(m.model_overrides), vocab_size=vocab_size)
    return run_model_config(base, codec_config(m), len(bounds), bounds)


def replica_model(m: Any, vocab_size: int) -> tuple[ModelConfig, Stage, SubspaceConstraint | None]:
    """The whole model a full replica of run ``m`` trains, with the run's initial weights, and its constraint.

    The model is :func:`hlbp.peer.model.pipeline.run_model_config` of the manifest's preset, codec and partition
    (the constrained network for the variants A, the plain one otherwise), and its weights are
    :func:`hlbp.peer.model.pipeline.initial_model`'s: bit for bit the ``initial_state`` every stage peer loads its
    stage from. The constraint (variants A only, else None) re-projects after each inner step.
    """
    config = replica_config(m, vocab_size)
    model = initial_model(config, m.seed)
    constraint = SubspaceConstraint(dict(model.named_parameters()), config) if config.subspace_rank else None
    return config, model, constraint


RECOMPUTE_NOTE = ", blocks recomputed in the backward"
"""What a peer's start line adds under ``hlbp join --recompute``."""

STATE_LAYOUTS = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "bf16-v": ("bf16", "v-bf16"),
    "bf16-all": ("bf16", "bf16"),
}
"""``hlbp join --state-dtype``: how a peer stores its own optimizer state, never sent or checksummed, as (SparseLoCo's
error feedback, AdamW's moments: ``MOMENT_LAYOUTS``). "bf16" (the default) keeps the error feedback in bf16, 2 bytes
per parameter less than "fp32" at an unchanged loss; "bf16-v" also AdamW's second moment (2 more) and "bf16-all"
both moments (4 more), each at a measured loss cost (docs/results.md, "Memory per parameter")."""


def inner_schedule(lr: float, total_steps: int, moments: str = "fp32") -> OptimConfig:
    """The inner AdamW schedule of a run: peak ``lr``, warm-up over a tenth of the schedule (at most 30 steps), then
    cosine. Every full replica and swarm driver builds it from the manifest (``lr``, ``schedule_total``), so the
    replicas of one round train at the same learning rate (a driver sends each step's rate down its chain).
    ``moments``: how this peer stores AdamW's moments (its own choice, ``OptimConfig.moments``)."""
    return OptimConfig(lr=lr, warmup_steps=min(30, max(1, total_steps // 10)), total_steps=total_steps,
                       moments=moments)


class ParamScorer:
    """The loss of given parameters on given batches, for the round guard and the per-round evaluation.

    Without overlap it loads them into the trainer's model (the round loop loads them next anyway). With overlap
    the model is training the next phase meanwhile, so a :func:`~hlbp.peer.train.trainer.skeleton` of it (no
    parameter memory of its own) runs on the given tensors as they are: on CPU no copy of them is made."""

    def __init__(self, trainer: InnerTrainer, device: torch.device, separate: bool) -> None:
        self.trainer, self.device, self.separate = trainer, device, separate
        self._shell: torch.nn.Module | None = None
        self._lock = threading.Lock()

    def __call__(self, params: Mapping[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if not self.separate:
            self.trainer.load_params(params)
            return evaluate(self.trainer.model, batches, self.device)
        with self._lock, side_turn(self.trainer.turns):  # the exchange thread (guard) and the main thread (report)
            if self._shell is None:
                self._shell = skeleton(self.trainer.model)
            return evaluate_params(self._shell, params, batches, self.device)


def require_state_room(state_dir: str, n_params: int, ef_dtype: str) -> None:
    """Before a peer starts: refuse (:class:`~hlbp.peer.common.spill.NoRoomError`) when ``state_dir`` cannot hold
    the round state this peer will keep there, the anchor (4 bytes a parameter) and the error feedback in
    ``ef_dtype``, rather than fail at its first round. Nothing to check when the state is in memory ("")."""
    if state_dir:
        require_room(state_dir, n_params * (4 + STATE_DTYPES[ef_dtype].itemsize), f"keeping the round state of {n_params:,} parameters "
                     "on disk (--state-on-disk)")


def takeover_delay(n_stages: int, base_s: float = RoundConfig.takeover_s,
                   audit_budget_s: float = AuditConfig.budget_s) -> float:
    """How long past its window the k-th ranked coordinator of a round waits, per rank, before its own accepted
    set counts (:func:`hlbp.peer.rounds.rules.set_counts`): ``base_s``, plus, in a run with stage peers, the time
    the coordinator in charge may spend auditing them before it publishes.

    A coordinator audits the stage peers' pipeline frames between its close and its set, for up to
    ``audit_budget_s``. With the base delay alone, the next-ranked peer published its own set 3 s after the
    window while the first was still auditing; peers that read the records then took that set, and those that
    read later the first's, which had left out the stage peers it could not audit: measured in ``hlbp bench
    memory`` on 125m, the full replicas applied 2-member sets and the stage peers 6-member ones, and no round of
    three agreed. Every peer of a run derives the delay from the manifest's partition, so all count sets alike."""
    return base_s + (audit_budget_s if n_stages > 1 else 0.0)


def round_settings(m: Any, checkpoint_every_s: float, ef_dtype: str = "fp32",
                   state_dir: str = "") -> tuple[OuterConfig, RoundConfig]:
    """The outer optimizer and round protocol settings of run manifest ``m``: the same on every peer of the run,
    full replica or stage peer, but for ``ef_dtype``, how this peer stores its own error feedback, and
    ``state_dir``, where it keeps that and the anchor ("": in memory)."""
    hp = m.hparams
    outer = OuterConfig(kind=hp.outer, k=hp.k, beta=hp.beta, alpha=hp.alpha,  # type: ignore[arg-type]
                        outer_lr=hp.outer_lr, momentum=hp.momentum, clip_median=hp.clip_median,
                        aggregation=hp.aggregation,  # type: ignore[arg-type]
                        small_tensors=hp.small_tensors,
                        token_weighted=hp.weighting == "tokens",
                        max_tokens=hp.inner_steps * hp.batch_size * hp.seq_len,
                        ef_dtype=ef_dtype, ef_dir=state_dir)  # type: ignore[arg-type]
    rcfg = RoundConfig(run_id=m.run_id, inner_steps=hp.inner_steps, deadline_s=hp.round_deadline_s,
                       min_deadline_s=hp.min_deadline_s, max_deadline_s=hp.max_deadline_s,
                       min_contributors=hp.min_contributors, checkpoint_every_s=checkpoint_every_s,
                       gather=hp.gather, reserves=hp.reserves, unselected=hp.unselected, committee=hp.committee,
                       guard=GuardConfig(max_contribution_ratio=hp.max_contribution_ratio,
                                         max_update_ratio=hp.max_update_ratio, max_loss_jump=hp.max_loss_jump),
                       allowed_peers=frozenset(m.allowed_peers), overlap=hp.overlap, state_dir=state_dir,
                       takeover_s=takeover_delay(len(m.stages)))
    return outer, rcfg


def expected_contributors(announcements: dict[str, Any], m: Any) -> Expected:
    """The contributions a round of run ``m`` can expect from the announced peers (peer -> announcement): one from
    every online full replica, and one per stage from every swarm that has an online peer at each stage (a standby
    does not train, so it does not contribute), with the peers that may send them. The coordinator closes early
    once that many of those peers announced contributions, instead of waiting out its window."""
    full = {p for p, a in announcements.items() if a.role == "replica" and a.online and m.may_contribute(p)}
    stages: dict[int, dict[int, set[str]]] = {}
    for p, a in announcements.items():
        if a.role == "stage" and a.online and m.may_contribute(p) and a.swarm is not None and a.stage is not None:
            stages.setdefault(a.swarm, {}).setdefault(a.stage, set()).add(p)
    n_stages = len(m.stages)
    whole = [held for held in stages.values() if len(held) == n_stages]
    peers = full.union(*(p for held in whole for p in held.values()))
    shards = {p: frozenset(range(n_stages)) for p in full}
    for held in whole:
        for stage, members in held.items():
            shards.update({p: frozenset({stage}) for p in members if p not in full})
    slots = [frozenset({p}) for p in sorted(full)]
    slots += [frozenset(held[stage]) for held in whole for stage in sorted(held)]
    return Expected(len(full) + n_stages * len(whole), frozenset(peers), shards, tuple(slots))


def contributors_counter(plane: Any, m: Any) -> Callable[[], Expected]:
    """A function that reads the run's announcements and returns :func:`expected_contributors` (a count of 0 when
    the read fails: the round then waits out its window instead of closing early)."""

    def expected() -> Expected:
        try:
            peers = plane.read_peers(m.run_id)
        except Exception as exc:  # noqa: BLE001 - a failed read only means we wait for the window instead
            logger.debug("reading peers failed: %s", exc)
            return Expected(0)
        return expected_contributors({p: a.announcement for p, a in peers.items()}, m)

    return expected


def run_replica(ctx: TrainContext, options: ReplicaOptions, echo: Any = print) -> dict[str, Any]:
    """Train with outer rounds until stopped; returns (and writes to summary.json) what happened."""
    if options.threads:
        torch.set_num_threads(options.threads)
    peer = ctx.peer
    m = peer.manifest.manifest
    hp = m.hparams
    device = pick_device(options.device)
    data = prepare_data(m.data_recipe, ctx.cache_dir, tokenizer_path=peer.tokenizer_path)
    ef_dtype, moments = STATE_LAYOUTS[options.state_dtype]
    optim = inner_schedule(hp.lr, hp.schedule_total, moments)
    # what the model's state costs is measured above this (hlbp bench memory), the GPU runtime's kernels loaded
    memory.mark_baseline(device, warm=lambda: warm_runtime(replica_config(m, data.vocab_size), optim, device,
                                                           hp.batch_size, hp.seq_len))
    config, model, constraint = replica_model(m, data.vocab_size)  # every replica: bit-identical initial weights
    model.recompute = options.recompute
    # beside the checkpoint, what it does not say: the model's shape and the run's tokenizer (hlbp export, generate)
    write_model_info(ctx.out_dir, ModelInfo(m.run_id, config, data.eot_id, hp.batch_size * hp.seq_len),
                     data.tokenizer_path)
    bounds = [tuple(s) for s in m.stages]
    with torch.device("meta"):
        stages = split(config, len(bounds), bounds)
    shards = [[n for n, _ in s.named_parameters()] for s in stages]
    rank = data_rank(peer.plane.peer_id)
    stream = TokenStream(data.train, hp.seq_len, hp.batch_size, seed=m.seed, rank=rank)
    trainer = InnerTrainer(model, optim, micro_batches(stream, 1), device, constraint=constraint)
    val = val_batches(data.val, hp.seq_len, hp.batch_size, options.eval_batches) if options.eval_batches else []
    guard_batch = val_batches(data.val, hp.seq_len, hp.batch_size, 1)  # the same on every peer of the run
    state_dir = str(ctx.out_dir) if options.state_on_disk else ""
    require_state_room(state_dir, sum(p.numel() for p in model.parameters()), ef_dtype)
    outer, rcfg = round_settings(m, options.checkpoint_every_s, ef_dtype, state_dir)
    # behind NAT: say so in our notices, so that a dialable peer coordinates (hlbp.peer.rounds.rules)
    rcfg = dataclasses.replace(rcfg, dialable=peer.reachability is not Reachability.CLIENT)
    if rcfg.overlap != "none":  # the exchange's forward passes take turns with the steps they run beside
        trainer.turns = Turns()
    scorer = ParamScorer(trainer, device, separate=rcfg.overlap != "none")
    if not m.may_contribute(peer.plane.peer_id):
        echo(f"warning: this peer ({peer.plane.peer_id}) is not in run {m.run_id}'s allow-list: every other peer "
             "ignores its contributions and records and refuses to serve it, so it cannot take part. Ask the run's "
             "operator to add its peer id, or start it with an --identity file that is on the list.")
    book = AddressBook(lambda: peer.plane.read_peers(m.run_id))
    transport = P2PBlobTransport(peer.plane.dht, cancel=ctx.stop,
                                 allowed=m.may_contribute if m.allowed_peers else None, addresses=book.maddrs,
                                 dialable_peers=book.dialable)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(ctx.out_dir / "metrics.jsonl")

    if hp.outer == "noloco":  # seeded pairs instead of rounds with an accepted set (hlbp.peer.node.noloco)
        from hlbp.peer.node.noloco import run_noloco

        return run_noloco(ctx, options, trainer, transport, metrics,
                          (lambda params: scorer(params, val)) if val else None, echo, wait_for_replicas)
    expected = contributors_counter(peer.plane, m)

    exporter = None
    if options.metrics_port is not None:
        exporter = MetricsServer(options.metrics_host, options.metrics_port,
                                 PeerMetrics(peer=peer.plane.peer_id, run=m.run_id))
        echo(f"metrics: {exporter.url}")

    def on_round(stats: RoundStats, val_loss: float | None) -> None:
        if exporter is not None:
            exporter.update(stats, val_loss)
        share = "accepted" if stats.accepted else ("left out" if stats.contributed else "weight 0")
        echo(f"round {stats.round}: {stats.members} contributions, ours {share}, val {val_loss or float('nan'):.4f}, "
             f"compute {stats.compute_s:.1f}s comm {stats.comm_s:.1f}s wait {stats.wait_s:.1f}s"
             + (f" (steps waited {stats.turn_wait_s:.1f}s for turns)" if stats.turn_wait_s >= 0.05 else "") + ", "
             f"sent {stats.bytes_sent:,} B recv {stats.bytes_received:,} B, shard 0 {stats.checksums.get(0, '')[:10]}"
             + (f", resynced to round {stats.state_round}" if stats.state_round is not None else ""))

    runner_cls = DenseRoundRunner if outer.kind == "diloco" else RoundRunner
    box: list[Any] = []  # the runner, for the audits' anchor (they run inside its round close)
    extra = {} if runner_cls is DenseRoundRunner or len(bounds) < 2 else {
        "screen": pipeline_audits(m, config, model, transport,
                                  lambda: box[0].state.anchor if box[0].in_sync else None, metrics, book.stage,
                                  trainer.turns, lambda peer, shard: latest_checksum(box[0].records, peer, shard))}
    runner = runner_cls(
        peer.plane.dht, peer.plane.identity, transport, trainer, outer, shards, rcfg, ctx.stop,
        checkpoint=ctx.out_dir / "checkpoint.safetensors", metrics=metrics, expected=expected, on_round=on_round,
        evaluate=(lambda params: scorer(params, val)) if val else None,
        guard_loss=lambda _r, params: scorer(params, guard_batch),
        protect=peer.plane.protect, **extra,
    )
    box.append(runner)
    if options.faults is not None:
        options.faults(runner)
    start = time.perf_counter()
    how = runner.start()
    echo(f"replica: {how}; starting at round {runner.round}" + (RECOMPUTE_NOTE if model.recompute else ""))
    if how.fresh and options.wait_replicas > 1:
        wait_for_replicas(lambda: expected().count, options.wait_replicas, options.wait_replicas_timeout_s, ctx.stop, echo)
    try:
        history = runner.run(options.rounds)
    finally:
        runner.close()
        if exporter is not None:
            exporter.close()
        transport.close()
        metrics.close()
    summary = {
        "peer": peer.plane.peer_id,
        "run": m.run_id,
        "seconds": round(time.perf_counter() - start, 2),
        "rounds": [dataclasses.asdict(s) for s in history],
        "final_round": runner.round - 1,
        "in_sync": runner.in_sync,
        "outer": outer.kind,
    }
    atomic_write_bytes(ctx.out_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary
