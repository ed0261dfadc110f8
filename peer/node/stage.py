"""A stage peer inside a run: ``hlbp join`` hands over here after the role policy gave it stage s of swarm m.

Everything comes from the signed manifest, so every stage peer of every swarm builds identical initial weights
and the same codec:

- the run's model (for the variants A the constrained network, :func:`hlbp.peer.model.pipeline.run_model_config`),
  its stage split, and the seed's initial parameters of this stage (or this peer's own stage checkpoint, if it has
  one for the same swarm and stage);
- the activation codec the manifest names, with its basis U and anchor table T_fixed from the seed (and, for B and
  A+drift, from the seed's embedding). In B and A+drift runs the table follows the synchronized embedding: after
  every round each stage peer rebuilds it from the round's embedding, which stage 0 holds and every later stage
  follows (hlbp.peer.node.stagerounds, hlbp.peer.rounds.follow), so both sides of a boundary keep the same table.

Stage 0 drives when it has the lowest peer id among the swarm's online stage-0 peers (the others wait as
standbys for that role); stages 1..S-1 serve. A stage accepts streams only from online peers of its own swarm at
an earlier stage (and, in a closed run, on the allow-list).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch

from hlbp.peer.common import memory
from hlbp.peer.common.files import atomic_write_bytes
from hlbp.peer.data.streams import TokenStream, load_tokenizer, prepare_data, val_batches
from hlbp.peer.model.basis import fixed_table
from hlbp.peer.model.decoder import compute_shares, gradient_bytes, preset
from hlbp.peer.model.pipeline import initial_stage, initial_tensors, run_model_config
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.node.join import TrainContext, data_rank
from hlbp.peer.node.rebalance import Rebalancer
from hlbp.peer.node.replica import (  # shared with full replicas
    RECOMPUTE_NOTE,
    STATE_LAYOUTS,
    codec_config,
    inner_schedule,
)
from hlbp.peer.node.roles import Role
from hlbp.peer.node.stagerounds import PhaseStopped, make_stage_rounds, serve_phase
from hlbp.peer.node.swarmview import SwarmView
from hlbp.peer.rounds.config import RoundStats
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.gate import RoundGate
from hlbp.peer.swarm.guardslot import GuardSlot
from hlbp.peer.swarm.phase import PhaseConfig, StepLimitReached, SwarmPhase, driver_report
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.swarm.step import Schedule
from hlbp.peer.swarm.transcript import Notary
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.checkpoint import (
    load_module,
    open_checkpoint,
    optimizer_from_tensors,
    optimizer_to_tensors,
    save_checkpoint,
)
from hlbp.peer.train.export import ModelInfo, write_model_info
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.peer.train.trainer import lr_at, pick_device, warm_runtime
from hlbp.protocol.transcript import AUDIT_PREFIX

logger = logging.getLogger(__name__)


@dataclass
class StageOptions:
    """Per-peer settings of a stage peer (the manifest fixes the rest)."""

    micro_batches: int = 8  # driver: micro-batches per inner step
    schedule: Schedule = Schedule.UNIFORM  # driver: how a step's batch is cut into them
    in_flight: int | None = None  # driver: most micro-batches in the chain at once (None: all of a step's)
    deadline_s: float | None = None  # driver: fixed per-micro-batch deadline (None: from measured latency)
    switch_factor: float = 2.0  # driver: at a phase's first step a stage goes to a peer this many times faster
    stage_peers: int = 4  # driver: most peers serving one stage in a step where that pays (swarm.siblings)
    eval_every: int = 10  # driver: validation loss every this many steps (0: never)
    eval_batches: int = 4  # as a full replica's, so a swarm's and a replica's validation losses compare
    threads: int | None = None
    device: str = "auto"
    checkpoint_every_s: float = 60.0
    rebalance_period_s: float | None = None  # a move needs the same proposal twice this far apart (None: the
    # announcement lifetime, at least 30 s; 0: never move)
    faults: Callable[[StageWorker], Any] | None = None  # a fault test's wrapper of the built worker (a liar)
    round_faults: Callable[[Any], None] | None = None  # a fault test's wrapper of the built round runner's parts
    state_dtype: str = "bf16"  # this peer's own AdamW moments and error feedback (replica.STATE_LAYOUTS)
    state_on_disk: bool = True  # the anchor and error feedback in files under the out dir (common.spill), not memory
    recompute: bool = False  # each block's forward run again in the backward, its activations not held (Stage)


def _build(ctx: TrainContext, options: StageOptions) -> tuple[Any, StageWorker, Any, int, dict[str, Any]]:
    peer = ctx.peer
    m = peer.manifest.manifest
    tok, eot_id = load_tokenizer(peer.tokenizer_path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bounds = [tuple(s) for s in m.stages]
    cc = codec_config(m)
    config = run_model_config(preset(m.model, **dict(m.model_overrides), vocab_size=vocab), cc, len(bounds),
                              bounds)
    # the run's model and tokenizer beside this stage's round state: hlbp export assembles the stages of a run
    write_model_info(ctx.out_dir, ModelInfo(m.run_id, config, eot_id, m.hparams.batch_size * m.hparams.seq_len),
                     peer.tokenizer_path)
    # this stage's layers only, bit for bit the whole model's slice; the codec needs the embedding's initial value
    # (and the first stage's fixed table, rebuilt from the seed) whatever stage this is
    start, end = bounds[peer.role.stage]
    device = pick_device(options.device)
    optim = inner_schedule(m.hparams.lr, m.hparams.schedule_total, STATE_LAYOUTS[options.state_dtype][1])
    # what the stage's state costs is measured above this (hlbp bench memory), the GPU runtime's kernels loaded
    memory.mark_baseline(device, warm=lambda: warm_runtime(config, optim, device, m.hparams.batch_size,
                                                           m.hparams.seq_len))
    stage = initial_stage(config, m.seed, start, end)
    stage.recompute = options.recompute
    embed = stage.embed.weight.detach().clone() if stage.is_first else \
        initial_tensors(config, m.seed, ["embed.weight"])["embed.weight"]
    table = fixed_table(config.vocab_size, config.d_model, config.subspace_seed, config.subspace_table_std) \
        if config.subspace_rank else None
    worker = StageWorker(stage, optim, device)
    codec = make_codec(cc, config.d_model, config.vocab_size, config.max_seq_len, table, embed,
                       max_tokens=m.hparams.batch_size * m.hparams.seq_len).to(device)
    resumed = _resume(ctx, worker)
    return config, worker, codec, vocab, {"resumed_step": resumed}


def _checkpoint_path(ctx: TrainContext) -> Any:
    return ctx.out_dir / "stage.safetensors"


def _resume(ctx: TrainContext, worker: StageWorker) -> int | None:
    path = _checkpoint_path(ctx)
    if not path.exists():
        return None
    tensors, header = open_checkpoint(path)  # each tensor read from the file as it is put in place
    role = ctx.peer.role
    if header.get("swarm") != role.swarm or header.get("stage") != role.stage:
        logger.warning("ignoring %s: it holds stage %s of swarm %s, this peer now serves stage %s of swarm %s",
                       path, header.get("stage"), header.get("swarm"), role.stage, role.swarm)
        return None
    load_module(worker.stage, tensors, "model.")
    optimizer_from_tensors(worker.optimizer, tensors, header["optimizer"])
    if worker.constraint is not None:
        worker.constraint.sync()
    return int(header.get("opt_step", 0))


def save_stage(ctx: TrainContext, worker: StageWorker, opt_step: int) -> None:
    """This peer's stage, its AdamW state and where it belongs, atomically."""
    tensors = {f"model.{k}": v for k, v in worker.stage.state_dict().items()}
    opt, desc = optimizer_to_tensors(worker.optimizer)
    tensors.update(opt)
    role = ctx.peer.role
    save_checkpoint(_checkpoint_path(ctx), tensors, {"swarm": role.swarm, "stage": role.stage,
                                                     "opt_step": opt_step, "optimizer": desc})


