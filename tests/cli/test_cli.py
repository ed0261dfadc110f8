"""The `hlbp` command as a user runs it: a real subprocess, real text, clear errors with exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HLBP = str(Path(sys.executable).with_name("hlbp"))


def run(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([HLBP, *args], check=False, capture_output=True, text=True, timeout=timeout, env=full_env)


def test_help_and_version():
    out = run("--help")
    assert out.returncode == 0 and "train" in out.stdout
    ver = run("--version")
    assert ver.returncode == 0 and ver.stdout.startswith("hlbp ")
    train_help = run("train", "--help")
    assert "HLBP_STEPS" in train_help.stdout and "HLBP_DATA" in train_help.stdout


def test_train_smoke_writes_metrics_checkpoint_and_resumes(small_text, tmp_path, cache_dir):
    common = [
        "--data", str(small_text), "--vocab-size", "512", "--batch-size", "4", "--seq-len", "32",
        "--eval-every", "2", "--eval-batches", "2", "--out-dir", str(tmp_path / "run"), "--no-progress",
        "--cache-dir", str(cache_dir),
    ]
    first = run("train", "--steps", "3", *common)
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
    assert (tmp_path / "run" / "checkpoint.safetensors").exists()
    events = [json.loads(line)["event"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert events.count("train") == 3 and "eval" in events

    again = run("train", "--steps", "3", *common)
    assert again.returncode == 2 and "--resume" in again.stderr

    # flags can come from HLBP_* variables
    resumed = run("train", *common, env={"HLBP_STEPS": "5", "HLBP_RESUME": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 5


def test_train_with_recomputed_blocks_makes_the_same_losses_bit_for_bit(small_text, tmp_path, cache_dir):
    losses = {}
    for flags in ([], ["--recompute"]):
        out = tmp_path / ("recompute" if flags else "held")
        proc = run("train", "--steps", "3", "--data", str(small_text), "--vocab-size", "512", "--batch-size", "4",
                   "--seq-len", "32", "--eval-every", "3", "--eval-batches", "1", "--out-dir", str(out),
                   "--no-progress", "--cache-dir", str(cache_dir), *flags)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[bool(flags)] = [(r["event"], r["loss"]) for r in records if "loss" in r]
        assert json.loads((out / "summary.json").read_text())["recompute"] is bool(flags)
    assert len(losses[False]) >= 3 and losses[True] == losses[False]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "huge"], "unknown model preset"),
        (["--data", "/no/such/path"], "/no/such/path"),
        (["--steps", "0"], "--steps"),
        (["--lr", "-1"], "--lr"),
        (["--seq-len", "100000"], "--seq-len"),
        (["--device", "cuda:0"] if not os.path.exists("/dev/nvidia0") else ["--device", "tpu"], "device"),
    ],
)
def test_bad_flags_give_one_line_errors(args, message, small_text, tmp_path, cache_dir):
    out = run(
        "train", "--data", str(small_text), "--vocab-size", "512", "--cache-dir", str(cache_dir),
        "--out-dir", str(tmp_path), "--no-progress", *args,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_unparseable_flag_is_rejected_by_the_parser():
    out = run("train", "--steps", "many")
    assert out.returncode == 2 and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", [["simulate", "--outer", "adam"], ["bootstrap", "--outer", "adam",
                                                                      "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]])
def test_unknown_outer_optimizer_is_one_line(command, tmp_path):
    out = run(*command, env={"HLBP_IDENTITY": str(tmp_path / "k"), "HLBP_CACHE": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert "--outer must be" in out.stderr and "Traceback" not in out.stderr


def test_fault_hooks_are_no_flags():
    """Fault injection is an object a test passes in code, so no command line or HLBP_* variable can reach it."""
    join_help = run("join", "--help").stdout
    assert "HLBP_INITIAL_PEERS" in join_help
    assert not re.search(r"\bfaults?\b|inject", join_help, re.IGNORECASE)
    bad = run("join", "--inject-corrupt", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x")
    assert bad.returncode == 2 and "No such option" in bad.stderr


def test_log_level_variable_is_checked():
    out = run("bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", env={"HLBP_LOG_LEVEL": "chatty"})
    assert out.returncode == 2 and "HLBP_LOG_LEVEL must be" in out.stderr and "Traceback" not in out.stderr


def test_a_run_config_that_is_not_utf8_is_one_line_and_exit_2(tmp_path) -> None:
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_bytes(b"\xff\xfe[hparams]\n")
    run = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bootstrap", "--run-config", str(config)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stderr
    assert "is not UTF-8 text" in run.stderr and "Traceback" not in run.stderr
