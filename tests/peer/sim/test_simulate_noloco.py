"""`hlbp simulate --outer noloco` as a user runs it: real processes, the pairs, the spread and the bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_simulate_noloco_reports_pairs_spread_and_bytes(tmp_path: Path) -> None:
    out = tmp_path / "noloco.json"
    proc = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "simulate", "--outer", "noloco", "--noloco-payload", "sparse", "--full", "3",
                           "--rounds", "2", "--inner-steps", "3", "--out", str(out),
                           "--deadline", "30"],  # a partner's message is waited for up to 30 s (a loaded box)
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["rounds_completed"] == 2 and not report["timed_out"]
    # three replicas: every round one of them has no partner, the other two are paired
    assert [r["paired"] for r in report["rounds"]] == [2, 2]
    pairs = report["noloco"]
    assert pairs["paired"] == pytest.approx(2 / 3) and pairs["bounded"] == 0 and pairs["checkpoints"] == 3
    assert 0 < pairs["spread"] < 0.3
    assert report["val_loss"][-1] < report["val_loss"][0]
    # SparseLoCo's payload between partners: far below the dense pair's φ and d in fp32
    assert 0 < report["bytes_per_peer_round"]["sent"] * 20 < 8 * report["n_params"]
    assert "noloco: 67% of the replicas' rounds paired" in proc.stdout
    assert "checksums equal" not in proc.stdout
