"""``hlbp bootstrap``, ``hlbp join``, ``hlbp status`` and ``hlbp fetch``: the control-plane commands.

A thin shell: flags (each also an HLBP_* variable) become config dataclasses, hlbp.bootstrap and hlbp.peer do the
work. ``register(app)`` adds the four commands to the main typer app. Heavy imports (hivemind, torch) happen
inside the commands, so ``hlbp --help`` stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from hlbp.cli.light_cmds import fetch
from hlbp.cli.options import bind, make_console, opt, run_app
from hlbp.cli.status_view import status_table
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.signals import stop_on_signals

err_console = make_console()

_INITIAL_PEERS_HELP = "Multiaddrs of running peers, with /p2p/<peer id> (the line `hlbp bootstrap` printed)."
_ANNOUNCE_HELP = "Public multiaddrs others should dial (e.g. /ip4/<public IP>/tcp/PORT), when NAT hides ours."


def _split(values: list[str] | None) -> list[str]:
    """Flags may repeat, and each value (or HLBP_* variable) may hold several addresses split by commas or spaces."""
    return [part for value in values or [] for part in value.replace(",", " ").split()]


def _setup_logging() -> None:
    """Warnings and errors from everything; ``HLBP_LOG_LEVEL`` (DEBUG, INFO, ...) makes hlbp's own loggers say more
    (the round loop's decisions: sitting a round out, catching up, resyncing)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = os.environ.get("HLBP_LOG_LEVEL", "").upper()
    if name:
        level = logging.getLevelName(name)
        if not isinstance(level, int):
            raise UserInputError(f"HLBP_LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {name!r}")
        logging.getLogger("hlbp").setLevel(level)


def _echo(line: str) -> None:
    # Plain prints (not rich) so that addresses and the join command paste cleanly, even when piped.
    print(line, flush=True)


def bootstrap(
    host_maddrs: list[str] = opt(["/ip4/0.0.0.0/tcp/31337"], "--host-maddrs", env="HOST_MADDRS",
                                 help="Multiaddrs to listen on.", metavar="MULTIADDR"),
    announce_maddrs: list[str] = opt([], "--announce-maddrs", env="ANNOUNCE_MADDRS", help=_ANNOUNCE_HELP,
                                     metavar="MULTIADDR"),
    initial_peers: list[str] = opt([], "--initial-peers", env="INITIAL_PEERS",
                                   help="Other bootstraps of the same DHT, for redundancy (optional).",
                                   metavar="MULTIADDR"),
    identity: Path = opt(None, "--identity", env="IDENTITY",
                         help="Persistent Ed25519 identity file, created (mode 0400) if absent "
                              "[default: ~/.config/hlbp/bootstrap.key]."),
    run_config: Path = opt(None, "--run-config", env="RUN_CONFIG",
                           help="TOML run config (model, stages, hyperparameters); defaults without it."),
    tokenizer: Path = opt(None, "--tokenizer", env="TOKENIZER",
                          help="Publish this tokenizer.json instead of preparing one from the data recipe."),
    cache_dir: Path = opt(None, "--cache-dir", env="CACHE", help="Cache for corpus and tokenizer [~/.cache/hlbp]."),
    ttl: float = opt(60.0, "--ttl", env="TTL", help="Seconds the manifest and records live without a refresh."),
    nat_port_map: bool = opt(False, "--nat-port-map/--no-nat-port-map", env="NAT_PORT_MAP",
                             help="Ask the router for a port mapping (UPnP / NAT-PMP)."),
    outer: str = opt(None, "--outer", env="OUTER",
                     help="Outer step of the run, overriding the run config: sparseloco (default), or diloco "
                          "(dense rounds through hivemind's stock all-reduce: the baseline)."),
) -> None:
    """Run a long-lived DHT entry point that publishes the signed run manifest and serves the tokenizer.

    Prints its multiaddrs and a ready-to-paste `hlbp join` command.
    Stops cleanly on SIGTERM or Ctrl-C.
    """
    from hlbp.bootstrap.node import BootstrapConfig, default_identity_path, run_bootstrap
    from hlbp.peer.net.control import NetworkConfig

    _setup_logging()
    cfg = BootstrapConfig(
        net=NetworkConfig(initial_peers=_split(initial_peers), host_maddrs=_split(host_maddrs),
                          announce_maddrs=_split(announce_maddrs), nat_port_map=nat_port_map),
        identity=identity or default_identity_path(), run_config=run_config, tokenizer=tokenizer,
        cache_dir=cache_dir, ttl=ttl, outer=outer,
    )
    stop = threading.Event()
    stop_on_signals(stop)
    run_bootstrap(cfg, _echo, stop)


def join(
    initial_peers: list[str] = opt([], "--initial-peers", env="INITIAL_PEERS", help=_INITIAL_PEERS_HELP,
                                   metavar="MULTIADDR"),
    host_maddrs: list[str] = opt(["/ip4/0.0.0.0/tcp/0"], "--host-maddrs", env="HOST_MADDRS",
                                 help="Multiaddrs to listen on; a fixed port helps others dial you.",
                                 metavar="MULTIADDR"),
    announce_maddrs: list[str] = opt([], "--announce-maddrs", env="ANNOUNCE_MADDRS", help=_ANNOUNCE_HELP,
                                     metavar="MULTIADDR"),
    identity: Path = opt(None, "--identity", env="IDENTITY",
                         help="Persistent identity file (created 0400 if absent); default: a new one per session."),
    manifest_signer: list[str] = opt([], "--manifest-signer", env="MANIFEST_SIGNER", metavar="PEER_ID",
                                     help="Peer ids trusted to sign the manifest [default: the initial peers, and "
                                          "the signer they follow]."),
    role: str = opt(None, "--role", env="ROLE", help="Force the role: replica or stage."),
    stage: int = opt(None, "--stage", env="STAGE", help="Force this pipeline stage (implies --role stage)."),
    swarm: int = opt(None, "--swarm", env="SWARM",
                     help="Join this pipeline swarm (implies --role stage): its missing stage, or --stage."),
    memory_gb: float = opt(None, "--memory-gb", env="MEMORY_GB", help="Announce this memory instead of measuring."),
    throughput: float = opt(None, "--throughput", env="THROUGHPUT",
                            help="Announce these full-model tokens/s instead of a warm-up."),
    bandwidth: float = opt(None, "--bandwidth", env="BANDWIDTH", help="Announce these bytes/s instead of a probe."),
    ttl: float = opt(60.0, "--ttl", env="TTL", help="Seconds our record lives without a heartbeat."),
    reachability: str = opt("auto", "--reachability", env="REACHABILITY",
                            help="auto (ask a peer to dial us back), public, or client (DHT client mode)."),
    connect_timeout: float = opt(60.0, "--connect-timeout", env="CONNECT_TIMEOUT",
                                 help="Seconds to keep retrying the initial peers."),
    manifest_timeout: float = opt(30.0, "--manifest-timeout", env="MANIFEST_TIMEOUT",
                                  help="Seconds to wait for the run manifest."),
    cache_dir: Path = opt(None, "--cache-dir", env="CACHE", help="Cache for artifacts and data [~/.cache/hlbp]."),
    probe_mb: float = opt(4.0, "--probe-mb", env="PROBE_MB", help="MiB downloaded to measure bandwidth."),
    train: bool = opt(True, "--train/--no-train", env="TRAIN",
                      help="Train after announcing; --no-train holds the role without training."),
    max_steps: int = opt(None, "--max-steps", env="MAX_STEPS", help="Leave after this many local training steps."),
    out_dir: Path = opt(Path("runs/join"), "--out-dir", env="OUT_DIR", help="Checkpoints and metrics of training."),
    nat_port_map: bool = opt(False, "--nat-port-map/--no-nat-port-map", env="NAT_PORT_MAP",
                             help="Ask the router for a port mapping (UPnP / NAT-PMP)."),
    rounds: int = opt(None, "--rounds", env="ROUNDS", help="Leave after this many outer rounds (full replica)."),
    local_only: bool = opt(False, "--local-only/--no-local-only", env="LOCAL_ONLY",
                           help="Full replica trains alone with the inner trainer, without outer rounds."),
    threads: int = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
    checkpoint_every: float = opt(300.0, "--checkpoint-every", env="CHECKPOINT_EVERY",
                                  help="Full replica: save the checkpoint at most every this many seconds (0: every "
                                       "round); it is always saved on SIGTERM and at the end."),
    metrics_port: int = opt(None, "--metrics-port", env="METRICS_PORT",
                            help="Full replica: serve Prometheus metrics at http://HOST:PORT/metrics (0: any free "
                                 "port) [default: off]."),
    metrics_host: str = opt("127.0.0.1", "--metrics-host", env="METRICS_HOST",
                            help="Address the metrics endpoint listens on (0.0.0.0 for a scraper elsewhere)."),
    wait_replicas: int = opt(0, "--wait-replicas", env="WAIT_REPLICAS",
                             help="Full replica, fresh run: before round 0, wait until this many replicas (this one "
                                  "included) are announced, so a swarm started together trains round 0 together."),
    wait_replicas_timeout: float = opt(120.0, "--wait-replicas-timeout", env="WAIT_REPLICAS_TIMEOUT",
                                       help="Start round 0 anyway after waiting this many seconds."),
    micro_batches: int = opt(8, "--micro-batches", env="MICRO_BATCHES",
                             help="Stage 0 (the swarm's driver): micro-batches each inner step's batch is split into."),
    in_flight: int = opt(None, "--in-flight", env="IN_FLIGHT",
                         help="Stage 0: most micro-batches in the pipeline at once [default: all of a step's]; "
                              "keep it >= stages + 1 to hide link latency."),
    stage_deadline: float = opt(None, "--stage-deadline", env="STAGE_DEADLINE",
                                help="Stage 0: seconds a micro-batch may take before the chain is checked "
                                     "[default: 3x the recent p95 round trip, within 5..120 s]."),
    rebalance_period: float = opt(None, "--rebalance-period", env="REBALANCE_PERIOD",
                                  help="Stage peer: move to a stage another swarm lacks only when idle and when the "
                                       "same move was seen twice this many seconds apart [default: the record "
                                       "lifetime --ttl, at least 30 s; 0: never move]."),
    eval_every: int = opt(10, "--eval-every", env="EVAL_EVERY",
                          help="Stage 0: validation loss through the pipeline every this many steps (0: never)."),
    faults: Any = None,
) -> None:
    """Join a run: read its manifest, measure this machine, take a role, announce it, and train until stopped.

    A full replica trains H inner steps per round and merges with the others in SparseLoCo rounds. A stage peer
    serves its stage of a pipeline swarm: stage 0 drives the swarm (data, micro-batches, retries), later stages
    serve forward and backward over compressed stage streams, and each stage peer contributes its stage's shard to
    the same rounds. An idle stage peer moves to a stage that another swarm lacks (confirmed twice). SIGTERM or Ctrl-C marks the peer offline and leaves within seconds.
    """
    from hlbp.peer.net.control import NetworkConfig
    from hlbp.peer.node.join import JoinConfig, TrainContext, default_train_hook
    from hlbp.peer.node.join import join as do_join

    _setup_logging()
    if probe_mb <= 0 or max_steps is not None and max_steps < 0:
        raise UserInputError("--probe-mb must be > 0 and --max-steps >= 0")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise UserInputError(f"--metrics-port must be 0..65535, got {metrics_port}")
    cfg = JoinConfig(
        net=NetworkConfig(initial_peers=_split(initial_peers), host_maddrs=_split(host_maddrs),
                          announce_maddrs=_split(announce_maddrs), connect_timeout_s=connect_timeout,
                          nat_port_map=nat_port_map),
        identity=identity, manifest_signers=_split(manifest_signer), role=role, stage=stage, swarm=swarm, memory_gb=memory_gb,
        throughput=throughput, bandwidth=bandwidth, ttl=ttl, reachability=reachability,
        manifest_timeout_s=manifest_timeout, cache_dir=cache_dir, probe_bytes=int(probe_mb * (1 << 20)),
        train=train, max_steps=max_steps, out_dir=out_dir,
    )
    stop, training = threading.Event(), threading.Event()
    stop_on_signals(stop, training)
    peer = do_join(cfg, _echo)
    try:
        out = Path(out_dir) / peer.manifest.manifest.run_id / peer.plane.peer_id[-12:]
        ctx = TrainContext(peer=peer, max_steps=max_steps, out_dir=out, cache_dir=cache_dir, stop=stop)
        if not train:
            _echo("holding the role without training (--no-train); Ctrl-C or SIGTERM to leave")
            stop.wait()
        elif peer.role.kind != "replica":
            from hlbp.peer.node.stage import StageOptions, stage_train_hook

            if micro_batches < 1 or in_flight is not None and in_flight < 1 or eval_every < 0 \
                    or stage_deadline is not None and stage_deadline <= 0 \
                    or rebalance_period is not None and rebalance_period < 0:
                raise UserInputError("--micro-batches and --in-flight must be >= 1, --eval-every and "
                                     "--rebalance-period >= 0 and --stage-deadline > 0")
            stage_train_hook(ctx, StageOptions(micro_batches=micro_batches, in_flight=in_flight,
                                               deadline_s=stage_deadline, eval_every=eval_every, threads=threads,
                                               checkpoint_every_s=checkpoint_every,
                                               rebalance_period_s=rebalance_period), _echo)
        elif not local_only and not stop.is_set():
            from hlbp.peer.node.replica import ReplicaOptions, replica_train_hook

            if (rounds is not None and rounds < 0 or checkpoint_every < 0 or wait_replicas < 0
                    or wait_replicas_timeout < 0):
                raise UserInputError("--rounds, --checkpoint-every, --wait-replicas and --wait-replicas-timeout "
                                     "must be >= 0")
            options = ReplicaOptions(rounds=rounds, threads=threads,
                                     checkpoint_every_s=checkpoint_every, metrics_port=metrics_port,
                                     metrics_host=metrics_host, wait_replicas=wait_replicas,
                                     wait_replicas_timeout_s=wait_replicas_timeout,
                                     **({"faults": faults} if faults is not None else {}))
            replica_train_hook(ctx, options, _echo)
        elif not stop.is_set():
            training.set()  # from here a signal also interrupts the training loop, which does not poll `stop`
            try:
                default_train_hook(ctx)
            except KeyboardInterrupt:
                _echo("stopping training")
            finally:
                training.clear()
    finally:
        _echo("leaving: marking this peer offline")
        peer.leave()


def status(
    initial_peers: list[str] = opt([], "--initial-peers", env="INITIAL_PEERS", help=_INITIAL_PEERS_HELP,
                                   metavar="MULTIADDR"),
    manifest_signer: list[str] = opt([], "--manifest-signer", env="MANIFEST_SIGNER", metavar="PEER_ID",
                                     help="Peer ids trusted to sign the manifest [default: the initial peers]."),
    show_offline: bool = opt(False, "--offline/--no-offline", env="STATUS_OFFLINE",
                             help="Also list peers that left but whose records have not expired."),
    as_json: bool = opt(False, "--json/--no-json", env="STATUS_JSON", help="Print JSON for scripts."),
    connect_timeout: float = opt(20.0, "--connect-timeout", env="CONNECT_TIMEOUT",
                                 help="Seconds to keep retrying the initial peers."),
    manifest_timeout: float = opt(10.0, "--manifest-timeout", env="MANIFEST_TIMEOUT",
                                  help="Seconds to wait for the run manifest."),
    light: bool = opt(False, "--light/--no-light", env="LIGHT",
                      help="Read one initial peer's snapshot over py-libp2p and verify every record here: no p2pd, "
                           "no hivemind in this process (pip install 'hlbp\\[libp2p]')."),
) -> None:
    """Show the run's peers from the DHT: role, swarm, stage, version, throughput, bandwidth, last seen.

    With --light, from one peer's snapshot of the signed records instead; records that do not verify are listed
    as rejected and never shown as peers.
    """
    _setup_logging()
    peers_list = _split(initial_peers)
    if not peers_list:
        raise UserInputError("pass --initial-peers (or HLBP_INITIAL_PEERS): the multiaddr of any peer of the run")
    if light:
        from hlbp.cli.light_cmds import print_light_report
        from hlbp.peer.node.status import light_report

        report = light_report(peers_list, _split(manifest_signer), show_offline, connect_timeout)
        if as_json:
            print(json.dumps(report, indent=1), flush=True)
        else:
            print_light_report(report)
        return
    import tempfile

    from hlbp.peer.light.trust import trusted_signers
    from hlbp.peer.net.control import ControlPlane, NetworkConfig
    from hlbp.peer.net.records import dht_time
    from hlbp.peer.node.status import read_round_checks, status_report

    # A client-mode node on loopback: status only dials out, so it opens no port to the outside.
    net = NetworkConfig(initial_peers=peers_list, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                        connect_timeout_s=connect_timeout)
    anchors, explicit = trusted_signers(peers_list, _split(manifest_signer))
    with tempfile.TemporaryDirectory(prefix="hlbp-status-") as tmp:
        plane = ControlPlane.connect(net, Path(tmp) / "identity.key")
        try:
            signed = plane.find_manifest(anchors, explicit, manifest_timeout)
            records = plane.read_peers(signed.manifest.run_id)
            checks = read_round_checks(plane.dht, signed.manifest.run_id)
            now = dht_time()
        finally:
            plane.shutdown()
    report = status_report(signed, records, now, show_offline, checks)
    if as_json:
        print(json.dumps(report, indent=1), flush=True)
        return
    # Piped output (grep, less, a log) is not wrapped by a terminal, so give the table room instead of eliding.
    Console(width=None if sys.stdout.isatty() else 160).print(status_table(report))


def register(app: typer.Typer, faults: Any = None) -> None:
    """Add ``bootstrap``, ``join`` and ``status`` to the ``hlbp`` app.

    ``faults`` (a :class:`hlbp.peer.rounds.faults.FaultHook`) is what a fault test passes in to make a joined
    replica misbehave; it is bound to ``join`` as an argument, not a flag, so no command line can set it.
    """
    app.command()(bootstrap)
    app.command()(bind(join, faults=faults))
    app.command()(status)
    app.command()(fetch)


def main(faults: Any = None) -> None:
    """Stand-alone entry (``python -m hlbp.cli.control_cmds``), with the same error handling as ``hlbp``; tests
    start misbehaving replicas through it with a fault hook."""
    app = typer.Typer(name="hlbp", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    register(app, faults)
    run_app(app, err_console)


if __name__ == "__main__":
    main()
