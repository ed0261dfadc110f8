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

import typer
from rich.console import Console

from hlbp.cli.join_flags import JoinFlags
from hlbp.cli.light_cmds import fetch
from hlbp.cli.options import (
    ANNOUNCE_HELP,
    INITIAL_PEERS_HELP,
    flags_command,
    make_console,
    opt,
    run_app,
    split_values,
)
from hlbp.cli.status_view import status_table
from hlbp.peer.common import allocator
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.signals import stop_on_signals

err_console = make_console()


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
    announce_maddrs: list[str] = opt([], "--announce-maddrs", env="ANNOUNCE_MADDRS", help=ANNOUNCE_HELP,
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
        net=NetworkConfig(initial_peers=split_values(initial_peers), host_maddrs=split_values(host_maddrs),
                          announce_maddrs=split_values(announce_maddrs), nat_port_map=nat_port_map),
        identity=identity or default_identity_path(), run_config=run_config, tokenizer=tokenizer,
        cache_dir=cache_dir, ttl=ttl, outer=outer,
    )
    stop = threading.Event()
    stop_on_signals(stop)
    run_bootstrap(cfg, _echo, stop)


@flags_command(JoinFlags)
def join(flags: JoinFlags) -> None:
    """Join a run: read its manifest, measure this machine, take a role, announce it, and train until stopped.

    A full replica trains H inner steps per round and merges with the others in SparseLoCo rounds. A stage peer
    serves its stage of a pipeline swarm: stage 0 drives the swarm (data, micro-batches, retries), later stages
    serve forward and backward over compressed stage streams, and each stage peer contributes its stage's shard to
    the same rounds. An idle stage peer moves to a stage that another swarm lacks (confirmed twice). SIGTERM or Ctrl-C marks the peer offline and leaves within seconds.
    """
    from hlbp.peer.node.session import run_join

    _setup_logging()
    run_join(flags.plan(), _echo)


def status(
    initial_peers: list[str] = opt([], "--initial-peers", env="INITIAL_PEERS", help=INITIAL_PEERS_HELP,
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
    peers_list = split_values(initial_peers)
    if not peers_list:
        raise UserInputError("pass --initial-peers (or HLBP_INITIAL_PEERS): the multiaddr of any peer of the run")
    if light:
        from hlbp.cli.light_cmds import print_light_report
        from hlbp.peer.node.status import light_report

        report = light_report(peers_list, split_values(manifest_signer), show_offline, connect_timeout)
        if as_json:
            print(json.dumps(report, indent=1), flush=True)
        else:
            print_light_report(report)
        return
    import tempfile

    from hlbp.peer.light.trust import trusted_signers
    from hlbp.peer.net.control import ControlPlane, NetworkConfig
    from hlbp.peer.net.validation import dht_time
    from hlbp.peer.node.status import read_round_checks, status_report

    # A client-mode node on loopback: status only dials out, so it opens no port to the outside.
    net = NetworkConfig(initial_peers=peers_list, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                        connect_timeout_s=connect_timeout)
    anchors, explicit = trusted_signers(peers_list, split_values(manifest_signer))
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


def register(app: typer.Typer) -> None:
    """Add ``bootstrap``, ``join``, ``status`` and ``fetch`` to the ``hlbp`` app."""
    app.command()(bootstrap)
    app.command()(join)
    app.command()(status)
    app.command()(fetch)


def main() -> None:
    """Stand-alone entry (``python -m hlbp.cli.control_cmds``), with the same error handling as ``hlbp``: what the
    loopback simulation runs for ``bootstrap`` and ``join`` (it imports less than ``hlbp.cli.main``)."""
    allocator.run_with_jemalloc()
    app = typer.Typer(name="hlbp", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    register(app)
    run_app(app, err_console)


if __name__ == "__main__":
    main()
