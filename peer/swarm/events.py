"""What reaches a swarm's driver, as typed events: decoded once, where a message arrives, so the driver's step
loop dispatches on types and never on op strings or reason text.

A stage peer answers the driver with ``bwd``, ``loss``, ``gloss``, ``done``, ``fail`` and ``pong`` (upstream ops,
:data:`hlbp.protocol.stagewire.UPSTREAM`); any other op sent to the driver is :class:`UnexpectedMessage`, a
:class:`ProtocolError` that bans its sender. A stream that closes and a peer whose bytes did not decode are
events too, so the step loop learns of them in order with the answers. The :class:`EventQueue` holds them in arrival
order.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import Reason, StageMessage


class UnexpectedMessage(ProtocolError):
    """A stage peer sent the driver an op that only travels towards the last stage."""


@dataclass(frozen=True)
class Answer:
    """A message from a stage peer of this driver's chain: ``conn`` is the stream it came on."""

    conn: Any
    msg: StageMessage

    def belongs_to(self, session: int, step: int) -> bool:
        """Whether it answers this session's step (a late answer to an older step or session does not)."""
        return self.msg.session == session and self.msg.step == step


@dataclass(frozen=True)
class Backward(Answer):
    """``bwd``: the gradient of one micro-batch's activations (``body``, an activation-gradient frame)."""

    body: bytes


@dataclass(frozen=True)
class Loss(Answer):
    """``loss``: one validation micro-batch's loss at the last stage."""


@dataclass(frozen=True)
class GuardLoss(Answer):
    """``gloss``: the guard batch's loss at the last stage, through the chain's candidates of ``msg.round``."""


@dataclass(frozen=True)
class Done(Answer):
    """``done``: the last stage's clipping factor; every stage of the chain has queued its step."""


@dataclass(frozen=True)
class FailReport(Answer):
    """``fail``: a stage names the ``peer`` that failed (itself or one it could not reach), and why (``code``)."""

    peer: str
    code: Reason


@dataclass(frozen=True)
class Pong(Answer):
    """``pong``: the peer is alive; ``exchanging`` says its round gate is closed (its next step would wait)."""

    exchanging: bool


@dataclass(frozen=True)
class StreamClosed:
    """The stream to (or from) ``conn.peer`` closed."""

    conn: Any


@dataclass(frozen=True)
class BadPeer:
    """``peer`` sent bytes that did not decode (or an op the driver refuses): it is banned."""

    peer: str
    error: str


Event = Backward | Loss | GuardLoss | Done | FailReport | Pong | StreamClosed | BadPeer


def decode_answer(conn: Any, msg: StageMessage, body: bytes) -> Answer:
    """The typed event of a checked message that came to the driver on ``conn``; raises
    :class:`UnexpectedMessage` for an op a stage never sends upstream."""
    if msg.op == "bwd":
        return Backward(conn, msg, body)
    if msg.op == "loss":
        return Loss(conn, msg)
    if msg.op == "gloss":
        return GuardLoss(conn, msg)
    if msg.op == "done":
        return Done(conn, msg)
    if msg.op == "fail":
        return FailReport(conn, msg, peer=msg.peer or conn.peer, code=msg.code)
    if msg.op == "pong":
        return Pong(conn, msg, exchanging=msg.code == Reason.ROUND)
    raise UnexpectedMessage(f"a {msg.op} message sent to the driver")


class EventQueue:
    """The driver's events in arrival order: the links' loop thread puts them, the driver's thread takes them."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Event] = queue.Queue()

    def put(self, event: Event) -> None:
        self._queue.put(event)

    def get(self, timeout: float) -> Event | None:
        """The next event, or None if none arrives within ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def pongs(self, count: int, timeout: float) -> tuple[set[str], set[str]]:
        """Wait up to ``timeout`` seconds for ``count`` pongs: (the peers that answered, those of them that said
        they are exchanging a round). Every other event that arrives meanwhile is queued again, in order."""
        answered: set[str] = set()
        exchanging: set[str] = set()
        deadline = time.monotonic() + timeout
        requeue: list[Event] = []
        while time.monotonic() < deadline and len(answered) < count:
            event = self.get(timeout=max(0.01, deadline - time.monotonic()))
            if event is None:
                break
            if isinstance(event, Pong):
                answered.add(event.conn.peer)
                if event.exchanging:
                    exchanging.add(event.conn.peer)
            else:
                requeue.append(event)
        for event in requeue:
            self.put(event)
        return answered, exchanging
