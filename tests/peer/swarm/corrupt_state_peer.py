"""``hlbp join`` as an honest stage peer whose round state is damaged after it applies one round, as a memory fault
would damage it: the peer of the resync tests, started as a real process.

Usage: ``python corrupt_state_peer.py ROUND [late] join ...``. Right after it applies round ROUND, noise as large as
each tensor's own spread is added to every parameter of its shard's anchor, which the settle then loads into the
model and checksums: the next phase trains from the damaged state, and the verification of round ROUND finds the
peer out of sync and resyncs it. That verification is held until the next phase has begun (a verification that
takes longer than the phase's start, as waiting for the full replicas' checksums does), so the resync always lands
under that phase; with ``late``, until the next round has closed as well, so the coordinator audited that phase's
frames before the peer could withdraw them. The round runner's methods are wrapped from here, through the test entry point
:func:`hlbp.peer.node.session.run_join`; the protocol's code calls no hook. Tests build the command with
:func:`program`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def damage(runner: Any, at_round: int, echo: Any = print, late: bool = False) -> None:
    """Wrap ``runner`` (a :class:`~hlbp.peer.rounds.sparseloco.RoundRunner`) so that its state is damaged after it
    applies round ``at_round`` and that round's verification waits for the next phase to begin (``late``: and for
    the next round to close)."""
    begun = threading.Event()
    apply_round, begin_round, confirm = runner.apply_round, runner.begin_round, runner.confirm

    def damaged_apply(r: int, accepted: Any) -> Any:
        outcome = apply_round(r, accepted)
        if r == at_round:
            gen = torch.Generator().manual_seed(1234)
            anchor = runner.state.anchor
            for name in list(anchor):
                t = anchor[name]
                noise = torch.randn(t.shape, generator=gen) * 4 * float(t.float().std().clamp_min(1e-3))
                anchor[name] = (t.float() + noise).to(t.dtype)
            echo(f"damaged the state after round {r}", flush=True)
        return outcome

    def marked_begin(r: int) -> Any:
        if r == at_round + 1:
            begun.set()
        return begin_round(r)

    def held_confirm(r: int, stats: Any, settled: Any) -> Any:
        if r == at_round:
            begun.wait(120)
            deadline = time.monotonic() + 180
            while late and not runner.round_closed(r + 1) and time.monotonic() < deadline:
                time.sleep(0.5)
            if late:
                echo(f"verifying round {r} after round {r + 1} closed", flush=True)
        return confirm(r, stats, settled)

    runner.apply_round, runner.begin_round, runner.confirm = damaged_apply, marked_begin, held_confirm


def program(at_round: int, late: bool = False) -> list[str]:
    """The command that starts a joined stage peer whose state is damaged after round ``at_round`` (``late``: and
    whose verification of that round ends only after the next round closed)."""
    return [sys.executable, str(Path(__file__).resolve()), str(at_round), *(["late"] if late else [])]


if __name__ == "__main__":
    from dataclasses import replace

    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    late = sys.argv[2:3] == ["late"]
    rest = sys.argv[3 if late else 2:]
    if rest[:1] != ["join"] or not sys.argv[1].isdigit():
        sys.exit(f"usage: {sys.argv[0]} ROUND [late] join [FLAGS]")
    at = int(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = join_plan(rest[1:])
    plan = replace(plan, stage=replace(plan.stage, round_faults=lambda runner: damage(runner, at, late=late)))
    run_join(plan, lambda line: print(line, flush=True))