def run_stage(ctx: TrainContext, options: StageOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve (or, at stage 0, drive) this peer's stage until stopped or ``ctx.max_steps`` steps; returns the
    summary it also writes to ``summary.json``.

    An idle stage peer may move to a stage another swarm lacks (hlbp.peer.node.rebalance): it then stops its
    stage, re-announces the new swarm and stage, drops the old role's checkpoints (their shard is somebody
    else's now) and starts the new stage from the round state it syncs."""
    if options.threads:
        torch.set_num_threads(options.threads)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    moves: list[dict[str, Any]] = []
    while True:
        inner = dataclasses.replace(ctx, stop=_linked(ctx.stop))
        summary, move = _run_role(inner, options, echo)
        inner.stop.set()
        summary["moves"] = moves
        atomic_write_bytes(ctx.out_dir / "summary.json", json.dumps(summary, indent=1).encode())
        if move is None or ctx.stop.is_set():
            return summary
        peer = ctx.peer
        old = peer.role
        echo(f"moving from stage {old.stage} of swarm {old.swarm} to stage {move.stage} of swarm {move.swarm}: "
             f"{move.reason}")
        moves.append({"from": [old.swarm, old.stage], "to": [move.swarm, move.stage], "reason": move.reason})
        peer.role = move
        peer.heartbeat.update(swarm=move.swarm, stage=move.stage)
        peer.heartbeat.beat()
        for name in ("stage.safetensors", "rounds.safetensors"):
            (ctx.out_dir / name).unlink(missing_ok=True)


def _linked(outer: threading.Event) -> threading.Event:
    """An event set when ``outer`` is, that can also be set alone (one role's life inside the process's)."""
    inner = threading.Event()

    def follow() -> None:
        while not inner.is_set():
            if outer.wait(0.5):
                inner.set()

    threading.Thread(target=follow, name="hlbp-stage-stop", daemon=True).start()
    return inner


def _run_role(ctx: TrainContext, options: StageOptions,
              echo: Callable[[str], None]) -> tuple[dict[str, Any], Role | None]:
    """One role's life: build, serve or drive, and the summary plus the confirmed move that ended it (if any)."""
    role = ctx.peer.role
    config, worker, codec, vocab, info = _build(ctx, options)
    if options.faults is not None:
        worker = options.faults(worker)
    view = SwarmView(ctx.peer.plane, ctx.peer.manifest.manifest, role.swarm)
    where = f"stage {role.stage} of swarm {role.swarm}"
    echo(f"{where}: {sum(p.numel() for p in worker.stage.parameters()):,} parameters, codec {codec_config(ctx.peer.manifest.manifest).label(config.d_model)}"
         + (f", resumed from step {info['resumed_step']}" if info["resumed_step"] is not None else "")
         + (RECOMPUTE_NOTE if worker.stage.recompute else ""))
    moved: list[Role] = []
    if role.stage == 0:
        summary = _drive(ctx, options, worker, codec, vocab, view, echo, info["resumed_step"] or 0, config, moved)
    else:
        summary = _serve(ctx, options, worker, codec, vocab, view, echo, config, moved)
    return summary, (moved[0] if moved else None)


def _rebalancer(ctx: TrainContext, options: StageOptions, view: SwarmView, work: Callable[[], int]) -> Rebalancer:
    peer = ctx.peer
    period = options.rebalance_period_s
    return Rebalancer(peer.plane.peer_id, peer.role, peer.capacity.throughput, len(peer.manifest.manifest.stages),
                      view, work, period_s=max(peer.heartbeat.ttl, 30.0) if period is None else period)


def _round_echo(echo: Callable[[str], None], stage: int) -> Callable[[RoundStats, float | None], None]:
    def on_round(stats: RoundStats, val_loss: float | None) -> None:
        share = "accepted" if stats.accepted else ("left out" if stats.contributed else "weight 0")
        echo(f"round {stats.round}: {stats.members} contributions, ours {share}"
             + (f", val {val_loss:.4f}" if val_loss is not None else "")
             + f", shard {stage} {stats.checksums.get(stage, '')[:10]}" + ("" if stats.in_sync else ", out of sync")
             + (f", resynced to round {stats.state_round}" if stats.state_round is not None else ""))
    return on_round


def _serve(ctx: TrainContext, options: StageOptions, worker: StageWorker, codec: Any, vocab: int, view: SwarmView,
           echo: Callable[[str], None], config: Any, moved: list[Role]) -> dict[str, Any]:
    m = ctx.peer.manifest.manifest
    stage = ctx.peer.role.stage or 0
    last = {"step": 0, "saved": time.monotonic(), "echo": 0.0}
    done = threading.Event()

    def on_step(msg: Any, ok: bool) -> None:
        last["step"] = msg.opt_step + 1
        now = time.monotonic()
        if now - last["saved"] >= options.checkpoint_every_s:
            save_stage(ctx, worker, last["step"])
            last["saved"] = now
        if now - last["echo"] >= 5:
            echo(f"step {msg.opt_step}: {'applied' if ok else 'skipped (non-finite gradients)'}, "
                 f"busy {server.busy_fraction():.0%}")
            last["echo"] = now
        if ctx.max_steps is not None and server.counters.steps_applied >= ctx.max_steps:
            done.set()

    gate = RoundGate()
    gate.close_between_steps(0.0)  # no step before this peer holds the round's state (stragglers wait, pinged)
    metrics = MetricsLog(ctx.out_dir / "metrics.jsonl")
    phase: list[Callable[[int], tuple[int, int]]] = []
    notary = Notary(ctx.peer.plane.identity)  # the frames this stage receives, signed, served to auditors
    slot = GuardSlot()  # the round's candidate while the swarm's driver scores it through the chain
    runner, transport = make_stage_rounds(ctx, worker, config, lambda r: phase[0](r), metrics,
                                          options.checkpoint_every_s, on_round=_round_echo(echo, stage), codec=codec,
                                          driven=True, notary=notary, ef_dtype=STATE_LAYOUTS[options.state_dtype][0],
                                          state_dir=str(ctx.out_dir) if options.state_on_disk else "",
                                          swarm_mates=lambda: view.members() - {ctx.peer.plane.peer_id},
                                          guard_loss=slot.score)
    if options.round_faults is not None:
        options.round_faults(runner)
    transport.put_lazy_prefix(AUDIT_PREFIX, notary.transcript.resolve)
    phase.append(serve_phase(runner, gate, worker, ctx.stop, dead_step_s=30.0))

    def rounds() -> None:
        try:
            while not ctx.stop.is_set() and not done.is_set():
                try:
                    _keep(runner, runner.run_round())  # a report may come a round late (rounds/beside.py)
                finally:
                    gate.open(runner.round)
            _keep(runner, runner.finish_rounds())
        except PhaseStopped:
            pass
        except Exception:  # a round loop that fails leaves the stage serving; the log says why
            logger.exception("the round loop of stage %d stopped", stage)
        finally:
            runner.quiesce_rounds()  # nothing may still write the round state while it is saved

    server = StageServer(ctx.peer.plane.dht, worker, codec, vocab,
                         lambda p: view.may_call(p, stage),
                         max_tokens=m.hparams.batch_size * m.hparams.seq_len, on_step=on_step, gate=gate,
                         notary=notary, slot=slot, sibling=lambda p: view.at_same_stage(p, stage))
    echo(f"serving stage {stage} as {server.peer_id}")
    thread = threading.Thread(target=rounds, name="hlbp-stage-rounds", daemon=True)
    try:
        # the stream handler is up before the state sync, so a driver that finds this peer already announced
        # is told to wait ("round" answers to its pings) instead of failing to open a stream and banning it
        echo(f"rounds: {runner.start()}; at round {runner.round}")
        gate.open(runner.round)
        thread.start()
        rebalance = _rebalancer(ctx, options, view, lambda: server.counters.steps_applied)
        while not ctx.stop.is_set() and not done.is_set():
            ctx.stop.wait(0.5)
            move = rebalance.check()
            if move is not None:
                moved.append(move)
                ctx.stop.set()  # this role's stop only (run_stage links it to the process's)
    finally:
        server.close()
        if thread.is_alive():
            thread.join(timeout=30)
        if thread.ident is not None:  # started: its round state is worth saving
            runner.save()
        runner.close()
        transport.close()
        metrics.close()
        save_stage(ctx, worker, last["step"])
    c = server.counters
    echo(f"stage {stage}: {c.steps_applied} steps applied, {c.forwards} forwards, {c.backwards} "
         f"backwards, {c.frames_refused} frames refused, busy {server.busy_fraction():.0%}, "
         f"{len(runner.history)} rounds")
    return {"peer": ctx.peer.plane.peer_id, "role": "stage", "stage": stage,
            "swarm": ctx.peer.role.swarm, **{k: v for k, v in dataclasses.asdict(c).items() if k != "started"},
            "busy_fraction": server.busy_fraction(), "rounds": [dataclasses.asdict(r) for r in runner.history],
            "final_round": runner.round - 1, "in_sync": runner.in_sync}


def _keep(runner: Any, stats: RoundStats | None) -> None:
    """Keep a round's report in the runner's history (None: no round was reported by that call)."""
    if stats is not None:
        runner.history.append(stats)


def _is_driver(view: SwarmView, me: str) -> bool:
    stage0 = [p for p, _, _ in view.at_stage(0)]
    return not stage0 or min(stage0 + [me]) == me


def _stand_by(ctx: TrainContext, view: SwarmView, rebalance: Rebalancer, echo: Callable[[str], None]) -> Role | None:
    """Wait while another stage-0 peer drives this swarm; the confirmed move that ends the wait, if any."""
    me = ctx.peer.plane.peer_id
    if not _is_driver(view, me):
        echo("another stage-0 peer drives this swarm; standing by")
    while not _is_driver(view, me) and not ctx.stop.is_set():
        ctx.stop.wait(1.0)
        move = rebalance.check()
        if move is not None:
            return move
    return None


def _swarm_phase(ctx: TrainContext, options: StageOptions, worker: StageWorker, codec: Any, vocab: int,
                 view: SwarmView, echo: Callable[[str], None], start_step: int, metrics: MetricsLog,
                 round_closed: Callable[[int], bool], banned: Callable[[], AbstractSet[str]]) -> SwarmPhase:
    """The driving peer's phase: its data stream, validation batches and driver, from the manifest.
    ``banned()``: the peers the last accepted set names banned (a stage peer caught lying by a pipeline audit
    among them), whom the driver routes around."""
    peer = ctx.peer
    m = peer.manifest.manifest
    data = prepare_data(m.data_recipe, ctx.cache_dir, tokenizer_path=peer.tokenizer_path)
    stream = TokenStream(data.train, m.hparams.seq_len, m.hparams.batch_size, seed=m.seed,
                         rank=data_rank(peer.plane.peer_id))
    # the validation batches every replica of the run scores (the full replicas' too, so losses compare)
    val = val_batches(data.val, m.hparams.seq_len, m.hparams.batch_size, options.eval_batches) \
        if options.eval_batches else []
    n_stages = len(m.stages)

    def candidates() -> list[list[Candidate]]:
        out = banned()
        return [[Candidate(p, t, bandwidth=b) for p, t, b in view.at_stage(s) if p not in out]
                for s in range(1, n_stages)]

    cfg = DriverConfig(micro_batches=options.micro_batches, schedule=options.schedule, in_flight=options.in_flight,
                       deadline_s=options.deadline_s, switch_factor=options.switch_factor,
                       stage_peers=options.stage_peers)
    step_tokens = m.hparams.batch_size * m.hparams.seq_len
    shares = compute_shares(worker.stage.config, m.stages, m.hparams.seq_len)[1:]
    # what a trade between the peers of each stage moves: the driver shares a stage only where that pays
    grad_bytes = gradient_bytes(worker.stage.config, m.stages[1:]) if options.stage_peers > 1 else []
    driver = Driver(peer.plane.dht, worker, codec, vocab, cfg, candidates, max_tokens=step_tokens, stop=ctx.stop,
                    notary=Notary(peer.plane.identity), shares=shares, grad_bytes=grad_bytes)
    optim = inner_schedule(m.hparams.lr, m.hparams.schedule_total)
    phase_cfg = PhaseConfig(inner_steps=m.hparams.inner_steps, step_tokens=step_tokens,
                            eval_every=options.eval_every, checkpoint_every_s=options.checkpoint_every_s,
                            max_steps=ctx.max_steps)
    # the run's guard batch, the one every full replica scores each round's result on before it commits
    guard_batch = val_batches(data.val, m.hparams.seq_len, m.hparams.batch_size, 1)[0]
    return SwarmPhase(driver, stream, val, metrics, phase_cfg, lr=lambda step: lr_at(step, optim),
                      save=lambda step: save_stage(ctx, worker, step), round_closed=round_closed, stop=ctx.stop,
                      echo=echo, start_step=start_step, guard_batch=guard_batch)


def _drive(ctx: TrainContext, options: StageOptions, worker: StageWorker, codec: Any, vocab: int, view: SwarmView,
           echo: Callable[[str], None], start_step: int, config: Any, moved: list[Role]) -> dict[str, Any]:
    """Stage 0: stand by while another peer drives, then drive the swarm's inner phases inside the round loop."""
    peer = ctx.peer
    m = peer.manifest.manifest
    me = peer.plane.peer_id
    swarm: SwarmPhase | None = None  # built once this peer drives; until then its work counts 0 steps
    rebalance = _rebalancer(ctx, options, view, lambda: swarm.steps_done() if swarm is not None else 0)
    move = _stand_by(ctx, view, rebalance, echo)
    if move is not None:
        moved.append(move)
        return {"peer": me, "role": "stage", "stage": 0, "swarm": peer.role.swarm, "driver": False}
    metrics = MetricsLog(ctx.out_dir / "metrics.jsonl")
    # driving: the same phase as swarm, never None, for the closures below (they run once it exists)
    driving = swarm = _swarm_phase(ctx, options, worker, codec, vocab, view, echo, start_step, metrics,
                                   round_closed=lambda r: runner.round_closed(r),
                                   banned=lambda: set(runner.history[-1].banned) if runner.history else set())

    def phase(r: int) -> tuple[int, int]:
        try:
            return driving.run(r)
        except StepLimitReached as exc:
            raise PhaseStopped(str(exc)) from exc

    runner, transport = make_stage_rounds(ctx, worker, config, phase, metrics, options.checkpoint_every_s,
                                          evaluate=driving.score if driving.val else None,
                                          on_round=_round_echo(echo, 0), codec=codec, notary=driving.driver.notary,
                                          ef_dtype=STATE_LAYOUTS[options.state_dtype][0],
                                          state_dir=str(ctx.out_dir) if options.state_on_disk else "",
                                          swarm_mates=lambda: view.members() - {ctx.peer.plane.peer_id},
                                          guard_loss=driving.guard)
    if options.round_faults is not None:
        options.round_faults(runner)
    if driving.driver.notary is not None:  # the frames the driver receives, signed, served to auditors
        transport.put_lazy_prefix(AUDIT_PREFIX, driving.driver.notary.transcript.resolve)
    echo(f"driving swarm {peer.role.swarm}: {len(m.stages)} stages, {options.micro_batches} micro-batches per "
         f"step ({options.schedule.value}), {m.hparams.inner_steps} steps per round; rounds: {runner.start()}; at round {runner.round}")
    try:
        driving.validate_first()
        while not ctx.stop.is_set():
            try:
                _keep(runner, runner.run_round())  # a report may come a round late (rounds/beside.py)
            except PhaseStopped:
                break
            move = rebalance.check()
            if move is not None:
                moved.append(move)
                break
        _keep(runner, runner.finish_rounds())
        driving.validate_last()
    finally:
        runner.quiesce_rounds()  # nothing may still write the round state while it is saved
        driving.close()
        runner.save()
        runner.close()
        transport.close()
        metrics.close()
        driving.save()
    summary = driving.summary()
    echo(driver_report(summary))
    return {"peer": me, "role": "stage", "stage": 0, "swarm": peer.role.swarm, "driver": True, **summary,
            "data_rank": data_rank(me), "rounds": [dataclasses.asdict(r) for r in runner.history],
            "final_round": runner.round - 1, "in_sync": runner.in_sync}
