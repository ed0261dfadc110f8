"""``hlbp status --light`` and ``hlbp fetch``: watch a run and fetch its artifacts.

With ``--light`` both run on py-libp2p (:mod:`hlbp.peer.light`) in a process that never imports hivemind and
starts no p2pd: they dial one initial peer, read its snapshot of the run's signed records and verify every record
here. Without it, ``hlbp fetch`` joins the DHT like ``hlbp status``. A thin shell: the work is in hlbp.peer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from hlbp.cli.options import INITIAL_PEERS_HELP, opt, split_values
from hlbp.cli.status_view import status_table
from hlbp.peer.common.errors import UserInputError


def print_light_report(report: dict[str, Any]) -> None:
    """The table of ``hlbp status``, then the accepted sets, the rejected records and where the data came from."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(status_table(report))
    for s in report["accepted"]:
        console.print(f"round {s['round']} accepted set by {s['coordinator'][-8:]}: {len(s['members'])} "
                      f"contributions" + (f", {len(s['banned'])} banned" if s["banned"] else ""))
    for r in report["rejected"]:
        console.print(f"[red]rejected[/] {r['kind']} of {escape(r['author'][-8:])}: {escape(r['reason'])}",
                      soft_wrap=True)
    console.print(f"{len(report['peers'])} peers from {escape(report['source'])}'s snapshot "
                  f"({report['snapshot_bytes']:,} bytes, {report['seconds']:.2f} s); every record verified here, "
                  f"{len(report['rejected'])} rejected", soft_wrap=True)


def fetch(
    artifact: str = typer.Argument(..., metavar="ARTIFACT-HASH",
                                   help="sha256 of the artifact, or its first 8+ hex digits (as `hlbp bootstrap` "
                                        "prints the tokenizer's)."),
    initial_peers: list[str] = opt([], "--initial-peers", env="INITIAL_PEERS", help=INITIAL_PEERS_HELP,
                                   metavar="MULTIADDR"),
    manifest_signer: list[str] = opt([], "--manifest-signer", env="MANIFEST_SIGNER", metavar="PEER_ID",
                                     help="Peer ids trusted to sign the manifest \\[default: the initial peers]."),
    light: bool = opt(False, "--light/--no-light", env="LIGHT",
                      help="Use py-libp2p: no p2pd, no hivemind in this process (pip install 'hlbp\\[libp2p]')."),
    out: Path = opt(None, "--out", env="FETCH_OUT", help="Where to save it \\[default: ./<artifact name>]."),
    connect_timeout: float = opt(20.0, "--connect-timeout", env="CONNECT_TIMEOUT",
                                 help="Seconds to reach the initial peers."),
    manifest_timeout: float = opt(10.0, "--manifest-timeout", env="MANIFEST_TIMEOUT",
                                  help="Seconds to wait for the run manifest (without --light)."),
    timeout: float = opt(300.0, "--timeout", env="FETCH_TIMEOUT", help="Seconds the download may take."),
) -> None:
    """Download a run artifact (the tokenizer) that the run's signed manifest lists, and check its sha256."""
    peers_list = split_values(initial_peers)
    if not peers_list:
        raise UserInputError("pass --initial-peers (or HLBP_INITIAL_PEERS): the multiaddr of any peer of the run")
    if min(connect_timeout, manifest_timeout, timeout) <= 0:
        raise UserInputError("--connect-timeout, --manifest-timeout and --timeout must be > 0")
    started = time.perf_counter()
    if light:
        from hlbp.peer.light.watch import download, read_run, resolve_artifact

        run = read_run(peers_list, split_values(manifest_signer), connect_timeout)
        art = resolve_artifact(run.view.manifest.manifest, artifact)
        dest = Path(out) if out is not None else Path.cwd() / art.name
        fetched, source = download(run, art, dest, timeout)
        peer, seconds = source.split("/p2p/")[-1], fetched.seconds
    else:
        peer, seconds, art, dest = _fetch_with_p2pd(peers_list, split_values(manifest_signer), artifact, out,
                                                    connect_timeout, manifest_timeout)
    rate = art.size / max(seconds, 1e-9) / 1e6
    print(json.dumps({"name": art.name, "sha256": art.sha256, "size": art.size, "path": str(dest), "from": peer,
                      "seconds": round(seconds, 4), "total_seconds": round(time.perf_counter() - started, 3),
                      "MB_per_s": round(rate, 1), "light": light}), flush=True)


def _fetch_with_p2pd(peers_list: list[str], signers: list[str], wanted: str, out: Path | None,
                     connect_timeout: float, manifest_timeout: float) -> tuple[str | None, float, Any, Path]:
    """``hlbp fetch`` without --light: a client-mode DHT node, the verified manifest, then any announcing peer."""
    import tempfile

    from hlbp.peer.light.trust import trusted_signers
    from hlbp.peer.light.watch import resolve_artifact
    from hlbp.peer.net.control import ControlPlane, NetworkConfig

    anchors, explicit = trusted_signers(peers_list, signers)
    net = NetworkConfig(initial_peers=peers_list, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                        connect_timeout_s=connect_timeout)
    with tempfile.TemporaryDirectory(prefix="hlbp-fetch-") as tmp:
        plane = ControlPlane.connect(net, Path(tmp) / "identity.key")
        try:
            signed = plane.find_manifest(anchors, explicit, manifest_timeout)
            art = resolve_artifact(signed.manifest, wanted)
            dest = Path(out) if out is not None else Path.cwd() / art.name
            peers = plane.read_peers(signed.manifest.run_id)
            serving = sorted(p for p, r in peers.items()
                             if r.announcement.online and art.sha256 in r.announcement.artifacts)
            sources = list(dict.fromkeys([*sorted(anchors), signed.signer, *serving]))
            started = time.perf_counter()
            plane.fetch_artifact(art, sources, dest)
            return None, time.perf_counter() - started, art, dest  # the control plane tries sources in turn
        finally:
            plane.shutdown()
