"""The report of a simulated run, from the peers' round records: per round who took part, validation loss,
whether the checksums agree, bytes per peer and the time split; and the dense baseline's bytes beside them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def of_its_round(rec: dict[str, Any]) -> bool:
    """Whether a round record's checksums and validation loss describe its own round: not when the peer resynced
    in that round, which loads the swarm's latest state (``state_round``, a later round)."""
    return rec.get("state_round") in (None, rec.get("round"))


def checksums_agree(records: Iterable[dict[str, Any]]) -> bool:
    """True when, shard by shard, every in-sync record of one round that holds the shard carries the same checksum
    (a full replica holds every shard, a stage peer its own), and there is at least one such record. A record of a
    resync, which describes a later round's state, is not compared."""
    per_shard: dict[str, set[str]] = {}
    for r in records:
        if r.get("in_sync", True) and of_its_round(r):
            for shard, digest in r.get("checksums", {}).items():
                per_shard.setdefault(str(shard), set()).add(digest)
    return bool(per_shard) and all(len(v) == 1 for v in per_shard.values())


def states_agree(records: Iterable[dict[str, Any]]) -> bool:
    """True when the in-sync records of one round describe the same parameters: equal checksums, or (a dense
    run, whose all-reduce leaves ulp-level differences) fingerprints that agree within float rounding."""
    from hlbp.peer.rounds.rules import fingerprints_agree

    recs = [r for r in records if r.get("in_sync", True) and of_its_round(r)]
    if checksums_agree(recs):
        return True
    prints = [r.get("fingerprints") or {} for r in recs]
    if not recs or not all(prints) or any(p.keys() != prints[0].keys() for p in prints):
        return False
    return all(fingerprints_agree(tuple(p[k]), tuple(prints[0][k])) for p in prints for k in p)


