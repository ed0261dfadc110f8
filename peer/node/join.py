"""``hlbp join``: attach to a run, measure this machine, pick a role, announce it, then train until stopped.

The steps, in order, each with a bounded wait:

1. connect to the initial peers (exponential backoff; a clear error listing every address);
2. fetch and verify the run manifest (signature, signer trust, protocol version);
3. check that others can dial us; if not, fall back to DHT client mode and say how to fix it (a full replica still
   contributes, over the connections it opens; a stage peer is refused: hlbp.peer.net.reach);
4. fetch the run's artifacts by content hash from any peer that serves them;
5. measure memory, tokens/s and bandwidth (each can be forced by a flag);
6. choose a role with hlbp.peer.node.roles and announce it; a heartbeat keeps the record fresh;
7. hand over to the training hook: a full replica joins outer rounds (:mod:`hlbp.peer.node.replica`), a stage
   peer serves or drives its pipeline stage (:mod:`hlbp.peer.node.stage`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from hlbp.peer.common import allocator
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.light.trust import trusted_signers
from hlbp.peer.net.control import ControlPlane, NetworkConfig, software_version
from hlbp.peer.net.heartbeat import Heartbeat
from hlbp.peer.net.reach import Reachability
from hlbp.peer.net.validation import load_or_create_identity
from hlbp.peer.node.capacity import measure, measure_bandwidth, measure_throughput, model_warmup
from hlbp.peer.node.roles import (
    STAGE_EXTRA_GB,
    Capacity,
    PeerView,
    Role,
    StateLayout,
    Thresholds,
    activation_bytes,
    choose_role,
    recompute_hint,
    training_memory_gb,
)
from hlbp.protocol.announcement import Announcement
from hlbp.protocol.identity import sha256_hex
from hlbp.protocol.manifest import Manifest, SignedManifest

logger = logging.getLogger(__name__)

TOKENIZER_ARTIFACT = "tokenizer.json"


@dataclass
class JoinConfig:
    """Everything ``hlbp join`` needs; each field is one CLI flag and one HLBP_* variable."""

    net: NetworkConfig = field(default_factory=NetworkConfig)
    identity: Path | None = None  # persistent key file; None: a fresh identity for this session only
    manifest_signers: list[str] = field(default_factory=list)  # trusted signers; empty: the initial peers
    role: str | None = None  # force replica or stage
    stage: int | None = None  # force this stage (implies role stage)
    swarm: int | None = None  # force this pipeline swarm (implies role stage)
    memory_gb: float | None = None  # force available memory instead of measuring it
    throughput: float | None = None  # force full-model tokens/s instead of a warm-up
    bandwidth: float | None = None  # force bytes/s instead of a probe
    ttl: float = 60.0  # seconds our record lives without a heartbeat (heartbeat every ttl/3)
    reachability: str = "auto"  # auto: ask a peer to dial us back; public: skip; client: DHT client mode
    manifest_timeout_s: float = 30.0  # how long to wait for the manifest to appear
    cache_dir: Path | None = None  # artifacts and data cache; None: hlbp.peer.data.streams's default
    probe_bytes: int = 4 << 20  # bytes downloaded to measure bandwidth
    train: bool = True  # False: announce and hold the role without training (tests, dry runs)
    max_steps: int | None = None  # stop training after this many steps, then leave
    out_dir: Path = Path("runs/join")  # checkpoints and metrics of local training
    layout: StateLayout = field(default_factory=StateLayout)  # how the state is kept: the memory a role needs


@dataclass
class JoinedPeer:
    """A peer that has announced its role. :meth:`leave` marks it offline and stops the DHT."""

    plane: ControlPlane
    heartbeat: Heartbeat
    manifest: SignedManifest
    role: Role
    capacity: Capacity
    tokenizer_path: Path
    join_seconds: float  # from the start of join() to the first announcement
    reachability: Reachability  # whether others could dial it back at join
    _tmp: tempfile.TemporaryDirectory | None = None

    def leave(self) -> None:
        try:
            self.heartbeat.leave()
        finally:
            self.plane.shutdown()
            if self._tmp is not None:
                self._tmp.cleanup()


def _cache_dir(cfg: JoinConfig) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    from hlbp.peer.data.streams import default_cache_dir

    return default_cache_dir()


DIALBACK_DEADLINE_S = 60.0  # how long join keeps asking helpers to dial it back before calling itself unknown
DIALBACK_RETRY_S = 2.0  # the pause between passes over the helpers


def check_reachability(plane: ControlPlane, helpers: list[str], deadline_s: float = DIALBACK_DEADLINE_S,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic) -> tuple[Reachability, list[str]]:
    """(whether others can dial us, our addresses) after asking the first helper that answers to dial us.

    A helper that fails to answer (busy, or its stream to us not yet open) is asked again, in turn with the others,
    until ``deadline_s``: one failed request must not leave a public peer announcing itself as unknown."""
    maddrs = plane.maddrs()
    deadline = clock() + deadline_s
    while True:
        for peer_id in helpers:
            try:
                reachable, _ = plane.dial_back(peer_id, maddrs)
            except Exception as exc:  # noqa: BLE001 - a helper that can't help now: ask the next one
                logger.debug("dial-back through %s failed: %s", peer_id, exc)
                continue
            return (Reachability.PUBLIC if reachable else Reachability.CLIENT), maddrs
        if not helpers or clock() + DIALBACK_RETRY_S >= deadline:
            return Reachability.UNKNOWN, maddrs
        sleep(DIALBACK_RETRY_S)


def _port_fix(maddrs: list[str]) -> str:
    """What makes this machine dialable: the port to forward and the flags that announce it."""
    ports = sorted({a.split("/tcp/")[1].split("/")[0] for a in maddrs if "/tcp/" in a})
    return (f"forward TCP port {', '.join(ports) or '<port>'} on your router to this machine, or listen on a fixed "
            "forwarded port with --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/<public IP>/tcp/PORT")


def reachability_line(reachability: Reachability, role_kind: str, maddrs: list[str], checked: bool = True) -> str:
    """The one line ``hlbp join`` prints about how others reach this peer, and so how its work travels
    (``checked``: a peer was asked to dial us back; False: --reachability public or client said so)."""
    if reachability is Reachability.PUBLIC:
        why = "a peer of the run dialled us back" if checked else "--reachability public, not checked"
        return f"reachability: public ({why}); others fetch from this peer directly"
    if reachability is Reachability.UNKNOWN:
        return "reachability: unknown (no peer answered the dial-back check); assuming others can dial this peer"
    what = "its contributions" if role_kind == "replica" else "what it serves"
    why = f"no peer could dial {', '.join(maddrs) or 'any of our addresses'}" if checked else \
        "--reachability client, not checked"
    return (f"reachability: behind NAT ({why}); this "
            f"peer runs as a DHT client and serves {what} over the connections it opens to public peers, and "
            f"coordinates a round only when no public peer contributed. To be dialable, {_port_fix(maddrs)}")


def stage_refusal(maddrs: list[str], replica_fits: bool, checked: bool = True) -> str:
    """Why a peer behind NAT may not hold a pipeline stage, and what fixes it (``checked``: as in
    :func:`reachability_line`)."""
    instead = "; or join as a full replica with --role replica, which works behind NAT" if replica_fits else ""
    why = (f"no peer of the run could dial this machine at {', '.join(maddrs) or 'any address'} (behind NAT or a "
           "firewall)") if checked else "--reachability client says nobody can dial this machine"
    return (f"a stage peer must be dialable, and {why}: its neighbours open streams to it "
            f"for every micro-batch, and activations through relays are too slow and relays drop after 30 minutes. "
            f"To fix it, {_port_fix(maddrs)}{instead}")


def tokenizer_vocab(path: Path) -> int | None:
    """The vocabulary size of the run's tokenizer file at ``path``, or None where it does not load as one (the
    file's hash matched the signed manifest, but a peer that only announces never parses it otherwise, and a role's
    sizing must not stop it from joining: the preset's vocabulary is used then)."""
    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for any bad file
        logger.info("the run's tokenizer does not load (%s); sizing roles with the preset's vocabulary", exc)
        return None


