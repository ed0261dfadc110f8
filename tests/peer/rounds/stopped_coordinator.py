"""``hlbp join`` as a full replica stopped the moment it closed a round, before its accepted set got out.

From round ``ROUND`` on, whenever this peer's turn to close comes first, it closes the round on its own contribution
alone with a set that never leaves it: kept in its own inbox, never pushed, never stored in the DHT. Once it has
applied that round it stops itself (SIGTERM, so it saves its checkpoint and exits 0) before publishing its
checksums, and its checkpoint keeps no proof of the set. The others never see the set; they take over the round
with their own, whose result differs. What a restart from that checkpoint must not do is resume it as the newest
state while the others are still closing the round.

Usage: ``python stopped_coordinator.py ROUND join ...``. The round runner's closer, records, state sync and
checkpoints are wrapped from here, through the test entry point :func:`hlbp.peer.node.session.run_join`; the
protocol's code calls no hook. Tests build the command with :func:`program`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from faulty_peer import Delegate


class SecretCloser(Delegate):
    """Closes each round from ``start`` on with an unseen set of its own contribution alone, until one counts (its
    turn came first): then that round is the one it stops after."""

    def __init__(self, inner: Any, runner: Any, start: int) -> None:
        super().__init__(inner)
        self.runner, self.start = runner, start
        self.secret_round: int | None = None
        self.secret_keys: set[str] = set()  # the keys of the sets it kept to itself: never stored in the DHT
        keep = runner.records.keep_store
        runner.records.keep_store = lambda k: k not in self.secret_keys and keep(k)

    def close(self, r: int) -> Any:
        from hlbp.protocol.roundwire import KIND_ACCEPTED, AcceptedSet, round_key

        if r < self.start or self.secret_round is not None:
            return self.inner.close(r)
        notices, _sets = self.inner.round_records(r, wait=False)
        mine = notices.get(self.inner.me)
        if mine is None:
            return self.inner.close(r)
        key = round_key(self.inner.cfg.run_id, r, KIND_ACCEPTED)
        self.secret_keys.add(key)
        body = AcceptedSet(self.inner.me, r, ((mine.sender, mine.tokens, mine.digests),)).to_body(self.inner.cfg.run_id)
        self.runner.records.store(key, body, KIND_ACCEPTED, only=frozenset())  # pushed to nobody: our inbox only
        accepted = self.inner.close(r)
        if accepted is not None and accepted.coordinator == self.inner.me and len(accepted.members) == 1:
            self.secret_round = r
            print(f"closed round {r} with a set nobody else has", flush=True)
        return accepted


class StoppingSync(Delegate):
    """Stops the peer (SIGTERM) instead of publishing its checksums of the round it closed in secret."""

    def __init__(self, inner: Any, closer: SecretCloser) -> None:
        super().__init__(inner)
        self.closer = closer

    def publish(self, state: Any, mine: Any, to: Any = frozenset(), sampled: bool = False) -> None:
        if mine.round == self.closer.secret_round:
            print(f"stopping after applying round {mine.round}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.inner.publish(state, mine, to, sampled)


class ProoflessCheckpoints(Delegate):
    """Saves checkpoints without the proof of the secret round's set (what a peer stopped mid-close may lack)."""

    def __init__(self, inner: Any, closer: SecretCloser) -> None:
        super().__init__(inner)
        self.closer = closer

    def _strip(self, state: Any) -> None:
        if self.closer.secret_round is not None and state.round == self.closer.secret_round + 1:
            state.evidence = {}

    def save(self, state: Any) -> None:
        self._strip(state)
        self.inner.save(state)

    def save_if_due(self, state: Any) -> None:
        self._strip(state)
        self.inner.save_if_due(state)


def stop_after_secret_close(start: int) -> Any:
    """The wrapper of a built round runner that makes it this fault."""

    def wrap(runner: Any) -> None:
        closer = SecretCloser(runner.closer, runner, start)
        runner.closer = closer
        runner.syncer = StoppingSync(runner.syncer, closer)
        runner.checkpoints = ProoflessCheckpoints(runner.checkpoints, closer)

    return wrap


def program(start: int) -> list[str]:
    """The command that starts a joined replica with this fault from round ``start`` on."""
    return [sys.executable, str(Path(__file__).resolve()), str(start)]


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"]:
        sys.exit(f"usage: {sys.argv[0]} ROUND join [FLAGS]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_join(join_plan(sys.argv[3:]), lambda line: print(line, flush=True), stop_after_secret_close(int(sys.argv[1])))
