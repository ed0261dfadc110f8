"""What a non-editable install ships: the wheel holds every module on disk, and a stage peer runs from it.

``make`` installs hlbp in editable mode, so the tests alone would never notice a package missing from the wheel
that ``pip install .`` (and so the Docker image) builds. These tests build that wheel and use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("peer", "protocol", "cli", "bootstrap")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel .`` builds from a copy of this checkout's sources.

    A copy, because an in-tree build reuses a stale ``build/`` folder that may still hold a module the current
    package list would drop. No build isolation: nothing is fetched.
    """
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=240,
    )
    (built,) = out.glob("hlbp-*.whl")
    return built


def _modules_on_disk() -> set[str]:
    return {f"hlbp/{path.relative_to(ROOT).as_posix()}"
            for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")}


def test_the_wheel_ships_every_module_on_disk(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
    on_disk = _modules_on_disk()
    assert "hlbp/peer/swarm/driver.py" in on_disk
    assert on_disk - shipped == set(), "modules a wheel install would lack"
    assert shipped - on_disk == set(), "modules in the wheel that are not in the checkout"


@pytest.mark.slow
def test_a_stage_peer_runs_from_a_non_editable_install(wheel: Path, tmp_path: Path) -> None:
    """A 2-stage swarm beside a full replica, every process importing hlbp from the installed wheel only.

    ``-S`` keeps the editable install's import hook (a .pth file) out of the parent; its children inherit
    PYTHONPATH, where the installed copy comes first.
    """
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=240,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"],
                                                         sysconfig.get_paths()["platlib"]])}
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import hlbp.peer.node.stage, hlbp.peer.swarm as s; print(s.__file__)"],
        check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(target)

    report = tmp_path / "simulate.json"
    run = subprocess.run(
        [sys.executable, "-S", "-m", "hlbp.cli.main", "simulate", "--full", "1", "--swarms", "1", "--stages", "2",
         "--rounds", "2", "--inner-steps", "2", "--out", str(report)],
        check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(report.read_text(encoding="utf-8"))
    assert summary["rounds_completed"] == 2
    assert summary["checksums_equal"] == [True, True]
    for record in summary["rounds"]:
        assert sorted(record["accepted"]) == ["peer0", "sw0s0", "sw0s1"]