def thresholds_for(m: Manifest, layout: StateLayout | None = None, vocab_size: int | None = None) -> Thresholds:
    """The memory a full replica and the most demanding stage of run ``m`` need, kept as ``layout`` says: their
    parameters (counted on the meta device: no memory, no time) and what a step of the manifest's batch holds for
    its backward (:func:`~hlbp.peer.node.roles.training_memory_gb`). ``vocab_size``: the run tokenizer's, which
    sizes the embedding and the head the peer will build (None: the preset's)."""
    import torch

    from hlbp.peer.model.decoder import Stage, build_model, count_parameters, preset

    layout = layout or StateLayout()
    config = preset(m.model, **{**m.model_overrides, **({"vocab_size": vocab_size} if vocab_size else {})})
    tokens = m.hparams.batch_size * m.hparams.seq_len  # a replica's step; every micro-batch of it in a stage at once

    def need(n_params: int, layers: int, head: bool, extra_gb: float) -> float:
        held = activation_bytes(config.d_model, config.d_ff, layers, config.vocab_size, tokens, layout.recompute,
                                head)
        return training_memory_gb(n_params, held, layout, extra_gb)

    with torch.device("meta"):
        replica = need(count_parameters(build_model(config)), config.n_layers, True, 0.0)
        stage = max(need(count_parameters(Stage(config, a, b)), b - a, b == config.n_layers, STAGE_EXTRA_GB)
                    for a, b in m.stages)
    return Thresholds(replica_memory_gb=replica, stage_memory_gb=stage,
                      replica_min_throughput=m.placement.replica_min_throughput,
                      max_peers_per_stage=m.placement.max_peers_per_stage)


