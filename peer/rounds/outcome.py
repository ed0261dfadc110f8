"""What applying a round's accepted set came to, as a typed value: callers branch on the type, never on text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Applied:
    """The accepted set is applied: the anchor (and the outer optimizers' state) moved."""


@dataclass(frozen=True)
class Refused:
    """The round broke a bound of :mod:`hlbp.peer.rounds.guard`, or an accepted payload does not decode. Every
    in-sync peer holds the same bytes and anchor, so every one refuses alike, bans the same ``offenders`` (sender
    -> why) and keeps its parameters."""

    why: str
    offenders: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"refused: {self.why}"


@dataclass(frozen=True)
class Failed:
    """An accepted payload could not be had: this peer alone is out of sync, and resyncs."""

    error: str


RoundOutcome = Union[Applied, Refused, Failed]  # noqa: UP007 - a runtime alias, valid on every supported Python
