"""The mutable state of a replica's rounds, apart from the parts that read and change it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.gather import GatherRule, Standing
from hlbp.peer.rounds.outer import OuterOptimizer


@dataclass
class LearnedWindow:
    """The collection window this peer has adapted to the run's arrivals (:func:`~hlbp.peer.rounds.rules.adapt_window`,
    ``widen_for_late``), in seconds; None until it learns one, when the manifest's first window holds.

    Kept in checkpoints: a peer that resumed with the first window (often twice the adapted one) waited longer than
    the other coordinators for the same round and could publish a different accepted set (docs/limitations.md).
    Read back from a file it is only a hint: anything but a finite positive number is dropped, and the closer keeps
    it within the manifest's bounds."""

    seconds: float | None = None

    def to_json(self) -> float | None:
        return self.seconds

    def load_json(self, raw: Any) -> None:
        """Take a saved value in place (the closer holds this object), or forget it when it is not a usable one."""
        ok = isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw) and raw > 0
        self.seconds = float(raw) if ok else None


@dataclass
class ReplicaState:
    """What a replica's rounds change: the anchor θ(r) (the global parameters every in-sync replica agrees on,
    the result of round ``round - 1``), one outer optimizer per held (or followed) shard, the next round to run,
    whether our state is the agreed one, and the guard batch's losses after the last committed rounds.

    One thread owns it at a time: without overlap the round loop's; under overlap the exchange thread changes the
    anchor and outer optimizers of the round in flight while the main thread reads snapshots of the anchor
    (:class:`~hlbp.peer.rounds.anchor.Anchor`: tensors are replaced one parameter at a time, never changed in
    place, and a snapshot reads its version back). Checkpoints and state sync read and replace it as a whole
    (``persist.py``, the loop's ``sync``). Given as a plain mapping, the anchor is made an :class:`Anchor`."""

    anchor: Anchor
    outers: dict[int, OuterOptimizer]
    round: int = 0
    in_sync: bool = True
    # the guard-batch losses of the last committed rounds, oldest first (empty after a start or a sync: then only
    # finiteness counts); the loss guard measures jumps and slow climbs against them
    guard_losses: list[float] = field(default_factory=list)
    # the signed records that show who the members of round ``round - 1`` were (its accepted set and its
    # coordinator's notice: key -> signer -> signed bytes). A checkpoint keeps them and a restart stores them again:
    # a swarm that stopped together took them out of the DHT with it, and only members' checksums vote on a state
    evidence: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # who was selected when, as the accepted sets taken show (rounds/gather.py): the gather rule's input, kept in
    # checkpoints so that a peer resuming its current state checks and coordinates capped rounds at once
    standing: Standing = field(default_factory=lambda: Standing(GatherRule().memory))
    # whom this peer refuses, and until which round (rounds/bans.py): its own verdicts, shared by the parts that
    # judge senders and kept in checkpoints, so that a peer resuming its current state refuses them still
    bans: RoundBans = field(default_factory=RoundBans)
    # the collection window learned from the run's arrivals, kept in checkpoints: a resumed peer waits as long as
    # the peers it rejoins do
    window: LearnedWindow = field(default_factory=LearnedWindow)

    def __post_init__(self) -> None:
        if not isinstance(self.anchor, Anchor):
            self.anchor = Anchor(self.anchor)


class StartKind(Enum):
    """How a round loop came to the state it starts from."""

    RESUMED = "resumed from checkpoint"  # nobody else published a state to compare with
    CURRENT = "resumed from checkpoint (current)"  # our checkpoint is the agreed state of the latest round
    SYNCED = "synced"  # loaded the agreed state from peers
    FRESH = "fresh start"  # no checkpoint, nobody else published a state
    FRESH_UNAGREED = "fresh start (no agreed state to sync)"  # others published states, none agreed or fetchable


@dataclass(frozen=True)
class Start:
    """What :meth:`hlbp.peer.rounds.loop.ReplicaBase.start` did (``round``: the state's round when synced)."""

    kind: StartKind
    round: int = -1

    @property
    def fresh(self) -> bool:
        """Whether the loop starts from the seed's parameters (a replica may then wait for the others)."""
        return self.kind in (StartKind.FRESH, StartKind.FRESH_UNAGREED)

    def __str__(self) -> str:
        return f"synced round {self.round} from peers" if self.kind is StartKind.SYNCED else self.kind.value
