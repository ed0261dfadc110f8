"""`hlbp bench heterogeneous` in process: the pipeline replicas are cut where a run's manifest cuts them (or evenly,
on request), and the quick matrix runs end to end from the command line."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hlbp.peer.bench.heterogeneous import (
    Cell,
    HeterogeneousBenchConfig,
    build_replicas,
    run_heterogeneous_bench,
    stage_bounds,
)
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data.streams import PreparedData
from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import preset


def test_stages_are_cut_as_the_manifest_cuts_them_or_evenly() -> None:
    tiny = preset("tiny")
    assert stage_bounds(HeterogeneousBenchConfig(), tiny) == [(0, 3), (3, 4)]  # the head weighs about five blocks
    assert stage_bounds(HeterogeneousBenchConfig(partition="even"), tiny) == [(0, 2), (2, 4)]
    with pytest.raises(UserInputError, match="partition must be one of balanced, even"):
        stage_bounds(HeterogeneousBenchConfig(partition="uneven"), tiny)


@pytest.mark.parametrize(("partition", "bounds"), [("balanced", [(0, 3), (3, 4)]), ("even", [(0, 2), (2, 4)])])
def test_pipeline_replicas_hold_those_layers_and_variant_a_constrains_the_layers_before_the_last_stage(
        builtin_data: PreparedData, partition: str, bounds: list[tuple[int, int]]) -> None:
    cfg = HeterogeneousBenchConfig.quick(partition=partition, replicas=2)
    base = preset(cfg.model, vocab_size=builtin_data.vocab_size, max_seq_len=cfg.seq_len)
    cell = Cell("half", 1, CodecConfig("subspace-a", "1/32", seed=cfg.seed))
    config, replicas = build_replicas(cfg, cell, base, builtin_data, torch.device("cpu"))
    assert config.subspace_layers == bounds[-1][0]
    full, pipe = replicas
    assert len(full.model.stages) == 1
    assert [(s.start, s.end) for s in pipe.model.stages] == bounds


def test_the_partition_moves_only_the_pipeline_cells(tmp_path: Path, cache_dir: Path, one_thread: None) -> None:
    """The all-full cell trains no pipeline, so both partitions give it the same bytes; under B the lossy boundary
    sits after a different layer, so a cell of pipelines ends elsewhere."""
    docs = {}
    for partition in ("balanced", "even"):
        cfg = HeterogeneousBenchConfig.quick(partition=partition, rounds=1, variants=("subspace-b",),
                                             splits=("none", "all"), cache_dir=cache_dir)
        docs[partition] = run_heterogeneous_bench(cfg, tmp_path / f"{partition}.json", Console(file=io.StringIO()))
    cells = {p: {c["split"]: c for c in d["result"]["cells"]} for p, d in docs.items()}
    assert cells["balanced"]["none"]["final_val_loss"] == cells["even"]["none"]["final_val_loss"]
    assert cells["balanced"]["all"]["final_val_loss"] != cells["even"]["all"]["final_val_loss"]
    assert all(math.isfinite(c["final_val_loss"]) for by in cells.values() for c in by.values())
    written = json.loads((tmp_path / "even.json").read_text())
    assert written["config"]["partition"] == "even" and written["config"]["stage_bounds"] == [[0, 2], [2, 4]]


def test_the_command_line_takes_the_partition_and_refuses_it_with_network(tmp_path: Path) -> None:
    bench = [sys.executable, "-m", "hlbp.cli.main", "bench", "heterogeneous"]
    out = tmp_path / "het.json"
    run = subprocess.run([*bench, "--quick", "--variants", "subspace-b", "--rounds", "1", "--threads", "1",
                          "--partition", "even", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["stage_bounds"] == [[0, 2], [2, 4]]
    assert "2-stage pipelines (layers 0-1, 2-3)" in " ".join(run.stderr.split())
    bad = subprocess.run([*bench, "--network", "--partition", "even"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode == 2 and "--partition" in bad.stderr and "Traceback" not in bad.stderr
