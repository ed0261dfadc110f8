"""What ``hlbp bench heterogeneous --network`` reports: per run its losses, tokens and bytes, the table, the
verdict on the paper's claim, the token-weighting comparison and the plot (:mod:`hlbp.peer.bench.hetnet` runs).

Everything here is a function of the runs' round records, the drivers' summaries and the checkpoints the peers
left behind, so the arithmetic is tested without processes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.console import Console

from hlbp.peer.bench.report import print_table
from hlbp.peer.sim.report import checksums_agree, is_stage

CLAIM_FACTOR = 0.5  # the paper's claim: heterogeneous gap <= half of the all-compressed gap
SAME_LOSS = 1e-4  # final losses closer than this are equal (a lossless codec differs by float rounding only)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def per_round(records: dict[str, list[dict[str, Any]]], drivers: Sequence[str], rounds: int,
              tokens_per_step: int) -> list[dict[str, Any]]:
    """Per round: the full replicas' (plain) and the drivers' (through the chain) validation loss, the tokens
    every replica trained (a full replica's steps, a swarm driver's), those of accepted contributions, the
    SparseLoCo bytes per peer by role, and whether the checksums agree per shard."""
    out = []
    for r in range(rounds):
        at = {n: x for n, recs in records.items() for x in recs if x.get("round") == r}
        replicas = {n: x for n, x in at.items() if not is_stage(n) or n in drivers}
        full = [x["val_loss"] for n, x in at.items() if not is_stage(n) and x.get("val_loss") is not None]
        chain = [at[n]["val_loss"] for n in drivers if n in at and at[n].get("val_loss") is not None]
        roles: dict[str, dict[str, float | None]] = {}
        for role, members in (("full", [x for n, x in at.items() if not is_stage(n)]),
                              ("stage", [x for n, x in at.items() if is_stage(n)])):
            if members:
                roles[role] = {"sent": _mean([x["bytes_sent"] for x in members]),
                               "received": _mean([x["bytes_received"] for x in members])}
        out.append({
            "round": r,
            "members": max((x.get("members", 0) for x in at.values()), default=0),
            "full_val_loss": _mean(full),
            "swarm_val_loss": _mean(chain),
            "steps": {n: x.get("steps", 0) for n, x in sorted(replicas.items())},
            "tokens": sum(x.get("steps", 0) for x in replicas.values()) * tokens_per_step,
            "accepted_tokens": sum(x.get("steps", 0) for x in replicas.values() if x.get("accepted"))
            * tokens_per_step,
            "bytes_per_peer": roles,
            "checksums_equal": checksums_agree(at.values()) if at else False,
        })
    return out


def stage_link_bytes(summaries: dict[str, dict[str, Any] | None], stages: int, swarm_share: float) -> dict[str, Any]:
    """Bytes per training token on the stage links, from the drivers' stage-stream counters: ``forward`` (whole
    ``fwd`` messages sent) and ``backward`` (``bwd`` messages received) on boundary 0, averaged over the drivers,
    and ``arm_per_token``: both ways over every boundary, per token of the whole arm (``swarm_share``: the
    swarms' part of the arm's replicas). All zero for an arm without swarms."""
    per = [(s["stream_bytes"]["sent"].get("fwd", 0) / s["tokens"], s["stream_bytes"]["received"].get("bwd", 0)
            / s["tokens"]) for s in summaries.values() if s and s.get("tokens")]
    if not summaries:
        return {"forward": 0.0, "backward": 0.0, "arm_per_token": 0.0, "drivers": 0}
    if not per:
        return {"forward": None, "backward": None, "arm_per_token": None, "drivers": 0}
    fwd, bwd = _mean([p[0] for p in per]), _mean([p[1] for p in per])
    assert fwd is not None and bwd is not None
    return {"forward": fwd, "backward": bwd, "arm_per_token": (fwd + bwd) * (stages - 1) * swarm_share,
            "drivers": len(per)}


def agreed_checksums(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Per shard, the checksum most in-sync records of one round carry."""
    votes: dict[str, Counter[str]] = {}
    for r in records:
        if r.get("in_sync", True):
            for shard, digest in r.get("checksums", {}).items():
                votes.setdefault(str(shard), Counter())[digest] += 1
    return {s: c.most_common(1)[0][0] for s, c in votes.items()}