def _fetch_tokenizer(plane: ControlPlane, signed: SignedManifest, sources: list[str], cache: Path) -> Path:
    m = signed.manifest
    art = m.artifact(TOKENIZER_ARTIFACT)
    if art is None or art.sha256 != m.tokenizer_hash:
        raise UserInputError(f"the run manifest of {m.run_id} lists no tokenizer.json artifact matching its hash")
    path = cache / "artifacts" / art.sha256 / art.name
    if path.exists() and sha256_hex(path.read_bytes()) == art.sha256:
        return path
    return plane.fetch_artifact(art, sources, path)


def _sources(plane: ControlPlane, signed: SignedManifest, anchors: set[str], sha: str) -> list[str]:
    """Peers serving ``sha``: trusted anchors first, then the manifest signer, then every other announcer."""
    peers = plane.read_peers(signed.manifest.run_id)
    serving = [p for p, rec in peers.items() if rec.announcement.online and sha in rec.announcement.artifacts]
    order = sorted(anchors) + [signed.signer] + sorted(serving)
    seen: list[str] = []
    for p in order:
        if p != plane.peer_id and p not in seen and (p in serving or p in anchors or p == signed.signer):
            seen.append(p)
    return seen


def join(cfg: JoinConfig, echo: Callable[[str], None]) -> JoinedPeer:
    """Run steps 1-6 of the module docstring; returns the announced peer (the caller trains, then leaves)."""
    start = time.perf_counter()
    if cfg.reachability not in ("auto", "public", "client"):
        raise UserInputError(f"--reachability must be auto, public or client, got {cfg.reachability!r}")
    if cfg.ttl < 1:
        raise UserInputError(f"--ttl must be at least 1 second, got {cfg.ttl}")
    if not cfg.net.initial_peers:
        raise UserInputError("pass --initial-peers (or HLBP_INITIAL_PEERS): the multiaddr `hlbp bootstrap` printed")
    tmp = None
    if cfg.identity is None:
        tmp = tempfile.TemporaryDirectory(prefix="hlbp-id-")
        identity_path = Path(tmp.name) / "identity.key"
    else:
        identity_path = Path(cfg.identity).expanduser()
    identity = load_or_create_identity(identity_path)
    anchors, explicit = trusted_signers(cfg.net.initial_peers, cfg.manifest_signers)
    if cfg.reachability == "client":
        cfg.net.client_mode = True

    plane = ControlPlane.connect(cfg.net, identity_path, identity=identity)
    try:
        echo(f"connected as {plane.peer_id} in {time.perf_counter() - start:.1f} s")
        signed = plane.find_manifest(anchors, explicit, cfg.manifest_timeout_s)
        m = signed.manifest
        plane.watch_run(m.run_id)
        echo(f"run {m.run_id}: model {m.model}, {len(m.stages)} stages, signed by {signed.signer}")

        reachability = Reachability.CLIENT if cfg.net.client_mode else Reachability.PUBLIC
        maddrs = plane.maddrs()
        if cfg.reachability == "auto":
            helpers = [a for a in sorted(anchors) if a != plane.peer_id] + [signed.signer]
            reachability, maddrs = check_reachability(plane, list(dict.fromkeys(helpers)))
            if reachability is Reachability.CLIENT:
                plane.shutdown()
                cfg.net.client_mode = True
                plane = ControlPlane.connect(cfg.net, identity_path, run_ids=(m.run_id,), identity=identity)

        cache = _cache_dir(cfg)
        sources = _sources(plane, signed, anchors, m.tokenizer_hash)
        tokenizer_path = _fetch_tokenizer(plane, signed, sources, cache)
        plane.serve_artifacts({m.tokenizer_hash: tokenizer_path})
        plane.serve_snapshot(m.run_id)

        vocab_size = tokenizer_vocab(tokenizer_path)
        thresholds = thresholds_for(m, cfg.layout, vocab_size)
        probe_peer = sources[0] if sources else signed.signer

        def throughput_fn(memory_gb: float) -> float:
            factory, spec = model_warmup(m.model, m.model_overrides, m.stages, m.hparams.batch_size,
                                         m.hparams.seq_len, memory_gb >= thresholds.replica_memory_gb)
            return measure_throughput(factory, spec, seed=m.seed)

        def bandwidth_fn() -> float:
            return measure_bandwidth(lambda n: plane.probe(probe_peer, n), cfg.probe_bytes)

        probe_start = time.perf_counter()
        capacity = measure(cfg.memory_gb, cfg.throughput, cfg.bandwidth, throughput_fn, bandwidth_fn)
        probe_s = time.perf_counter() - probe_start
        peers = plane.read_peers(m.run_id)
        views = [
            PeerView(p, r.announcement.role, r.announcement.swarm, r.announcement.stage, r.announcement.throughput)
            for p, r in peers.items() if r.announcement.online and p != plane.peer_id
        ]
        force_role = cfg.role
        if m.hparams.outer == "noloco":  # pairs of whole models: a noloco run has no pipeline swarms
            if cfg.role == "stage" or cfg.stage is not None or cfg.swarm is not None:
                raise UserInputError(f"run {m.run_id} uses noloco, which pairs full replicas only: stage peers "
                                     "cannot join it; drop --role stage/--stage/--swarm")
            force_role = "replica"
        try:
            role = choose_role(capacity, views, len(m.stages), thresholds, force_role=force_role, force_stage=cfg.stage,
                               force_swarm=cfg.swarm)
        except ValueError as exc:
            raise UserInputError(str(exc)) from None
        if not role.fits:
            need = thresholds.replica_memory_gb if role.kind == "replica" else thresholds.stage_memory_gb
            message = (f"this machine has {capacity.memory_gb:.1f} GB available but a {role.kind} of {m.model} needs "
                       f"about {need:.1f} GB")
            if cfg.role is None and cfg.stage is None and cfg.swarm is None:
                raise UserInputError(message + "; free memory, or force a role with --role/--stage")
            echo(f"warning: {message}; continuing because the role was forced")
        if role.kind == "stage" and reachability is Reachability.CLIENT:
            raise UserInputError(stage_refusal(maddrs, capacity.memory_gb >= thresholds.replica_memory_gb,
                                               checked=cfg.reachability == "auto"))

        record = Announcement(
            run_id=m.run_id, role=role.kind, swarm=role.swarm, stage=role.stage, throughput=capacity.throughput,
            bandwidth=capacity.bandwidth, memory_gb=capacity.memory_gb, software=software_version(),
            reachability=reachability.value, maddrs=tuple(plane.maddrs()[:8]), artifacts=(m.tokenizer_hash,),
            manifest_signer=signed.signer, manifest_digest=signed.digest,
        )
        heartbeat = Heartbeat(plane, record, cfg.ttl, manifest=signed)
        heartbeat.start()
    except BaseException:
        plane.shutdown()
        if tmp is not None:
            tmp.cleanup()
        raise
    seconds = time.perf_counter() - start
    where = "full replica" if role.kind == "replica" else f"stage {role.stage} of swarm {role.swarm}"
    echo(f"role: {where} ({role.reason})")
    if role.kind == "stage" and not cfg.layout.recompute:
        recomputed = thresholds_for(m, dataclasses.replace(cfg.layout, recompute=True), vocab_size)
        forced = cfg.role is not None or cfg.stage is not None or cfg.swarm is not None
        hint = recompute_hint(capacity.memory_gb, role, thresholds, recomputed, forced=forced)
        if hint:
            echo(f"hint: {hint}")
    echo(f"capacity: {capacity.memory_gb:.1f} GB, {capacity.throughput:,.0f} tok/s, "
         f"{capacity.bandwidth / 1e6:,.1f} MB/s (measured in {probe_s:.1f} s; --throughput and --bandwidth skip it)")
    echo(reachability_line(reachability, role.kind, maddrs, checked=cfg.reachability == "auto"))
    echo(allocator.status_line(allocator.running_jemalloc(), allocator.find_jemalloc() is not None))
    echo(f"announced in {seconds:.1f} s ({heartbeat.last_size}-byte record, refreshed every {cfg.ttl / 3:.0f} s)")
    return JoinedPeer(plane, heartbeat, signed, role, capacity, tokenizer_path, seconds, reachability, tmp)


