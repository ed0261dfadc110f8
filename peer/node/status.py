"""What ``hlbp status`` shows: the run's peers and round standing, from the DHT or from one peer's verified snapshot.

Builds plain dicts (the ``--json`` shape); the command line only prints them.
"""

from __future__ import annotations

import time
from typing import Any


def read_round_checks(dht: Any, run_id: str) -> list[Any]:
    """Every replica's last published round state (signed ``checks`` records); unverifiable ones are skipped."""
    from hlbp.protocol import ProtocolError
    from hlbp.protocol.roundwire import checks_key, parse_checks

    found = dht.get(checks_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for subkey, item in found.value.items():
        try:
            out.append(parse_checks(getattr(item, "value", item), str(subkey), run_id))
        except ProtocolError:
            continue  # a forged or stale-format record says nothing about the run
    return out


def status_report(signed: Any, records: dict[str, Any], now: float, show_offline: bool,
                  checks: list[Any] = ()) -> dict[str, Any]:
    """The JSON shape of ``hlbp status --json``: the run, its newest round, then one entry per peer sorted by role,
    swarm, stage (replicas with the last round they finished and whether their state is the agreed one)."""
    from hlbp.peer.rounds.rules import round_standing

    m = signed.manifest
    standing = round_standing(checks)
    peers = []
    for peer_id, rec in records.items():
        a = rec.announcement
        if not a.online and not show_offline:
            continue
        peers.append({
            "peer_id": peer_id, "role": a.role, "swarm": a.swarm, "stage": a.stage, "online": a.online,
            "throughput": a.throughput, "bandwidth": a.bandwidth, "memory_gb": a.memory_gb, "software": a.software,
            "protocol": a.protocol_version, "reachability": a.reachability, "seq": a.seq,
            "last_seen_s": round(max(0.0, now - a.issued_at), 1), "expires_in_s": round(a.expires_at - now, 1),
            "record_bytes": rec.size, "maddrs": list(a.maddrs),
            "manifest_current": a.manifest_signer == signed.signer and a.manifest_digest == signed.digest,
            "round": standing.get(peer_id, {}).get("round"), "agrees": standing.get(peer_id, {}).get("agrees"),
        })
    order = {"bootstrap": 0, "replica": 1, "stage": 2}
    peers.sort(key=lambda p: (order.get(p["role"], 9), p["swarm"] or 0, p["stage"] or 0, p["peer_id"]))
    return {
        "run_id": m.run_id, "model": m.model, "stages": [list(s) for s in m.stages], "signer": signed.signer,
        "manifest_digest": signed.digest, "protocol": m.protocol_version, "outer": m.hparams.outer,
        "round": max((c.round for c in checks), default=None),
        "replicas_agreeing": sum(1 for v in standing.values() if v["agrees"]), "peers": peers,
    }


def light_report(initial_peers: list[str], manifest_signers: list[str], show_offline: bool,
                 timeout_s: float) -> dict[str, Any]:
    """The ``hlbp status --json`` report, from one peer's verified snapshot instead of the DHT, plus what only a
    snapshot shows: where it came from, the newest round's accepted sets, the run's artifacts, and every record
    that was rejected."""
    from hlbp.peer.light.watch import read_run

    started = time.perf_counter()
    run = read_run(initial_peers, manifest_signers, timeout_s)
    view = run.view
    now = time.time()
    report = status_report(view.manifest, view.peers, now, show_offline, view.checks)
    report.update({
        "light": True, "source": run.source, "served_at": run.snapshot.served_at,
        "snapshot_bytes": run.fetched.size, "seconds": round(time.perf_counter() - started, 3),
        "artifacts": [{"name": a.name, "sha256": a.sha256, "size": a.size} for a in view.manifest.manifest.artifacts],
        "accepted": [{"round": s.round, "coordinator": s.coordinator, "members": s.senders(),
                      "banned": [list(b) for b in s.banned]} for s in view.accepted],
        "rejected": [{"kind": r.kind, "author": r.author, "reason": r.reason} for r in view.rejected],
    })
    return report
