"""The flags of ``hlbp join`` as one dataclass: declared once, checked once, made into the peer's JoinPlan once.

Each field is a flag and an ``HLBP_*`` variable (:func:`hlbp.cli.options.flag`); :func:`hlbp.cli.options.flags_command`
builds the command from them. Peer-side types are imported only in :meth:`JoinFlags.plan`, so ``hlbp --help``
stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hlbp.cli.options import ANNOUNCE_HELP, INITIAL_PEERS_HELP, flag, parse_flags, split_values
from hlbp.peer.common.errors import UserInputError

MAX_STAGE_PEERS = 8  # hlbp.protocol.stagewire.MAX_STAGE_PEERS, not imported here: that module pulls in torch

SCHEDULES = ("uniform", "tapered")  # hlbp.peer.swarm.step.Schedule's values (not imported here: it imports torch)

if TYPE_CHECKING:
    from hlbp.peer.node.session import JoinPlan

@dataclass
class JoinFlags:
    """What ``hlbp join`` was told. Refuses values no peer can run with (UserInputError, before joining)."""

    initial_peers: list[str] = flag([], "--initial-peers", env="INITIAL_PEERS", help=INITIAL_PEERS_HELP,
                                    metavar="MULTIADDR")
    host_maddrs: list[str] = flag(["/ip4/0.0.0.0/tcp/0"], "--host-maddrs", env="HOST_MADDRS",
                                  help="Multiaddrs to listen on; a fixed port helps others dial you.",
                                  metavar="MULTIADDR")
    announce_maddrs: list[str] = flag([], "--announce-maddrs", env="ANNOUNCE_MADDRS", help=ANNOUNCE_HELP,
                                      metavar="MULTIADDR")
    identity: Path | None = flag(
        None, "--identity", env="IDENTITY",
        help="Persistent identity file (created 0400 if absent); default: a new one per session.")
    manifest_signer: list[str] = flag([], "--manifest-signer", env="MANIFEST_SIGNER", metavar="PEER_ID",
                                      help="Peer ids trusted to sign the manifest [default: the initial peers, and "
                                           "the signer they follow].")
    role: str | None = flag(None, "--role", env="ROLE", help="Force the role: replica or stage.")
    stage: int | None = flag(None, "--stage", env="STAGE", help="Force this pipeline stage (implies --role stage).")
    swarm: int | None = flag(None, "--swarm", env="SWARM",
                             help="Join this pipeline swarm (implies --role stage): its missing stage, or --stage.")
    memory_gb: float | None = flag(None, "--memory-gb", env="MEMORY_GB",
                                   help="Announce this memory instead of measuring.")
    throughput: float | None = flag(None, "--throughput", env="THROUGHPUT",
                                    help="Announce these full-model tokens/s instead of a warm-up.")
    bandwidth: float | None = flag(None, "--bandwidth", env="BANDWIDTH",
                                   help="Announce these bytes/s instead of a probe.")
    ttl: float = flag(60.0, "--ttl", env="TTL", help="Seconds our record lives without a heartbeat.")
    reachability: str = flag("auto", "--reachability", env="REACHABILITY",
                             help="auto (ask a peer to dial us back), public, or client (DHT client mode).")
    connect_timeout: float = flag(60.0, "--connect-timeout", env="CONNECT_TIMEOUT",
                                  help="Seconds to keep retrying the initial peers.")
    manifest_timeout: float = flag(30.0, "--manifest-timeout", env="MANIFEST_TIMEOUT",
                                   help="Seconds to wait for the run manifest.")
    cache_dir: Path | None = flag(None, "--cache-dir", env="CACHE",
                                  help="Cache for artifacts and data [~/.cache/hlbp].")
    probe_mb: float = flag(4.0, "--probe-mb", env="PROBE_MB", help="MiB downloaded to measure bandwidth.")
    train: bool = flag(True, "--train/--no-train", env="TRAIN",
                       help="Train after announcing; --no-train holds the role without training.")
    max_steps: int | None = flag(None, "--max-steps", env="MAX_STEPS",
                                 help="Leave after this many local training steps.")
    out_dir: Path = flag(Path("runs/join"), "--out-dir", env="OUT_DIR", help="Checkpoints and metrics of training.")
    nat_port_map: bool = flag(False, "--nat-port-map/--no-nat-port-map", env="NAT_PORT_MAP",
                              help="Ask the router for a port mapping (UPnP / NAT-PMP).")
    rounds: int | None = flag(None, "--rounds", env="ROUNDS", help="Leave after this many outer rounds (full replica).")
    local_only: bool = flag(False, "--local-only/--no-local-only", env="LOCAL_ONLY",
                            help="Full replica trains alone with the inner trainer, without outer rounds.")
    threads: int | None = flag(None, "--threads", env="THREADS", help="torch CPU threads.")
    state_dtype: str = flag("bf16", "--state-dtype", env="STATE_DTYPE",
                            help="How this peer keeps its own optimizer state, never sent: bf16 keeps SparseLoCo's error "
                                 "feedback in bf16 (2 bytes per parameter less than fp32, loss unchanged); bf16-v also "
                                 "AdamW's second moment, bf16-all both moments (2 and 4 bytes more, at a measured "
                                 "loss cost).")
    state_on_disk: bool = flag(True, "--state-on-disk/--state-in-memory", env="STATE_ON_DISK",
                               help="Keep the round state that is read a few times a round, not at every step (the "
                                    "agreed parameters, 4 bytes per parameter, and SparseLoCo's error feedback, 2-4), "
                                    "in files under --out-dir, one parameter in memory at a time; the files are "
                                    "removed when the peer exits.")
    recompute: bool = flag(False, "--recompute/--no-recompute", env="RECOMPUTE",
                           help="Hold only each transformer block's input from the forward to the backward and run "
                                "the block again there: less memory for activations (most at long sequences and "
                                "large batches), for 14-19 % more time a step; the same gradients.")
    checkpoint_every: float = flag(300.0, "--checkpoint-every", env="CHECKPOINT_EVERY",
                                   help="Full replica: save the checkpoint at most every this many seconds (0: every "
                                        "round); it is always saved on SIGTERM and at the end.")
    metrics_port: int | None = flag(
        None, "--metrics-port", env="METRICS_PORT",
        help="Full replica: serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port) [default: off].")
    metrics_host: str = flag("127.0.0.1", "--metrics-host", env="METRICS_HOST",
                             help="Address the metrics endpoint listens on (0.0.0.0 for a scraper elsewhere).")
    wait_replicas: int = flag(0, "--wait-replicas", env="WAIT_REPLICAS",
                              help="Full replica, fresh run: before round 0, wait until this many replicas (this one "
                                   "included) are announced, so a swarm started together trains round 0 together.")
    wait_replicas_timeout: float = flag(120.0, "--wait-replicas-timeout", env="WAIT_REPLICAS_TIMEOUT",
                                        help="Start round 0 anyway after waiting this many seconds.")
    micro_batches: int = flag(8, "--micro-batches", env="MICRO_BATCHES",
                              help="Stage 0 (the swarm's driver): micro-batches each inner step's batch is split into.")
    micro_batch_schedule: str = flag(
        "uniform", "--micro-batch-schedule", env="MICRO_BATCH_SCHEDULE",
        help="Stage 0: uniform, or tapered (the first and last micro-batch of a step a quarter of the others: a "
             "shorter fill and drain of the pipeline).")
    in_flight: int | None = flag(None, "--in-flight", env="IN_FLIGHT",
                                 help="Stage 0: most micro-batches in the pipeline at once [default: all of a step's]; "
                                      "keep it >= stages + 1 to hide link latency.")
    stage_deadline: float | None = flag(None, "--stage-deadline", env="STAGE_DEADLINE",
                                        help="Stage 0: seconds a micro-batch may take before the chain is checked "
                                             "[default: 3x the recent p95 round trip, within 5..120 s].")
    switch_factor: float = flag(2.0, "--switch-factor", env="SWITCH_FACTOR",
                                help="Stage 0: at a phase's first step, hand a stage to a peer at least this many "
                                     "times faster than the one serving it (measured, else announced; 0: never).")
    stage_peers: int = flag(4, "--stage-peers", env="STAGE_PEERS",
                            help="Stage 0: at most this many peers serve each stage in a step, splitting its "
                                 "micro-batches and trading gradients at its end, where the step gains more than "
                                 "their trade costs (1: one peer, the others stand by).")
    rebalance_period: float | None = flag(
        None, "--rebalance-period", env="REBALANCE_PERIOD",
        help="Stage peer: move to a stage another swarm lacks only when idle and when the same move was seen twice "
             "this many seconds apart [default: the record lifetime --ttl, at least 30 s; 0: never move].")
    eval_every: int = flag(10, "--eval-every", env="EVAL_EVERY",
                           help="Stage 0: validation loss through the pipeline every this many steps (0: never).")

    def __post_init__(self) -> None:
        if self.state_dtype not in ("fp32", "bf16", "bf16-v", "bf16-all"):
            raise UserInputError(f"--state-dtype must be fp32, bf16, bf16-v or bf16-all, got {self.state_dtype!r}")
        if self.micro_batch_schedule not in SCHEDULES:
            raise UserInputError(f"--micro-batch-schedule must be {' or '.join(SCHEDULES)}, "
                                 f"got {self.micro_batch_schedule!r}")
        if self.probe_mb <= 0 or self.max_steps is not None and self.max_steps < 0:
            raise UserInputError("--probe-mb must be > 0 and --max-steps >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise UserInputError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.micro_batches < 1 or self.in_flight is not None and self.in_flight < 1 or self.eval_every < 0 \
                or self.stage_deadline is not None and self.stage_deadline <= 0 \
                or self.rebalance_period is not None and self.rebalance_period < 0 \
                or not (self.switch_factor == 0 or 1 < self.switch_factor < float("inf")) \
                or not 1 <= self.stage_peers <= MAX_STAGE_PEERS:
            raise UserInputError("--micro-batches and --in-flight must be >= 1, --eval-every and "
                                 "--rebalance-period >= 0, --stage-deadline > 0, --switch-factor 0 or > 1 and "
                                 f"--stage-peers 1..{MAX_STAGE_PEERS}")
        if (self.rounds is not None and self.rounds < 0 or self.checkpoint_every < 0 or self.wait_replicas < 0
                or self.wait_replicas_timeout < 0):
            raise UserInputError("--rounds, --checkpoint-every, --wait-replicas and --wait-replicas-timeout "
                                 "must be >= 0")

    def plan(self) -> JoinPlan:
        """The peer's config objects: what to join with, and how to train as a stage peer or a full replica."""
        from hlbp.peer.net.control import NetworkConfig
        from hlbp.peer.node.join import JoinConfig
        from hlbp.peer.node.replica import ReplicaOptions
        from hlbp.peer.node.roles import StateLayout
        from hlbp.peer.node.session import JoinPlan
        from hlbp.peer.node.stage import StageOptions
        from hlbp.peer.swarm.step import Schedule

        net = NetworkConfig(initial_peers=split_values(self.initial_peers), host_maddrs=split_values(self.host_maddrs),
                            announce_maddrs=split_values(self.announce_maddrs), connect_timeout_s=self.connect_timeout,
                            nat_port_map=self.nat_port_map)
        join = JoinConfig(
            net=net, identity=self.identity, manifest_signers=split_values(self.manifest_signer), role=self.role,
            stage=self.stage, swarm=self.swarm, memory_gb=self.memory_gb, throughput=self.throughput,
            bandwidth=self.bandwidth, ttl=self.ttl, reachability=self.reachability,
            manifest_timeout_s=self.manifest_timeout, cache_dir=self.cache_dir,
            probe_bytes=int(self.probe_mb * (1 << 20)), train=self.train, max_steps=self.max_steps,
            out_dir=self.out_dir, layout=StateLayout(self.state_dtype, self.state_on_disk, self.recompute),
        )
        stage = StageOptions(micro_batches=self.micro_batches, schedule=Schedule(self.micro_batch_schedule),
                             in_flight=self.in_flight, deadline_s=self.stage_deadline,
                             switch_factor=self.switch_factor, stage_peers=self.stage_peers,
                             eval_every=self.eval_every, threads=self.threads, checkpoint_every_s=self.checkpoint_every,
                             rebalance_period_s=self.rebalance_period, state_dtype=self.state_dtype,
                             state_on_disk=self.state_on_disk, recompute=self.recompute)
        replica = ReplicaOptions(rounds=self.rounds, threads=self.threads, checkpoint_every_s=self.checkpoint_every,
                                 metrics_port=self.metrics_port, metrics_host=self.metrics_host,
                                 wait_replicas=self.wait_replicas, wait_replicas_timeout_s=self.wait_replicas_timeout,
                                 state_dtype=self.state_dtype, state_on_disk=self.state_on_disk,
                                 recompute=self.recompute)
        return JoinPlan(join=join, replica=replica, stage=stage, local_only=self.local_only)


def join_plan(args: list[str]) -> JoinPlan:
    """The JoinPlan that ``hlbp join ARGS`` (with the ``HLBP_*`` variables) would run, for an entry point that runs
    the join itself (:func:`hlbp.peer.node.session.run_join`), as fault tests do with their hook."""
    return parse_flags(JoinFlags, args, "hlbp join").plan()