# ---------------------------------------------------------------------------------------------------------------
# After the announcement: training
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainContext:
    """What a training hook gets: the run, this peer's role, and when to stop."""

    peer: JoinedPeer
    max_steps: int | None  # None: until stopped
    out_dir: Path  # this peer's checkpoint and metrics directory
    cache_dir: Path | None  # hlbp.peer.data.streams's cache; None: its default
    stop: threading.Event  # set on SIGTERM/SIGINT; a hook returns soon after


TrainHook = Callable[[TrainContext], None]


def data_rank(peer_id: str) -> int:
    """A stable per-peer data-stream rank, so replicas draw different windows and a restart draws the same."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % 65536


def run_local(ctx: TrainContext) -> None:
    """``--local-only``: a full replica trains alone with the inner trainer, without outer rounds; any other role
    holds its place until stopped."""
    peer = ctx.peer
    if peer.role.kind != "replica":
        ctx.stop.wait()
        return
    from hlbp.peer.train.local import LocalRunConfig, run_local_training
    from hlbp.peer.train.trainer import OptimConfig

    m = peer.manifest.manifest
    steps = ctx.max_steps if ctx.max_steps is not None else 1_000_000
    cfg = LocalRunConfig(
        model=m.model, steps=steps, batch_size=m.hparams.batch_size, seq_len=m.hparams.seq_len,
        data=m.data_recipe, tokenizer=peer.tokenizer_path, cache_dir=ctx.cache_dir, seed=m.seed, rank=data_rank(peer.plane.peer_id),
        out_dir=ctx.out_dir, resume=True, progress=True, optim=OptimConfig(lr=m.hparams.lr),
    )
    if m.model_overrides:
        logger.warning("local training uses preset %s without the run's model overrides %s", m.model,
                       m.model_overrides)
    run_local_training(cfg)
