"""The container image's files stay in step with the project (the image itself is built and run by `make
image-test`, outside the suite): every package folder is copied in, the entry point is valid shell, and the image's
constraints pin every dependency hlbp declares."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("peer", "protocol", "cli", "bootstrap")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_image_copies_every_package_folder_and_its_entry_point() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for top in TOP_LEVEL:
        assert re.search(rf"^COPY {top} \./{top}$", dockerfile, re.MULTILINE), top
    assert 'ENTRYPOINT ["hlbp-entrypoint"]' in dockerfile
    assert subprocess.run(["sh", "-n", str(ROOT / "docker" / "entrypoint.sh")], check=False).returncode == 0
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # a context of gigabytes otherwise


def test_the_image_constraints_pin_every_declared_dependency_but_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["hf"]}
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not a pin: {line}"
            pins[name.lower().replace("_", "-")] = version
    assert "torch" not in pins  # the Dockerfile installs torch from the index it is given
    assert declared - {"torch"} <= set(pins), sorted(declared - {"torch"} - set(pins))
