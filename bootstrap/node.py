"""``hlbp bootstrap``: a long-lived DHT entry point that publishes the signed run manifest and serves artifacts.

It holds no model. It keeps a persistent Ed25519 identity (so its multiaddr, and the peer id joiners trust as the
manifest signer, survive restarts), re-publishes the manifest before it expires, announces itself like any peer,
and serves the tokenizer by content hash over the data plane.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hlbp.bootstrap.config import build_manifest, load_run_config
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.net.control import ControlPlane, NetworkConfig, check_ports_free, software_version
from hlbp.peer.net.heartbeat import Heartbeat
from hlbp.peer.net.validation import dht_time, load_or_create_identity
from hlbp.protocol.announcement import Announcement
from hlbp.protocol.manifest import (
    Hyperparameters,
    Manifest,
    SignedManifest,
    decode_manifest,
    describe_stages,
    encode_manifest,
)

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31337


def default_identity_path() -> Path:
    """``$XDG_CONFIG_HOME/hlbp/bootstrap.key``: an identity is configuration, not cache, and must survive cleanup."""
    import os

    base = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")).expanduser()
    return base / "hlbp" / "bootstrap.key"


@dataclass
class BootstrapConfig:
    """Everything ``hlbp bootstrap`` needs; each field is one CLI flag and one HLBP_* variable."""

    net: NetworkConfig = field(
        default_factory=lambda: NetworkConfig(host_maddrs=[f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"]))
    identity: Path = field(default_factory=default_identity_path)  # persistent key file, created 0400 if absent
    run_config: Path | None = None  # TOML run config; None: defaults
    tokenizer: Path | None = None  # tokenizer.json to publish; None: prepare it from the data recipe
    cache_dir: Path | None = None  # hlbp.peer.data.streams's cache for corpus and tokenizer
    ttl: float = 60.0  # seconds the manifest and the bootstrap's record live without a refresh
    outer: str | None = None  # overrides the run config's hparams.outer (sparseloco or diloco)


def resolve_tokenizer(path: Path | None, recipe: str, cache_dir: Path | None, vocab_size: int) -> tuple[Path, bytes]:
    """The run's tokenizer.json and its bytes: the given file, or the one hlbp.peer.data.streams trains for the recipe."""
    if path is None:
        from hlbp.peer.data.streams import prepare_data

        path = prepare_data(recipe, cache_dir, vocab_size=vocab_size).tokenizer_path
    path = Path(path).expanduser()
    try:
        return path, path.read_bytes()
    except OSError as exc:
        raise UserInputError(f"cannot read tokenizer {path}: {exc.strerror}") from None


@dataclass
class BootstrapNode:
    """A running bootstrap: its control plane, heartbeat and the manifest it signs."""

    plane: ControlPlane
    heartbeat: Heartbeat
    manifest: SignedManifest

    def maddrs(self) -> list[str]:
        return self.plane.maddrs()

    def stop(self) -> None:
        """Mark the bootstrap offline and shut the DHT down. The manifest stays in the DHT until it expires,
        and joined peers keep re-publishing it, so the run goes on without the bootstrap."""
        self.heartbeat.leave()
        self.plane.shutdown()


def start_bootstrap(cfg: BootstrapConfig) -> BootstrapNode:
    """Build and sign the manifest, start the DHT node, serve the tokenizer, announce; returns once ready."""
    if cfg.ttl < 1:
        raise UserInputError(f"--ttl must be at least 1 second, got {cfg.ttl}")
    # a taken listen port is found before the tokenizer is built, which takes a fresh cache tens of seconds
    check_ports_free(list(cfg.net.host_maddrs))
    run = load_run_config(cfg.run_config)
    if cfg.outer is not None:
        if cfg.outer not in Hyperparameters.OUTERS:
            raise UserInputError(f"--outer must be one of {', '.join(Hyperparameters.OUTERS)}, got {cfg.outer!r}")
        run.hparams = {**run.hparams, "outer": cfg.outer}
    tokenizer_path, tokenizer = resolve_tokenizer(cfg.tokenizer, run.data_recipe, cfg.cache_dir, run.vocab_size)
    manifest: Manifest = build_manifest(run, tokenizer, issued_at=dht_time())
    identity = load_or_create_identity(cfg.identity)
    signed = decode_manifest(encode_manifest(manifest, identity), signer=identity.peer_id)
    plane = ControlPlane.connect(cfg.net, cfg.identity, run_ids=(manifest.run_id,), identity=identity)
    try:
        plane.serve_artifacts({manifest.tokenizer_hash: tokenizer_path})
        plane.serve_snapshot(manifest.run_id)
        record = Announcement(
            run_id=manifest.run_id, role="bootstrap", software=software_version(), reachability="public",
            maddrs=tuple(plane.maddrs()[:8]), artifacts=(manifest.tokenizer_hash,),
            manifest_signer=signed.signer, manifest_digest=signed.digest,
        )
        heartbeat = Heartbeat(plane, record, cfg.ttl, manifest=signed, manifest_owner=True)
        heartbeat.start()
    except BaseException:
        plane.shutdown()
        raise
    return BootstrapNode(plane, heartbeat, signed)


def join_command(maddrs: list[str]) -> str:
    """The command a volunteer pastes; prefers an address other machines can reach over loopback."""
    routable = [a for a in maddrs if "/ip4/127." not in a and "/ip6/::1/" not in a]
    return f"hlbp join --initial-peers {(routable or maddrs)[0]}"


def run_bootstrap(cfg: BootstrapConfig, echo: Callable[[str], None], stop: threading.Event) -> None:
    """Start, print how to join, and serve until ``stop`` is set (the CLI sets it on SIGTERM or SIGINT)."""
    node = start_bootstrap(cfg)
    try:
        m = node.manifest.manifest
        maddrs = node.maddrs()
        echo(f"hlbp bootstrap: run {m.run_id} | model {m.model} | {len(m.stages)} stages "
             f"(layers {describe_stages(m.stages)}) | "
             f"tokenizer {m.tokenizer_hash[:12]} | protocol v{m.protocol_version}")
        echo(f"peer id (manifest signer): {node.plane.peer_id}")
        echo("listening on:")
        for addr in maddrs:
            echo(f"  {addr}")
        echo("join with:")
        echo(f"  {join_command(maddrs)}")
        echo(f"manifest {node.manifest.digest[:12]} ({len(node.manifest.envelope)} bytes), "
             f"bootstrap record {node.heartbeat.last_size} bytes; refreshed every {cfg.ttl / 3:.0f} s")
        stop.wait()
    finally:
        echo("bootstrap: leaving")
        node.stop()
