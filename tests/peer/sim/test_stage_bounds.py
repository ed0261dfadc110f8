"""What a simulation's readers take for the run's stage split is what its bootstrap signs into the manifest."""

from __future__ import annotations

import pytest

from hlbp.bootstrap.config import build_manifest, load_run_config
from hlbp.peer.sim.launcher import SimConfig


@pytest.mark.parametrize(("model", "n_stages", "seq_len"),
                         [("tiny", 2, 64), ("tiny", 3, 64), ("tiny", 2, 128), ("small", 3, 256), ("small", 2, 64)])
def test_the_sims_stage_bounds_are_the_manifests(tmp_path, model, n_stages, seq_len) -> None:
    sim = SimConfig(model=model, n_stages=n_stages, seq_len=seq_len)
    path = tmp_path / "run.toml"
    path.write_text(sim.run_toml(), encoding="utf-8")
    manifest = build_manifest(load_run_config(path), b'{"tok": 1}', issued_at=1.0)
    assert list(manifest.stages) == sim.stage_bounds()


@pytest.mark.slow
def test_the_bootstrap_says_which_layers_each_stage_holds(tmp_path) -> None:
    """A real ``hlbp bootstrap`` of a 2-stage tiny run prints the split it signed: the head-heavy last stage keeps
    one layer."""
    from hlbp.peer.sim.launcher import Swarm

    with Swarm(SimConfig(model="tiny", n_stages=2, seq_len=64), tmp_path) as sw:
        sw.start()
        line = sw.bootstrap.wait_for(r"stages \(layers [^)]*\)", 120).group(0)
    assert line == "stages (layers 0-2, 3)"