def final_global_loss(cfg: Any, raw: dict[str, Any], data: Any) -> dict[str, Any]:
    """The plain validation loss of the global parameters after the last round, from the checkpoints the peers
    left (a full replica's, else swarm 0's stage peers' round checkpoints), and whether every shard of them
    matches the last round's agreed checksum."""
    import torch

    from hlbp.peer.data.streams import val_batches
    from hlbp.peer.model.codec import CodecConfig
    from hlbp.peer.model.decoder import build_model, preset, split
    from hlbp.peer.model.pipeline import initial_state, run_model_config
    from hlbp.peer.rounds.statesync import shard_checksum
    from hlbp.peer.sim.launcher import SimConfig
    from hlbp.peer.sim.report import stage_name
    from hlbp.peer.train.checkpoint import load_checkpoint
    from hlbp.peer.train.trainer import evaluate

    run, dirs = raw["run"], raw["dirs"]
    if run.full:
        files = [("peer0", "checkpoint.safetensors")]
    else:
        files = [(stage_name(0, s), "rounds.safetensors") for s in range(cfg.stages)]
    anchor: dict[str, torch.Tensor] = {}
    for name, file in files:
        path = dirs.get(name) / file if dirs.get(name) is not None else None
        if path is None or not path.exists():
            return {"val_loss": None, "verified": False, "why": f"{name} left no {file}"}
        tensors, _ = load_checkpoint(path)
        anchor.update({k[len("anchor."):]: v for k, v in tensors.items() if k.startswith("anchor.")})
    codec = CodecConfig(cfg.variant, str(cfg.k()), seed=cfg.seed) if run.swarms else CodecConfig("dense",
                                                                                                  seed=cfg.seed)
    bounds = SimConfig(model=cfg.model, n_stages=cfg.stages, seq_len=cfg.seq_len).stage_bounds()  # the manifest's
    config = run_model_config(preset(cfg.model, vocab_size=data.vocab_size), codec, cfg.stages, bounds)
    with torch.device("meta"):
        shards = [[n for n, _ in s.named_parameters()] for s in split(config, cfg.stages, bounds)]
    last = [x for recs in raw["records"].values() for x in recs if x.get("round") == cfg.rounds - 1]
    agreed = agreed_checksums(last)
    missing = [n for names in shards for n in names if n not in anchor]
    if missing:
        return {"val_loss": None, "verified": False, "why": f"the checkpoints lack {missing[:3]}"}
    verified = all(shard_checksum(anchor, names) == agreed.get(str(s)) for s, names in enumerate(shards))
    model = build_model(config)
    model.load_state_dict(initial_state(config, cfg.seed))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(anchor[n])
    val = val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    return {"val_loss": evaluate(model, val, torch.device("cpu")), "verified": verified,
            "why": "" if verified else "the checkpoints' parameters differ from the last round's agreed checksums"}


def analyse(cfg: Any, raw: dict[str, Any], data: Any) -> dict[str, Any]:
    """Everything the report shows of one run (:func:`hlbp.peer.bench.hetnet.run_once`'s raw material)."""
    run = raw["run"]
    rounds = per_round(raw["records"], raw["drivers"], cfg.rounds, cfg.batch_size * cfg.seq_len)
    final = final_global_loss(cfg, raw, data)
    last = rounds[-1]
    sent = [x["bytes_sent"] for recs in raw["records"].values() for x in recs]
    recv = [x["bytes_received"] for recs in raw["records"].values() for x in recs]
    by_role = {role: {k: _mean([r["bytes_per_peer"][role][k] for r in rounds if role in r["bytes_per_peer"]])
                      for k in ("sent", "received")}
               for role in ("full", "stage") if any(role in r["bytes_per_peer"] for r in rounds)}
    h = cfg.inner_steps
    cut = sum(1 for r in rounds for n, s in r["steps"].items() if is_stage(n) and s < h)
    return {
        "label": run.label, "arm": run.arm, "full_replicas": run.full, "swarms": run.swarms,
        "weighting": run.weighting, "lockstep": run.lockstep, "contributors": raw["contributors"],
        "final_val_loss": final["val_loss"], "final_state_verified": final["verified"], "final_note": final["why"],
        "final_full_val_loss": last["full_val_loss"], "final_swarm_val_loss": last["swarm_val_loss"],
        "val_loss_curve": {"full": [r["full_val_loss"] for r in rounds],
                           "swarm_chain": [r["swarm_val_loss"] for r in rounds]},
        "tokens": sum(r["tokens"] for r in rounds), "accepted_tokens": sum(r["accepted_tokens"] for r in rounds),
        "nominal_tokens": cfg.replicas * cfg.rounds * h * cfg.batch_size * cfg.seq_len,
        "swarm_phases_cut_short": cut,
        "stage_link_bytes_per_token": stage_link_bytes(raw["summaries"], cfg.stages, run.swarms / cfg.replicas),
        "bytes_per_round_per_peer": {"sent": _mean(sent), "received": _mean(recv), "by_role": by_role},
        "checksums_equal": all(r["checksums_equal"] for r in rounds),
        "seconds": raw["seconds"], "seconds_total": raw["seconds_total"], "rounds": rounds,
    }