def by_role(records: dict[str, Sequence[dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per role (full replicas, stage peers) over every round record of the run: the seconds of compute,
    communication and waiting, ``utilization`` (compute over compute and communication, as per round) and
    ``busy`` (compute over all three: the share of the round loop's wall time spent training; waiting counts the
    inner steps' waits for the overlapped exchange's turn, ``turn_wait_s``, too). The two differ
    where a role waits: a full replica whose phase ends before the overlapped exchange waits in ``wait_s``, which
    utilization leaves out, while a stage peer's exchange runs between its phases and counts as communication."""
    out: dict[str, dict[str, float | None]] = {}
    for role, stage in (("full", False), ("stage", True)):
        recs = [rec for name, rs in records.items() if is_stage(name) == stage for rec in rs]
        if not recs:
            continue
        c, m, w, t = (sum(float(rec.get(k, 0.0)) for rec in recs)
                      for k in ("compute_s", "comm_s", "wait_s", "turn_wait_s"))
        w += t  # steps waiting for the exchange's turn: neither compute nor communication
        out[role] = {"compute_s": c, "comm_s": m, "wait_s": w,
                     "utilization": c / (c + m) if c + m > 0 else None,
                     "busy": c / (c + m + w) if c + m + w > 0 else None}
    return out


def summarize(records: dict[str, Sequence[dict[str, Any]]], n_params: int | None = None,
              target_rounds: int | None = None) -> dict[str, Any]:
    """The run's report from each peer's round records (``metrics.jsonl``, event ``round``).

    Per round: validation loss (mean over peers), whether the checksums of all in-sync peers are equal (both over
    the records that describe that round: a peer that resynced in it reports the later round it loaded, listed
    under ``resynced``), bytes sent and received per peer, and the time split into compute, communication and
    waiting. ``utilization`` is compute / (compute + communication): waiting for the deadline is the protocol's
    slack, not a transfer cost.
    With ``n_params`` the dense fp32 equivalent (every peer shipping all parameters as float32) is compared with
    the measured bytes.
    """
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for peer, recs in records.items():
        for rec in recs:
            by_round.setdefault(int(rec["round"]), {})[peer] = rec
    rounds = []
    for r in sorted(by_round):
        peers = by_round[r]
        scored = {n: p for n, p in peers.items() if p.get("val_loss") is not None and of_its_round(p)}
        vals = [p["val_loss"] for p in scored.values()]
        full_vals = [p["val_loss"] for n, p in scored.items() if not is_stage(n)]
        swarm_vals = {n: p["val_loss"] for n, p in sorted(scored.items()) if is_stage(n)}
        roles = {}
        for role, members in (("full", [p for n, p in peers.items() if not is_stage(n)]),
                              ("stage", [p for n, p in peers.items() if is_stage(n)])):
            c, m = sum(p["compute_s"] for p in members), sum(p["comm_s"] for p in members)
            if members:
                roles[role] = c / (c + m) if c + m > 0 else None
        compute = sum(p["compute_s"] for p in peers.values())
        comm = sum(p["comm_s"] for p in peers.values())
        wait = sum(p["wait_s"] for p in peers.values())
        turn_wait = sum(p.get("turn_wait_s", 0.0) for p in peers.values())
        n = len(peers)
        rounds.append({
            "round": r,
            "peers": n,
            "members": max(p.get("members", 0) for p in peers.values()),
            "accepted": sorted(name for name, p in peers.items() if p.get("accepted")),
            "paired": sum(1 for p in peers.values() if p.get("paired")),  # NoLoCo: replicas whose partner answered
            "val_loss": sum(vals) / len(vals) if vals else None,
            "full_val_loss": sum(full_vals) / len(full_vals) if full_vals else None,
            "swarm_val_loss": swarm_vals,  # per swarm driver (it scores the swarm's whole model through its chain)
            "utilization_by_role": roles,
            "shards": {n: sorted(p.get("checksums", {})) for n, p in sorted(peers.items())},
            "checksums_equal": checksums_agree(peers.values()),
            "states_agree": states_agree(peers.values()),
            "in_sync": all(p.get("in_sync", True) for p in peers.values()),
            # peers that resynced in this round, and the later round whose state each loaded
            "resynced": {n: p["state_round"] for n, p in sorted(peers.items()) if not of_its_round(p)},
            "bytes_sent": {name: p["bytes_sent"] for name, p in sorted(peers.items())},
            "bytes_received": {name: p["bytes_received"] for name, p in sorted(peers.items())},
            "records_received": {name: p.get("records_received", 0) for name, p in sorted(peers.items())},
            # each peer's process memory so far (hlbp.peer.common.memory) and the parameters it trains
            "memory": {name: {k: p.get(k, 0) for k in ("peak_host_bytes", "base_host_bytes", "peak_device_bytes",
                                                       "trained_params")} for name, p in sorted(peers.items())},
            "compute_s": compute / n,
            "comm_s": comm / n,
            "wait_s": wait / n,
            "turn_wait_s": turn_wait / n,  # inner steps waiting for the overlapped exchange's forward passes
            "utilization": compute / (compute + comm) if compute + comm > 0 else None,
            # eager overlap: inner steps of the next phase each peer trained before this round's result landed
            "landed_after": {name: p["landed_after"] for name, p in sorted(peers.items())
                             if p.get("landed_after") is not None},
            # and the steps before each partial result of the round (the contributions fetched so far) landed
            "previews": {name: p["previews"] for name, p in sorted(peers.items()) if p.get("previews")},
        })
    complete = [r for r in rounds if target_rounds is None or r["peers"] == len(records)]
    out: dict[str, Any] = {
        "peers": sorted(records),
        "rounds_completed": len(complete),
        "rounds": rounds,
        "val_loss": [r["val_loss"] for r in rounds],
        "checksums_equal": [r["checksums_equal"] for r in rounds],
        "states_agree": [r["states_agree"] for r in rounds],
    }
    total_compute = sum(r["compute_s"] for r in rounds)
    total_comm = sum(r["comm_s"] for r in rounds)
    out["time_s"] = {"compute": total_compute, "comm": total_comm, "wait": sum(r["wait_s"] for r in rounds),
                     "turn_wait": sum(r["turn_wait_s"] for r in rounds)}
    out["utilization"] = total_compute / (total_compute + total_comm) if total_compute + total_comm > 0 else None
    out["by_role"] = by_role(records)
    # seconds per protocol step (encode, close, apply, publish, verify; rounds/exchange.py), per peer and round
    peer_rounds = [rec for recs in records.values() for rec in recs]
    phases: dict[str, float] = {}
    for rec in peer_rounds:
        for name, secs in (rec.get("phases") or {}).items():
            phases[name] = phases.get(name, 0.0) + float(secs)
    out["phases_s"] = {name: total / len(peer_rounds) for name, total in phases.items()}
    landed = [rec["landed_after"] for rec in peer_rounds if rec.get("landed_after") is not None]
    # and before it, the first partial result (ours and the contributions fetched so far; rounds/overlap_loop.py)
    firsts = [rec["previews"][0] for rec in peer_rounds if rec.get("previews")]
    out["landing"] = {"mid_phase": len(landed) / len(peer_rounds) if peer_rounds else 0.0,
                      "mean_steps": sum(landed) / len(landed) if landed else None,
                      "partial": len(firsts) / len(peer_rounds) if peer_rounds else 0.0,
                      "first_partial_steps": sum(firsts) / len(firsts) if firsts else None}
    sent = [b for r in rounds for b in r["bytes_sent"].values()]
    recv = [b for r in rounds for b in r["bytes_received"].values()]
    out["bytes_per_peer_round"] = {"sent": sum(sent) / len(sent) if sent else 0.0,
                                   "received": sum(recv) / len(recv) if recv else 0.0}
    rec_in = [rec.get("records_received", 0) for rec in peer_rounds]
    rec_out = [rec.get("records_sent", 0) for rec in peer_rounds]
    out["records_per_peer_round"] = {"sent": sum(rec_out) / len(rec_out) if rec_out else 0.0,
                                     "received": sum(rec_in) / len(rec_in) if rec_in else 0.0}
    if n_params is not None:
        dense = 4 * n_params  # one fp32 pseudo-gradient over all shards, sent by every peer every round
        measured = out["bytes_per_peer_round"]["sent"]
        out["n_params"] = n_params
        out["dense_fp32_bytes_per_peer_round"] = dense
        out["compression_ratio"] = dense / measured if measured else None
        # what the dense baseline really moves: hivemind's butterfly all-reduce, each way, per member; it takes
        # every replica, whatever a gather cap lets a sparse round accept
        members = max([*(r["members"] for r in rounds), sum(1 for name in records if not is_stage(name))])
        allreduce = round(2 * (members - 1) / members * dense) if members > 1 else 0
        traffic = max(out["bytes_per_peer_round"]["sent"], out["bytes_per_peer_round"]["received"])
        out["dense_allreduce_bytes_per_peer_round"] = allreduce
        out["dense_allreduce_members"] = members
        out["allreduce_ratio"] = allreduce / traffic if traffic and allreduce else None
    return out


def audit_summary(audits: Sequence[dict[str, Any]], stage_busy_s: float) -> dict[str, Any]:
    """What the pipeline audits of a run found and cost (``audits``: the coordinators' ``audit`` events,
    hlbp.peer.node.audits; ``stage_busy_s``: the stage peers' compute seconds over the run). ``compute_share`` is the
    recomputation's seconds over the stage peers' compute; ``wall_share`` adds fetching the frames (on the
    coordinator, inside its round close); ``flagged``: the audited peers' micro-batch attempts a receiver's screen
    marked."""
    findings: dict[str, int] = {}
    for a in audits:
        for sample in a.get("samples", []):
            findings[sample["finding"]] = findings.get(sample["finding"], 0) + 1
    wall = sum(float(a.get("seconds", 0.0)) for a in audits)
    compute = sum(float(a.get("compute_s", 0.0)) for a in audits)
    return {"audits": len(audits), "guilty": sum(1 for a in audits if a.get("guilty")), "findings": findings,
            "flagged": sum(int(a.get("flagged", 0)) for a in audits),
            "seconds": wall, "compute_s": compute, "stage_busy_s": stage_busy_s,
            "compute_share": compute / stage_busy_s if stage_busy_s > 0 else None,
            "wall_share": wall / stage_busy_s if stage_busy_s > 0 else None}


def count_params(checkpoint: Path, prefix: str = "anchor.") -> int:
    """Parameters in a replica checkpoint (its ``anchor.*`` tensors: the model as the rounds agree on it; a NoLoCo
    replica's ``phi.*``)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if key.startswith(prefix):
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= int(d)
                total += n
    return total


def is_stage(name: str) -> bool:
    """Whether a simulation peer name is a stage peer's (:func:`stage_name`)."""
    return re.fullmatch(r"sw\d+s\d+", name) is not None


def stage_name(swarm: int, stage: int) -> str:
    """The simulation's name of stage peer ``stage`` of swarm ``swarm`` (full replicas are ``peer<i>``)."""
    return f"sw{swarm}s{stage}"
