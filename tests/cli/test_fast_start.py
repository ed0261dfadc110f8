"""``hlbp --help`` and the CLI's error paths load no torch: a volunteer asking for help, or mistyping a flag, waits
a fraction of a second instead of the seconds torch's import takes on a small machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import runpy, sys
sys.argv = ["hlbp", *sys.argv[1:]]
try:
    runpy.run_module("hlbp.cli.main", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(f"exit={code} torch={'torch' in sys.modules}", file=sys.stderr)
"""


@pytest.mark.parametrize(("args", "code"), [
    (["--help"], 0), (["join", "--help"], 0), (["bench", "scale", "--help"], 0), (["bootstrap", "--help"], 0),
    (["simulate", "--full", "many"], 2),  # a flag of the wrong type
    (["join", "--manifest", "/nonexistent/run.toml"], 2),  # a user error raised and reported as one line
])
def test_help_and_errors_import_no_torch(args: list[str], code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.stderr.strip().splitlines()[-1] == f"exit={code} torch=False", proc.stderr[-2000:]