def round_noise(curve: Sequence[float | None]) -> float | None:
    """How much one round's loss moves around its trend: the standard deviation of the round-to-round changes
    over the last third of ``curve`` (at least 3 changes), divided by sqrt(2) (each change holds two rounds'
    noise). A rough scale for how far apart two final losses must be to mean something."""
    tail = [v for v in curve[-max(4, len(curve) // 3):] if v is not None]
    diffs = [b - a for a, b in pairwise(tail)]
    if len(diffs) < 3:
        return None
    mean = sum(diffs) / len(diffs)
    return (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5 / 2 ** 0.5


def verdict(results: Sequence[dict[str, Any]], variant: str, ratio: str) -> dict[str, Any]:
    """The paper's claim on the lockstep arms: heterogeneous gap over uncompressed <= half the all-compressed
    gap, with the numbers, the round-to-round noise of the uncompressed loss, and a one-line statement."""
    arms = {r["arm"]: r for r in results if r["lockstep"]}
    loss = {a: arms[a]["final_val_loss"] if a in arms else None for a in ("uncompressed", "heterogeneous",
                                                                         "compressed")}
    if None in loss.values():
        return {"holds": None, "line": "no verdict: an arm has no final validation loss", **loss}
    het, comp = loss["heterogeneous"] - loss["uncompressed"], loss["compressed"] - loss["uncompressed"]
    noise = round_noise(arms["uncompressed"].get("val_loss_curve", {}).get("full", []))
    out = {**loss, "heterogeneous_gap": het, "compressed_gap": comp, "ratio": het / comp if comp else None,
           "noise": noise}
    where = f"{variant} at k/d = {ratio}"
    if comp <= 0:
        out.update(holds=None, line=f"no verdict ({where}): compressing every replica cost nothing "
                                    f"(gap {comp:+.4f}), so there is no gap to halve")
    elif het <= CLAIM_FACTOR * comp:
        out.update(holds=True, line=f"claim HOLDS ({where}): heterogeneous gap {het:+.4f} <= half of the "
                                    f"all-compressed gap {comp:+.4f} ({CLAIM_FACTOR * comp:+.4f}); ratio "
                                    f"{het / comp:.2f}")
    else:
        out.update(holds=False, line=f"claim MISSED ({where}): heterogeneous gap {het:+.4f} > half of the "
                                     f"all-compressed gap {comp:+.4f} ({CLAIM_FACTOR * comp:+.4f}) by "
                                     f"{het - CLAIM_FACTOR * comp:.4f}; ratio {het / comp:.2f}")
    if abs(het - comp) < SAME_LOSS:
        out["line"] += (" - heterogeneous and all compressed end equal: the codec is lossless here, so what both "
                        "lose is the subspace constraint every replica of the run trains under")
    if noise is not None:
        out["line"] += f" (round-to-round noise of the uncompressed loss: +-{noise:.4f})"
    out["replicates"] = replicates(results, arms["heterogeneous"], loss["uncompressed"], comp)
    return out


def replicates(results: Sequence[dict[str, Any]], het: dict[str, Any], base: float, comp_gap: float
               ) -> dict[str, Any] | None:
    """The heterogeneous arm's spread over its repeats: the free-running runs in which no swarm was cut short and
    the tokens equal the lockstep run's compute the same rounds (every contribution in, equal tokens, so either
    weighting is the equal one), and differ from it only by the float rounding of the network code, which the
    training then amplifies. Their mean and standard deviation, and the claim judged on the mean."""
    same = [r for r in results if r["arm"] == "heterogeneous" and r["final_val_loss"] is not None
            and r["tokens"] == het["tokens"] and (r["lockstep"] or r["swarm_phases_cut_short"] == 0)]
    if len(same) < 2:
        return None
    losses = [r["final_val_loss"] for r in same]
    mean = sum(losses) / len(losses)
    std = (sum((x - mean) ** 2 for x in losses) / (len(losses) - 1)) ** 0.5
    gap = mean - base
    holds = comp_gap > 0 and gap <= CLAIM_FACTOR * comp_gap
    line = (f"heterogeneous over {len(same)} runs of the same rounds: {mean:.4f} +- {std:.4f} (sd), gap {gap:+.4f} "
            f"vs half the all-compressed gap {CLAIM_FACTOR * comp_gap:+.4f}: "
            + ("holds" if holds else f"missed by {gap - CLAIM_FACTOR * comp_gap:.4f}"))
    return {"runs": len(same), "losses": losses, "mean": mean, "sd": std, "gap": gap, "holds": holds,
            "line": line}


def weighting_comparison(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The free-running heterogeneous runs side by side: final loss per weighting, and how unequal the tokens
    behind the contributions were (without unequal tokens the weighting cannot matter)."""
    free = {r["weighting"]: r for r in results if not r["lockstep"]}
    if not free:
        return None
    out: dict[str, Any] = {}
    for w, r in free.items():
        full = [s for rd in r["rounds"] for n, s in rd["steps"].items() if not is_stage(n)]
        swarm = [s for rd in r["rounds"] for n, s in rd["steps"].items() if is_stage(n)]
        out[w] = {"final_val_loss": r["final_val_loss"], "tokens": r["tokens"],
                  "accepted_tokens": r["accepted_tokens"], "mean_steps_full": _mean(full),
                  "mean_steps_swarm": _mean(swarm), "swarm_phases_cut_short": r["swarm_phases_cut_short"]}
    if "equal" in out and "tokens" in out and None not in (out["equal"]["final_val_loss"],
                                                           out["tokens"]["final_val_loss"]):
        diff = out["tokens"]["final_val_loss"] - out["equal"]["final_val_loss"]
        out["tokens_minus_equal"] = diff
        cut = out["equal"]["swarm_phases_cut_short"] + out["tokens"]["swarm_phases_cut_short"]
        out["line"] = (f"weighting: tokens {out['tokens']['final_val_loss']:.4f} vs equal "
                       f"{out['equal']['final_val_loss']:.4f} ({diff:+.4f}); swarm phases cut short: {cut}"
                       + ("" if cut else " (every contribution carried the same tokens, so the weights were equal)"))
    return out


def print_report(cfg: Any, results: Sequence[dict[str, Any]], console: Console) -> dict[str, Any]:
    """The table, the verdict and the weighting line; returns the JSON result."""
    base = next((r["final_val_loss"] for r in results if r["arm"] == "uncompressed" and r["lockstep"]), None)
    rows = []
    for r in results:
        link = r["stage_link_bytes_per_token"]
        roles = r["bytes_per_round_per_peer"]["by_role"]
        gap = r["final_val_loss"] - base if base is not None and r["final_val_loss"] is not None else None
        rows.append([
            r["label"], f"{r['full_replicas']}/{r['swarms']}", f"{r['tokens']:,}",
            r["final_val_loss"] if r["final_val_loss"] is not None else "-",
            f"{gap:+.4f}" if gap is not None else "-",
            r["final_swarm_val_loss"] if r["final_swarm_val_loss"] is not None else "-",
            "-" if link["forward"] is None else f"{link['forward']:.1f} / {link['backward']:.1f}",
            "-" if link["arm_per_token"] is None else f"{link['arm_per_token']:.1f}",
            " / ".join(f"{roles[k]['sent'] / 1e3:.1f}" if k in roles else "-" for k in ("full", "stage")),
            "yes" if r["checksums_equal"] and r["final_state_verified"] else "NO",
            f"{r['seconds']:.0f} / {r['seconds_total']:.0f}",
        ])
    title = (f"heterogeneous over the network: {cfg.model}, R={cfg.replicas}, {cfg.stages}-stage swarms "
             f"({cfg.variant}, k/d={cfg.ratio}, k={cfg.k()}), {cfg.rounds} rounds x H={cfg.inner_steps} x "
             f"{cfg.batch_size}x{cfg.seq_len} tokens, {cfg.micro_batches} micro-batches per step"
             + (f"; swarm links {cfg.swarm_wan_delay_ms or 0:g} ms one way"
                + (f", {cfg.swarm_wan_mbps:g} Mbit/s" if cfg.swarm_wan_mbps else "")
                if cfg.swarm_wan_delay_ms is not None or cfg.swarm_wan_mbps is not None else ""))
    print_table(Console(file=console.file, width=max(console.width, 170)), title,
                ["run", "full/swarms", "tokens", "final val loss", "gap", "swarm val (chain)",
                 "stage B/tok fwd / bwd", "stage B/arm tok", "kB sent/round full / stage", "agree", "wall s rounds / all"],
                rows)
    console.print("final val loss: the agreed global parameters after the last round, scored here as the plain "
                  "model (the same for every arm); swarm val (chain): the drivers' score of the same parameters "
                  "through the compressed chain. stage B/tok: boundary 0, per swarm token; stage B/arm tok: both "
                  "ways over every boundary per token of the whole arm. wall s: from the bootstrap's start to the "
                  "last round's records / with start-up and shutdown of every process.")
    v = verdict(results, cfg.variant, cfg.ratio)
    console.print(v["line"])
    if v.get("replicates"):
        console.print(v["replicates"]["line"])
    weighting = weighting_comparison(results)
    if weighting and "line" in weighting:
        console.print(weighting["line"])
    return {"runs": list(results), "verdict": v, "weighting": weighting}


def write_plot(path: Path, cfg: Any, results: Sequence[dict[str, Any]]) -> bool:
    """Validation loss per round (plain: solid, through the chain: dashed, final plain score: star) and the
    stage-link bytes per token; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"uncompressed": "tab:blue", "heterogeneous": "tab:green", "compressed": "tab:red"}
    for r in results:
        color = colors[r["arm"]] if r["lockstep"] else ("tab:olive" if r["weighting"] == "equal" else "tab:purple")
        xs = list(range(len(r["rounds"])))
        full, chain = r["val_loss_curve"]["full"], r["val_loss_curve"]["swarm_chain"]
        if any(v is not None for v in full):
            a.plot(xs, [v if v is not None else float("nan") for v in full], "-o", color=color, ms=3,
                   label=f"{r['label']}: full replicas")
        if any(v is not None for v in chain):
            a.plot(xs, [v if v is not None else float("nan") for v in chain], "--", color=color,
                   label=f"{r['label']}: swarms (chain)")
        if r["final_val_loss"] is not None:
            a.plot([xs[-1]], [r["final_val_loss"]], "*", color=color, ms=12)
    a.xaxis.get_major_locator().set_params(integer=True)
    a.set_xlabel("round")
    a.set_ylabel("validation loss")
    a.set_title("validation loss (star: final global model, plain)")
    a.legend(fontsize=7)
    arms = [r for r in results if r["lockstep"]]
    x = range(len(arms))
    fwd = [r["stage_link_bytes_per_token"]["forward"] or 0 for r in arms]
    bwd = [r["stage_link_bytes_per_token"]["backward"] or 0 for r in arms]
    b.bar([i - 0.2 for i in x], fwd, 0.4, label="forward")
    b.bar([i + 0.2 for i in x], bwd, 0.4, label="backward")
    base = next((r["final_val_loss"] for r in arms if r["arm"] == "uncompressed"), None)
    b.set_xticks(list(x), [r["arm"] + (f"\ngap {r['final_val_loss'] - base:+.4f}" if base is not None
                                       and r["final_val_loss"] is not None else "") for r in arms])
    b.set_ylabel("bytes / swarm token, boundary 0")
    b.set_title("stage-link bytes")
    b.legend()
    fig.suptitle(f"{cfg.variant} k/d={cfg.ratio}, R={cfg.replicas}, {cfg.stages} stages, {cfg.rounds} rounds x "
                 f"H={cfg.inner_steps}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
