"""`hlbp bench gather --quick` as the CLI runs it: every cap's curve at equal tokens, kept and dropped, the
verdict against the uncapped reference, and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")


def test_quick_gather_bench_writes_every_arm_and_plot(tmp_path: Path, builtin_data: object) -> None:
    # builtin_data: the corpus and tokenizer are cached before the run. One torch thread: two threads beside a busy
    # loop on 2 cores spin against each other (the run took 278 s instead of 20)
    out = tmp_path / "gather.json"
    proc = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "gather", "--quick", "--threads", "1",
                           "--out", str(out)],
                          check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["result"]["runs"]
    assert list(runs) == ["F=2 dropped", "F=2 kept", "F=2 kept, summed", "F=4 dropped", "F=8 (uncapped)"]
    assert [runs[a]["accepted_per_round"] for a in runs] == [2, 2, 2, 4, 8]
    assert len({res["tokens"] for res in runs.values()}) == 1  # equal tokens: every replica trains every phase
    assert len({res["history"][0]["val_loss"] for res in runs.values()}) == 1  # and starts from the same weights
    for label, res in runs.items():
        losses = [r["val_loss"] for r in res["history"]]
        assert len(losses) == doc["config"]["rounds"] + 1 and losses[-1] < losses[0], label
    # keeping the left-out mass (averaged or summed) and dropping it are three different runs
    assert len({runs[a]["final_val_loss"] for a in ("F=2 kept", "F=2 kept, summed", "F=2 dropped")}) == 3
    v = doc["result"]["verdict"]
    assert v["reference"] == "F=8 (uncapped)" and v["ratio_to_uncapped"]["F=8 (uncapped)"] == 1.0
    assert set(v["F=2"]) == {"dropped_within_1pct", "kept_within_1pct", "kept_beats_dropped"}
    assert out.with_suffix(".png").stat().st_size > 10_000
