"""A run whose peers fail is an outcome the command reports in one line, with exit status 1, not a traceback."""

from __future__ import annotations

import io
import os
import sys

import pytest
import typer
from rich.console import Console

from hlbp.cli.options import run_app
from hlbp.peer.common.errors import RunFailed
from hlbp.peer.sim.launcher import PeerProcess, RunTimeout


def test_a_peer_that_exits_before_its_line_is_a_typed_run_failure_naming_it_and_its_output() -> None:
    proc = PeerProcess("s1", ["-c", "print('loading the model'); raise SystemExit(3)"], dict(os.environ),
                       program=[sys.executable])
    with pytest.raises(RunTimeout) as caught:
        proc.wait_for("^announced", 60)
    message = str(caught.value)
    assert message.startswith("s1: no line matching '^announced' (exit 3)") and "loading the model" in message
    assert isinstance(caught.value, RunFailed) and isinstance(caught.value, TimeoutError)  # old handlers still catch it


def test_the_cli_prints_a_failed_run_as_an_error_and_exits_1_without_a_traceback() -> None:
    app = typer.Typer()

    @app.command()
    def bench() -> None:
        raise RunTimeout("s1: no line matching '^announced' (exit 3):\nloading the model")

    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        sys.argv = ["hlbp"]
        run_app(app, Console(file=out, width=200))
    assert exited.value.code == 1
    text = out.getvalue()
    assert text.startswith("error: s1: no line matching '^announced' (exit 3):") and "Traceback" not in text
