"""Which malloc a peer's process runs: jemalloc where the system has it, glibc's otherwise.

A full replica trains in one thread while its round exchange runs in another, and both allocate from the same
heap: gradients and activations every step, a round's buffers a parameter or a block at a time. glibc's heap ends up
holding 130-200 MiB of free space in pieces between live blocks on the `small` model, which none of the next step's
requests fits (its ``mallinfo2`` at each new peak of a full replica in ``hlbp bench memory``), so the heap grows by
each step's largest request instead. jemalloc keeps allocations of each size class together and returns freed
pages to the system a second after they are freed: through the same rounds a `small` full replica peaked 2.5-4.5
bytes per parameter lower (docs/results.md, "Memory"), for 2-4 % more time per inner step.

So the commands that run a peer (:data:`PEER_COMMANDS`) start themselves again with jemalloc preloaded
(``LD_PRELOAD``) when the system has it and the process does not run it yet; the processes they start inherit it.
``HLBP_ALLOCATOR=glibc`` keeps glibc's; ``HLBP_ALLOCATOR=inherit`` (what a loopback launcher gives its peers) runs
whatever the parent gave. Debian and Ubuntu ship it as ``libjemalloc2``; the Docker image installs it.

:func:`preload_plan` decides (pure, tested); :func:`run_with_jemalloc` is the shell that reads the process and
replaces it.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping, Sequence
from enum import Enum

JEMALLOC_SONAME = "libjemalloc.so.2"
JEMALLOC_CONF = "dirty_decay_ms:1000,muzzy_decay_ms:0"
"""jemalloc's settings unless ``MALLOC_CONF`` says otherwise: freed pages go back to the system after a second
(``dirty_decay_ms``; its default is 10 s, which kept a round's freed buffers resident through the next steps), and
at once rather than through a second, lazily freed stage (``muzzy_decay_ms:0``). Returning them at once instead
(``dirty_decay_ms:0``) measured about 0.5 byte per parameter less but made inner steps 22-30 % slower."""

PEER_COMMANDS = frozenset({"join", "bootstrap", "simulate", "bench", "train"})
"""The subcommands whose process trains or serves a run (others, ``--help`` among them, start as they are)."""

ENV_CHOICE = "HLBP_ALLOCATOR"
REEXEC_MARK = "HLBP_ALLOCATOR_REEXEC"  # set in the environment of the process started again: it never loops


class Choice(Enum):
    """What ``HLBP_ALLOCATOR`` asks for."""

    AUTO = "auto"  # jemalloc where the system has it (unset means this)
    GLIBC = "glibc"  # the C library's own malloc
    INHERIT = "inherit"  # whatever the parent process gave: a launcher's peers


def choice(environ: Mapping[str, str]) -> Choice:
    """The allocator ``environ`` asks for; an unknown value is refused (ValueError names the accepted ones)."""
    value = environ.get(ENV_CHOICE, "auto").strip().lower() or "auto"
    try:
        return Choice(value)
    except ValueError:
        raise ValueError(f"{ENV_CHOICE}={value!r}: expected one of "
                         f"{', '.join(c.value for c in Choice)}") from None


def for_children(environ: Mapping[str, str]) -> str:
    """``HLBP_ALLOCATOR`` for the peers a launcher starts: what this process runs (``inherit``: a peer forked from
    a warm interpreter and started again would lose what that interpreter imported), or glibc's where asked."""
    return Choice.GLIBC.value if environ.get(ENV_CHOICE, "").strip().lower() == Choice.GLIBC.value \
        else Choice.INHERIT.value


def preload_plan(argv: Sequence[str], environ: Mapping[str, str], library: str | None,
                 running: bool, started_as: Sequence[str]) -> dict[str, str] | None:
    """The environment to start this command again with jemalloc preloaded, or None to run on as it is.

    ``argv``: the command line (``argv[1]`` the subcommand); ``library``: jemalloc's file name where the system has
    it (None: it has not); ``running``: this process already runs it; ``started_as``: the interpreter's own command
    line (``sys.orig_argv``). It is started again only when that ends with ``argv``'s arguments: a process forked
    from another program (a launcher's warm interpreter) would start that program again instead."""
    if running or library is None or environ.get(REEXEC_MARK):
        return None
    if len(started_as) < len(argv) or list(started_as[len(started_as) - len(argv) + 1:]) != list(argv[1:]):
        return None
    if choice(environ) is not Choice.AUTO:
        return None
    if len(argv) < 2 or argv[1] not in PEER_COMMANDS or any(a in ("--help", "-h") for a in argv[2:]):
        return None
    env = dict(environ)
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    env["LD_PRELOAD"] = " ".join([library, *preload])
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[REEXEC_MARK] = "1"
    return env


def running_jemalloc(maps: str = "/proc/self/maps") -> bool:
    """Whether this process has jemalloc loaded (its shared library mapped)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any("libjemalloc" in line for line in f)
    except OSError:
        return False


def find_jemalloc() -> str | None:
    """jemalloc's shared library where the system's loader knows it (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    return JEMALLOC_SONAME if ctypes.util.find_library("jemalloc") else None


def in_use() -> str:
    """The allocator this process runs, for reports: "jemalloc" or "glibc"."""
    return "jemalloc" if running_jemalloc() else "glibc"


def status_line(running: bool, available: bool) -> str:
    """What a peer's start says of its allocator: jemalloc, or glibc's and how to change that."""
    if running:
        return "malloc: jemalloc"
    if available:
        return f"malloc: glibc's ({ENV_CHOICE} asked for it, or the peer was started without its entry point)"
    return ("malloc: glibc's; with libjemalloc2 installed (Debian, Ubuntu) a full replica peaks 2.5-4.5 bytes per "
            "parameter lower")


def run_with_jemalloc(argv: Sequence[str] | None = None) -> None:
    """Replace this process by the same command with jemalloc preloaded where :func:`preload_plan` says so;
    return otherwise. Call it first thing in a console entry point, before anything starts a thread."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in PEER_COMMANDS:
        return  # decided before looking anything up: other commands start as fast as they did
    started = list(getattr(sys, "orig_argv", []))
    try:
        env = preload_plan(argv, os.environ, find_jemalloc(), running_jemalloc(), started)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    if env is None:
        return
    os.execve(sys.executable, [sys.executable, *started[1:]], env)
