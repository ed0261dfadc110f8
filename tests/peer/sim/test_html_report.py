"""``hlbp report``: a run's rounds as one self-contained HTML page, from simulate's report or a replica's metrics;
hostile input is one error line, never markup in the page."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.sim.html_report import load_run, render, write_report


def _sim_report(rounds: int = 3, run_id: str = "demo") -> dict:
    return {"config": {"run_id": run_id, "model": "tiny", "n_full": 2, "inner_steps": 10, "batch_size": 4,
                       "seq_len": 64, "outer": "sparseloco"},
            "rounds": [{"round": r, "members": 3, "accepted": ["p0", "p1", "s0"], "full_val_loss": 8.0 - r / 10,
                        "swarm_val_loss": {"s0": 8.1 - r / 10}, "shards": {"p0": ["0", "1"], "p1": ["0", "1"],
                                                                           "s0": ["0"]},
                        "bytes_sent": {"p0": 1000, "p1": 3000}, "bytes_received": {"p0": 2000, "p1": 2000},
                        "compute_s": 1.0, "comm_s": 0.25, "wait_s": 0.25, "utilization": 0.8,
                        "checksums_equal": True} for r in range(rounds)]}


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_simulates_report_becomes_a_page_with_four_plots_and_the_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "report.json"
    src.write_text(json.dumps(_sim_report()))
    out = write_report(tmp_path)  # the work directory: report.json is found in it, report.html written beside
    page = out.read_text()
    assert out == tmp_path / "report.html"
    images = _images(page)
    assert len(images) == 4 and all(img.startswith(b"\x89PNG") for img in images)
    assert page.count("<tr>") == 1 + 3  # the header and a row per round
    assert "full replicas 7.8000" in page and "swarm s0 7.9000" in page and "2,000" in page  # mean bytes per peer
    run = load_run(src)
    assert run["rounds"][0]["accepted_per_shard"] == {"0": 3, "1": 2}


def test_a_replicas_metrics_make_a_page_too(tmp_path: Path) -> None:
    lines = [{"event": "round", "round": r, "val_loss": 8.0 - r, "bytes_sent": 10, "bytes_received": 20,
              "compute_s": 3.0, "comm_s": 0.5, "wait_s": 0.5, "members": 4, "in_sync": True} for r in range(2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([json.dumps(x) for x in lines] + ["not json", "{}"]))
    run = load_run(tmp_path)
    assert [r["val_loss"] for r in run["rounds"]] == [{"this replica": 8.0}, {"this replica": 7.0}]
    assert run["rounds"][0]["utilization"] == 0.75
    assert "this replica 7.0000" in render(run)


def test_hostile_input_is_one_error_and_never_markup(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rounds": [{"no round": 1}]}')
    with pytest.raises(UserInputError):
        load_run(tmp_path / "bad.json")
    with pytest.raises(UserInputError):
        load_run(tmp_path / "missing.json")
    page = render(load_run(_write(tmp_path, _sim_report(1, run_id="<script>alert(1)</script>"))))
    assert "<script>" not in page and "&lt;script&gt;" in page


def _write(tmp_path: Path, report: dict) -> Path:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    return path


def test_the_command_writes_where_asked_and_fails_in_one_line(tmp_path: Path) -> None:
    src = _write(tmp_path, _sim_report(2))
    cmd = (sys.executable, "-m", "hlbp.cli.main", "report")
    done = subprocess.run([*cmd, str(src), "--out", str(tmp_path / "x.html")], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "x.html").is_file(), done.stderr
    bad = subprocess.run([*cmd, str(tmp_path / "nothing")], check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len((bad.stdout + bad.stderr).strip().splitlines()) == 1, bad.stdout + bad.stderr
