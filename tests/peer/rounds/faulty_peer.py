"""``hlbp join`` with a fault hook: the misbehaving replicas of the fault tests, started as real processes.

Usage: ``python faulty_peer.py FAULT join ...``, where FAULT is one of :data:`FAULTS` (``name`` or ``name:arg``).
The ``join`` flags are read as ``hlbp join`` reads them, and the hook is passed as an object to the peer's own entry
point (:func:`hlbp.peer.node.session.run_join`); no command, flag or variable of ``hlbp`` can reach it. Tests build
the command with :func:`program`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from hlbp.peer.rounds.faults import FaultHook
from hlbp.peer.rounds.outer import Contribution


class Slow(FaultHook):
    """A straggler: sleeps after every inner step."""

    def __init__(self, seconds: str = "2.0") -> None:
        self.seconds = float(seconds)

    def inner_step(self, round_: int, step: int) -> None:
        time.sleep(self.seconds)


class Corrupt(FaultHook):
    """Serves bytes that match its signed digest but do not decode (everything after the first 64 flipped)."""

    def payload(self, round_: int, shard: int, blob: bytes, limit: int) -> bytes:
        return blob[:64] + bytes(b ^ 0x5A for b in blob[64:])


class Oversize(FaultHook):
    """Announces and serves a payload one byte above the receivers' limit."""

    def payload(self, round_: int, shard: int, blob: bytes, limit: int) -> bytes:
        return blob + bytes(limit + 1 - len(blob))


class _Rewrite(FaultHook):
    """A well-formed, finite lie: each sparse tensor rewritten before encoding, so the payload decodes cleanly."""

    def contribution(self, round_: int, shard: int, contribution: Contribution) -> Contribution:
        return replace(contribution, tensors={n: self.rewrite(t) for n, t in contribution.tensors.items()})

    def rewrite(self, t):
        return t


class Scale(_Rewrite):
    """Every decoded value multiplied by ``factor`` (lookup table and shift scaled)."""

    def __init__(self, factor: str = "1e6") -> None:
        self.factor = float(factor)

    def rewrite(self, t):
        if t.table is None:
            return replace(t, values=t.values * self.factor)
        return replace(t, table=(t.table * self.factor).float(), shift=float(torch.tensor(t.shift * self.factor)))


class BigTable(_Rewrite):
    """An outsized 2-bit lookup table: decoded magnitudes about 1e30."""

    def rewrite(self, t):
        if t.table is None:
            return replace(t, values=torch.full_like(t.values, 1e30))
        return replace(t, table=torch.tensor([-1e30, -1e29, 1e29, 1e30], dtype=torch.float32))


class NaN(_Rewrite):
    """NaN in the lookup table."""

    def rewrite(self, t):
        if t.table is None:
            return replace(t, values=torch.full_like(t.values, float("nan")))
        return replace(t, table=torch.full((4,), float("nan")))


class LyingCoordinator(BigTable):
    """Sends an outsized lookup table and, whenever it coordinates, accepts every contribution, its own included:
    the guard that every peer runs before commit must catch what this coordinator let through."""

    def accept(self, round_: int, admitted: dict, notices: dict) -> dict:
        return dict(notices)


class Freeze(FaultHook):
    """Freezes its own process (SIGSTOP: alive, not answering) half a second after building its payload of round
    ``round_``, so that others are fetching from it when the test acts."""

    def __init__(self, round_: str = "2") -> None:
        self.round = int(round_)

    def payload(self, round_: int, shard: int, blob: bytes, limit: int) -> bytes:
        if round_ == self.round and shard == 0:
            print(f"freezing in round {round_}", flush=True)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return blob


class DieAfterApply(FaultHook):
    """Applies round ``round_`` (its contribution accepted), stalls two seconds while the others fetch from it,
    then SIGKILLs itself before it publishes its checksums."""

    def __init__(self, round_: str = "1") -> None:
        self.round = int(round_)

    def applied(self, round_: int) -> None:
        if round_ == self.round:
            print(f"dying after applying round {round_}", flush=True)
            time.sleep(2.0)  # the fault's own behaviour (a member stalled, then gone), not a synchronisation
            os.kill(os.getpid(), signal.SIGKILL)


class NoDhtNotices(FaultHook):
    """From round ``round_`` on, never stores its contribution notices in the DHT: the others learn of them only
    from its pushes."""

    def __init__(self, round_: str = "1") -> None:
        self.round = int(round_)

    def stores(self, key: str) -> bool:
        parts = key.split(":")  # hlbp:<run>:round:<r>:<kind>
        return not (len(parts) == 5 and parts[4] == "contrib" and int(parts[3]) >= self.round)


FAULTS = {"slow": Slow, "corrupt": Corrupt, "oversize": Oversize, "scale": Scale, "bigtable": BigTable, "nan": NaN,
          "lying-coordinator": LyingCoordinator, "freeze": Freeze, "die-after-apply": DieAfterApply,
          "no-dht-notices": NoDhtNotices}


def program(fault: str) -> list[str]:
    """The command that runs ``join`` with the fault hook ``fault`` (``name`` or ``name:arg``): this script."""
    return [sys.executable, str(Path(__file__).resolve()), fault]


def hook(fault: str) -> FaultHook:
    name, _, arg = fault.partition(":")
    return FAULTS[name](arg) if arg else FAULTS[name]()


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"]:
        sys.exit(f"usage: {sys.argv[0]} FAULT join [FLAGS]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_join(join_plan(sys.argv[3:]), lambda line: print(line, flush=True), hook(sys.argv[1]))
