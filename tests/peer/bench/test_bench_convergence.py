"""`hlbp bench convergence --long --quick` as the CLI runs it: every method of the long sweep, its curve, the
verdict against the issue's bars, the transmitted fraction per tensor, and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")


def test_long_sweep_quick_writes_every_method_curve_verdict_and_plot(tmp_path: Path, builtin_data: object) -> None:
    out = tmp_path / "conv.json"  # builtin_data: the corpus and tokenizer are cached before the workers start
    proc = subprocess.Popen(
        [sys.executable, "-m", "hlbp.cli.main", "bench", "convergence", "--long", "--quick", "--ablations",
         "--jobs", "2", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    # each method is written as soon as it finishes: the first version of the file holds some, not all
    first = None
    deadline = time.monotonic() + 300
    while first is None and proc.poll() is None and time.monotonic() < deadline:
        if out.exists():
            first = json.loads(out.read_text())
        else:
            time.sleep(0.02)
    _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, stderr[-3000:]
    assert first is not None and first["result"]["complete"] is False and 1 <= len(first["result"]["runs"]) < 7
    doc = json.loads(out.read_text())
    assert doc["result"]["complete"] is True
    runs = doc["result"]["runs"]
    assert set(runs) == {
        "adamw (1 replica, R x batch)", "diloco outer lr 0.6", "diloco outer lr 0.7", "sparseloco k=64 lr x1",
        "sparseloco k=64 lr x1.25", "sparseloco k=64 lr x1 small dense", "sparseloco k=64 lr x1 clip off",
    }
    cfg = doc["config"]
    assert cfg["rounds"] == 3 and cfg["warmup_steps"] == 1 and cfg["torch_threads"] == 1
    for label, res in runs.items():
        losses = [r["val_loss"] for r in res["history"]]
        assert len(losses) == cfg["rounds"] + 1 and losses[-1] < losses[0], label
        assert res["best_val_loss"] == min(losses)
    # the two inner learning rates really differ, and the same seed starts every method from the same loss
    assert runs["sparseloco k=64 lr x1.25"]["inner_lr"] == pytest.approx(1.25 * runs["sparseloco k=64 lr x1"]["inner_lr"])
    assert len({res["history"][0]["val_loss"] for res in runs.values()}) == 1
    # the small-tensor rule: a norm weight goes whole under "dense", 2 of 128 values under top-k
    topk, dense = runs["sparseloco k=64 lr x1"]["transmitted"], runs["sparseloco k=64 lr x1 small dense"]["transmitted"]
    assert topk["per_tensor"]["norm.weight"] == pytest.approx(2 / 128) and dense["per_tensor"]["norm.weight"] == 1.0
    assert dense["total"] > topk["total"] and dense["values"] > topk["values"]
    v = doc["result"]["verdict"]
    assert v["best_diloco"].startswith("diloco") and v["best_sparseloco"].startswith("sparseloco")
    assert v["bytes_ratio_vs_diloco"] > 100 and "loss_ratio_vs_adamw" in v
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_long_sweep_is_the_issues_seven_runs_and_ablations_add_three() -> None:
    from hlbp.peer.bench.convergence import ConvergenceBenchConfig, methods

    labels = [m.label for m in methods(ConvergenceBenchConfig.long())]
    assert labels == ["adamw (1 replica, R x batch)", "diloco outer lr 0.6", "diloco outer lr 0.7",
                      "sparseloco k=64 lr x1", "sparseloco k=64 lr x1.25", "sparseloco k=128 lr x1",
                      "sparseloco k=128 lr x1.25"]
    more = [m.label for m in methods(ConvergenceBenchConfig.long(ablations=True))]
    assert more == labels + ["sparseloco k=64 lr x1 small dense", "sparseloco k=128 lr x1 small dense",
                             "sparseloco k=64 lr x1 clip off"]
    grid = methods(ConvergenceBenchConfig.long(ks=(128,), lr_mults=(1.0,), alphas=(0.8, 1.0), betas=(0.95, 0.98)))
    assert {m.label: (m.outer.alpha, m.outer.beta) for m in grid if m.family == "sparseloco"} == {
        "sparseloco k=128 lr x1 a=0.8": (0.8, 0.95), "sparseloco k=128 lr x1 a=0.8 b=0.98": (0.8, 0.98),
        "sparseloco k=128 lr x1": (1.0, 0.95), "sparseloco k=128 lr x1 b=0.98": (1.0, 0.98)}


def test_overlap_sweep_reports_naive_and_eager_against_no_overlap(builtin_data: object) -> None:
    import io

    import torch
    from rich.console import Console

    from hlbp.peer.bench.convergence import ConvergenceBenchConfig, run_convergence_bench

    cfg = ConvergenceBenchConfig.overlap(quick=True, rounds=2, inner_steps=2, seq_len=32, replicas=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        doc = run_convergence_bench(cfg, None, Console(file=io.StringIO(), width=200))
    finally:
        torch.set_num_threads(before)
    runs, v = doc["result"]["runs"], doc["result"]["verdict"]
    assert {label.split(" overlap ")[-1] for label in runs if " overlap " in label} == {"none", "naive", "eager"}
    assert set(v["diloco"]) == set(v["sparseloco"]) == {"naive", "eager"}
    for fam in ("diloco", "sparseloco"):
        none = next(res for label, res in runs.items() if label.startswith(fam) and label.endswith("overlap none"))
        for mode, ratio in v[fam].items():
            res = next(r for label, r in runs.items() if label.startswith(fam) and label.endswith(f"overlap {mode}"))
            assert res["tokens"] == none["tokens"]
            assert ratio == pytest.approx(res["final_val_loss"] / none["final_val_loss"])


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "convergence", *args],
                          check=False, capture_output=True, text=True, timeout=timeout)


def test_sweep_flags_choose_the_long_sweeps_settings(tmp_path: Path, builtin_data: object) -> None:
    out = tmp_path / "conv.json"
    proc = _bench("--long", "--quick", "--rounds", "1", "--inner-steps", "1", "--diloco-lrs", "0.5", "--ks", "128",
                  "--lr-mults", "1.25", "--alphas", "0.5,1", "--betas", "0.95,0.98", "--only", "lr x1.25",
                  "--seed", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["result"]["runs"]
    sl = ["sparseloco k=128 lr x1.25 a=0.5", "sparseloco k=128 lr x1.25 a=0.5 b=0.98", "sparseloco k=128 lr x1.25",
          "sparseloco k=128 lr x1.25 b=0.98"]
    assert set(runs) == {"adamw (1 replica, R x batch)", "diloco outer lr 0.5", *sl}
    cfg = doc["config"]
    assert (cfg["diloco_lrs"], cfg["ks"], cfg["lr_mults"], cfg["seed"]) == ([0.5], [128], [1.25], 3)
    assert (cfg["alphas"], cfg["betas"]) == ([0.5, 1.0], [0.95, 0.98])
    # the outer step really takes α: half the step ends elsewhere than the whole one (β needs a second round)
    assert runs[sl[0]]["final_val_loss"] != runs[sl[2]]["final_val_loss"]


@pytest.mark.parametrize(("args", "message"), [
    (("--long", "--quick", "--ks", "9999"), "k must be in 1..4096"),
    (("--long", "--quick", "--diloco-lrs", "0.5,x"), "--diloco-lrs takes comma-separated numbers"),
    (("--long", "--quick", "--lr-mults", "nan"), "--lr-mults: every value must be a finite number > 0"),
    (("--long", "--quick", "--diloco-lrs", "inf"), "--diloco-lrs: every value must be a finite number > 0"),
    (("--quick", "--diloco-lrs", "0.5"), "add --long"),
    (("--quick", "--betas", "1"), "beta and momentum must be in [0, 1)"),
    (("--quick", "--ablations"), "add --long"),
    (("--quick", "--alphas", "0"), "--alphas: every value must be a finite number > 0"),
    (("--quick", "--noloco", "--long"), "separate sweeps"),
    (("--quick", "--stale", "--state"), "separate sweeps"),
])
def test_bad_sweep_flags_fail_before_any_run(args: tuple[str, ...], message: str) -> None:
    proc = _bench(*args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "round" not in proc.stderr  # nothing ran: no progress line was printed


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:  # a zombie is gone for our purpose: it runs nothing
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_the_workers_with_the_bench(builtin_data: object) -> None:
    # the workers used to outlive a stopped bench and keep the cores busy for the rest of their hour-long runs
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "hlbp.cli.main", "bench", "convergence", "--long", "--quick",
                             "--jobs", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:  # 2 workers and the resource tracker
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) >= 3, workers
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)]
    finally:
        proc.kill()


def test_noloco_sweep_runs_dense_and_sparse_pairs_beside_the_round_methods(tmp_path: Path,
                                                                            builtin_data: object) -> None:
    """`hlbp bench convergence --noloco --quick` as the CLI runs it (3 replicas: one sits out each round)."""
    out = tmp_path / "noloco.json"
    proc = _bench("--noloco", "--quick", "--replicas", "3", "--rounds", "2", "--jobs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["result"]["runs"]
    assert set(runs) == {"adamw (1 replica, R x batch)", "diloco", "sparseloco k=64", "noloco dense",
                         "noloco sparse k=64"}
    assert len({res["tokens"] for res in runs.values()}) == 1  # equal tokens for every method
    for label in ("noloco dense", "noloco sparse k=64"):
        h = runs[label]["history"]
        assert h[-1]["val_loss"] < h[0]["val_loss"], label
        assert 0 < runs[label]["final_spread"] < 0.5, label  # apart, never identical, yet close
        assert runs[label]["bounded"] == 0, label  # honest partners stay within the bounds
    dense, sparse = runs["noloco dense"], runs["noloco sparse k=64"]
    # dense sends φ and d in fp32 (8 bytes a parameter per paired replica); sparse far less
    assert dense["bits_per_param"] == pytest.approx(64, rel=0.01)
    assert sparse["bytes_per_round_per_replica"] * 50 < dense["bytes_per_round_per_replica"]
    v = doc["result"]["noloco"]
    assert v["noloco dense"]["against"] == "diloco" and v["noloco sparse k=64"]["against"] == "sparseloco k=64"
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_state_sweep_runs_sparseloco_with_its_own_state_in_float32_and_in_bf16(tmp_path: Path,
                                                                             builtin_data: object) -> None:
    """`hlbp bench convergence --state --quick`: the same SparseLoCo with the peer's own state (error feedback,
    AdamW's moments) stored in float32 and in bf16, on equal tokens; the bf16 runs train, and differ from float32."""
    out = tmp_path / "state.json"
    proc = _bench("--state", "--quick", "--rounds", "2", "--jobs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["result"]["runs"]
    sl = ["sparseloco k=64 fp32 state", "sparseloco k=64 ef bf16", "sparseloco k=64 ef+v bf16",
          "sparseloco k=64 ef+moments bf16"]
    assert set(runs) == {"adamw (1 replica, R x batch)", "diloco", *sl}
    assert len({res["tokens"] for res in runs.values()}) == 1
    for label in sl:
        h = runs[label]["history"]
        assert h[-1]["val_loss"] < h[0]["val_loss"], label
    assert runs[sl[3]]["final_val_loss"] != runs[sl[0]]["final_val_loss"]  # the moments really were rounded


def test_stale_sweep_runs_each_method_with_fresh_stale_and_look_ahead_gradients(tmp_path: Path,
                                                                               builtin_data: object) -> None:
    """`hlbp bench convergence --stale --quick`: the single AdamW run and SparseLoCo with one-step-stale gradients
    and with a look-ahead, beside their fresh selves on equal tokens; each stale arm trains, differs from fresh, and
    is reported as a ratio to it."""
    out = tmp_path / "stale.json"
    proc = _bench("--stale", "--quick", "--rounds", "2", "--jobs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    runs = result["runs"]
    arms = ["adamw stale", "adamw lookahead", "sparseloco k=64 stale", "sparseloco k=64 lookahead"]
    assert set(runs) == {"adamw (1 replica, R x batch)", "diloco", "sparseloco k=64 fresh", *arms}
    assert len({res["tokens"] for res in runs.values()}) == 1
    for label in arms:
        h = runs[label]["history"]
        assert h[-1]["val_loss"] < h[0]["val_loss"], label
        fresh = "adamw (1 replica, R x batch)" if label.startswith("adamw") else "sparseloco k=64 fresh"
        assert runs[label]["final_val_loss"] != runs[fresh]["final_val_loss"]  # the gradients really were stale
        assert result["stale"][label]["against"] == fresh
        assert result["stale"][label]["loss_ratio"] == runs[label]["final_val_loss"] / runs[fresh]["final_val_loss"]
    assert "sparseloco k=64 stale / sparseloco k=64 fresh" in proc.stderr + proc.stdout
