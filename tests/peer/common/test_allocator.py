"""Which malloc a peer runs: the decision (pure) and a real process started again with jemalloc where it exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hlbp.peer.common import allocator
from hlbp.peer.common.allocator import JEMALLOC_CONF, JEMALLOC_SONAME, REEXEC_MARK, preload_plan

LIB = JEMALLOC_SONAME


def test_a_peer_command_starts_again_with_jemalloc_preloaded_and_its_settings() -> None:
    env = preload_plan(["hlbp", "join", "--initial-peers", "x"], {"PATH": "/bin"}, LIB, running=False,
                       started_as=["/venv/bin/python", "/venv/bin/hlbp", "join", "--initial-peers", "x"])
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB, "MALLOC_CONF": JEMALLOC_CONF, REEXEC_MARK: "1"}


def test_what_the_user_preloads_and_configures_is_kept() -> None:
    env = preload_plan(["/m/control_cmds.py", "simulate"], {"LD_PRELOAD": "/opt/a.so:/opt/b.so",
                                                           "MALLOC_CONF": "narenas:1"},
                       LIB, running=False, started_as=["python", "-m", "hlbp.cli.control_cmds", "simulate"])
    assert env is not None
    assert env["LD_PRELOAD"] == f"{LIB} /opt/a.so /opt/b.so"
    assert env["MALLOC_CONF"] == "narenas:1"


@pytest.mark.parametrize(("argv", "environ", "library", "running"), [
    (["hlbp", "join"], {"FORKED": "1"}, LIB, False),  # forked from a launcher's warm interpreter: another program
    (["hlbp", "join"], {}, LIB, True),  # already runs it
    (["hlbp", "join"], {}, None, False),  # the system has none
    (["hlbp", "join"], {REEXEC_MARK: "1"}, LIB, False),  # started again once already: never loops
    (["hlbp", "join"], {"HLBP_ALLOCATOR": "glibc"}, LIB, False),  # asked for glibc's
    (["hlbp", "join"], {"HLBP_ALLOCATOR": "inherit"}, LIB, False),  # a launcher's peer runs what it was given
    (["hlbp", "status"], {}, LIB, False),  # not a peer
    (["hlbp"], {}, LIB, False),
    (["hlbp", "join", "--help"], {}, LIB, False),  # help starts as fast as it did
])
def test_nothing_starts_again_where_it_should_not(argv: list[str], environ: dict[str, str], library: str | None,
                                                   running: bool) -> None:
    started = ["python", "-m", "hlbp.peer.sim.zygote", "7", "pad"] if environ.pop("FORKED", "") else ["python", *argv]
    assert preload_plan(argv, environ, library, running, started_as=started) is None


def test_an_unknown_choice_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="HLBP_ALLOCATOR='tcmalloc': expected one of auto, glibc, inherit"):
        preload_plan(["hlbp", "join"], {"HLBP_ALLOCATOR": "tcmalloc"}, LIB, running=False,
                     started_as=["python", "hlbp", "join"])


def test_a_launchers_peers_inherit_unless_glibc_was_asked_for() -> None:
    assert allocator.for_children({}) == "inherit"
    assert allocator.for_children({"HLBP_ALLOCATOR": "auto"}) == "inherit"
    assert allocator.for_children({"HLBP_ALLOCATOR": " GLIBC "}) == "glibc"


def test_a_real_peer_command_runs_jemalloc_exactly_where_the_system_has_it(tmp_path: Path) -> None:
    # a real process deciding as a peer command's entry point does (`hlbp bench memory`), started again where the
    # system has jemalloc; its own /proc/self/maps then says what it runs
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        "from hlbp.peer.common import allocator\n"
        "allocator.run_with_jemalloc()\n"
        "print(allocator.in_use(), flush=True)\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HLBP_ALLOCATOR", REEXEC_MARK)}
    out = subprocess.run([sys.executable, str(probe), "bench", "memory"], env=env, capture_output=True, text=True, timeout=60, check=True)
    expected = "jemalloc" if allocator.find_jemalloc() else "glibc"
    assert out.stdout.split() == [expected]
    kept = subprocess.run([sys.executable, str(probe), "bench", "memory"], env={**env, "HLBP_ALLOCATOR": "glibc"},
                          capture_output=True, text=True, timeout=60, check=True)
    assert kept.stdout.split() == ["glibc"]


def test_a_peers_start_says_which_malloc_it_runs_and_how_to_get_jemalloc() -> None:
    assert allocator.status_line(running=True, available=True) == "malloc: jemalloc"
    assert "HLBP_ALLOCATOR" in allocator.status_line(running=False, available=True)
    assert "libjemalloc2" in allocator.status_line(running=False, available=False)
