"""The verdicts of ``hlbp bench convergence``: each sweep's methods judged against their references at equal tokens
(the best of a family, the fresh or unoverlapped counterpart), as ratios a table line and the JSON both carry."""

from __future__ import annotations

from typing import Any, Protocol

from hlbp.peer.sim.stale import Staleness


class Method(Protocol):
    """What a verdict reads of a benchmark method (:class:`hlbp.peer.bench.convergence.Method`)."""

    @property
    def label(self) -> str: ...

    @property
    def family(self) -> str: ...

    @property
    def outer(self) -> Any: ...

    @property
    def noloco(self) -> Any: ...

    @property
    def overlap(self) -> str: ...

    @property
    def staleness(self) -> Staleness: ...


def best_of(results: dict[str, Any], meths: list[Method], family: str, key: str = "final_val_loss") -> str | None:
    labels = [m.label for m in meths if m.family == family and m.label in results]
    return min(labels, key=lambda lab: results[lab][key]) if labels else None


def verdict(results: dict[str, Any], meths: list[Method], k_max: int = 128) -> dict[str, Any]:
    """The issue's bars: best SparseLoCo at k <= ``k_max`` vs the best DiLoCo (<= 0.98x, > 100x fewer bytes) and
    vs the single AdamW run with R x the batch (within 3 %)."""
    sl = [m for m in meths if m.family == "sparseloco" and m.outer is not None and m.outer.k <= k_max]
    best_sl = min((m.label for m in sl if m.label in results), key=lambda lab: results[lab]["final_val_loss"],
                  default=None)
    best_dl, adamw = best_of(results, meths, "diloco"), best_of(results, meths, "adamw")
    if best_sl is None or best_dl is None:
        return {}
    s, d = results[best_sl], results[best_dl]
    out: dict[str, Any] = {
        "best_sparseloco": best_sl, "best_diloco": best_dl,
        "loss_ratio_vs_diloco": s["final_val_loss"] / d["final_val_loss"],
        "bytes_ratio_vs_diloco": d["bytes_per_round_per_replica"] / max(1.0, s["bytes_per_round_per_replica"]),
    }
    if adamw is not None:
        out["loss_ratio_vs_adamw"] = s["final_val_loss"] / results[adamw]["final_val_loss"]
    out["line"] = (
        f"best SparseLoCo ({best_sl}) / best DiLoCo ({best_dl}): {out['loss_ratio_vs_diloco']:.4f} "
        f"(bar <= 0.98) with {out['bytes_ratio_vs_diloco']:.0f}x fewer bytes (bar > 100x)"
        + (f"; / single AdamW with R x batch: {out['loss_ratio_vs_adamw']:.4f} (bar <= 1.03)" if adamw else ""))
    return out


def noloco_verdict(results: dict[str, Any], meths: list[Method]) -> dict[str, Any]:
    """NoLoCo against the round-based methods at equal tokens: dense NoLoCo over the best DiLoCo, sparse NoLoCo
    over the best SparseLoCo (final loss and bytes per replica and round), and each NoLoCo's final spread."""
    rows = {m.label: m for m in meths if m.family == "noloco" and m.label in results}
    best = {fam: best_of(results, meths, fam) for fam in ("diloco", "sparseloco")}
    out: dict[str, Any] = {}
    for label, m in rows.items():
        ref = best["sparseloco" if m.noloco is not None and m.noloco.sparse else "diloco"]
        if ref is None:
            continue
        r, b = results[label], results[ref]
        out[label] = {"against": ref, "loss_ratio": r["final_val_loss"] / b["final_val_loss"],
                      "bytes_ratio": r["bytes_per_round_per_replica"] / max(1.0, b["bytes_per_round_per_replica"]),
                      "spread": r["final_spread"]}
    if out:
        out["line"] = "; ".join(f"{lab} / {v['against']}: loss {v['loss_ratio']:.4f}, bytes {v['bytes_ratio']:.2f}x, "
                                f"spread {v['spread']:.2e}" for lab, v in out.items())
    return out


def stale_verdict(results: dict[str, Any], meths: list[Method]) -> dict[str, Any]:
    """Each stale-gradient method's final loss over its fresh counterpart's at equal tokens (the single AdamW run
    for the single runs, fresh SparseLoCo for SparseLoCo)."""
    fresh = {"adamw": next((m.label for m in meths if m.family == "adamw"), None),
             "sparseloco": next((m.label for m in meths if m.family == "sparseloco"
                                 and m.staleness is Staleness.FRESH), None)}
    out: dict[str, Any] = {}
    for m in meths:
        if m.staleness is Staleness.FRESH or m.label not in results:
            continue
        ref = fresh["adamw" if m.outer is None else "sparseloco"]
        if ref is not None and ref in results:
            out[m.label] = {"against": ref,
                            "loss_ratio": results[m.label]["final_val_loss"] / results[ref]["final_val_loss"]}
    if out:
        out["line"] = "; ".join(f"{lab} / {v['against']}: {v['loss_ratio']:.4f}" for lab, v in out.items())
    return out


def overlap_verdict(results: dict[str, Any], meths: list[Method]) -> dict[str, Any]:
    """Per outer method, the final loss of naive delay and of eager updates over no overlap at equal tokens (the
    issue's bar: eager within 1 %)."""
    out: dict[str, Any] = {}
    for family in ("diloco", "sparseloco"):
        by_mode = {m.overlap: results[m.label]["final_val_loss"] for m in meths
                   if m.family == family and m.label in results}
        if "none" in by_mode and len(by_mode) > 1:
            out[family] = {mode: v / by_mode["none"] for mode, v in by_mode.items() if mode != "none"}
    if out:
        out["line"] = "; ".join(
            f"{fam}: " + ", ".join(f"{mode} / none {r:.4f}" for mode, r in ratios.items())
            for fam, ratios in out.items()) + " (bar for eager: <= 1.01)"
    return out
