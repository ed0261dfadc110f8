"""The contributions of a round as bytes: fetch them, check them against their signed digests, decode and bound
them, and prefetch them while the round is still open.

One :class:`Payloads` per round loop owns what it has already checked (so the apply never fetches a payload twice),
the prefetches under way and the senders whose payloads could not be had this round. It decides nothing about who
is accepted or banned: it returns failures as values (:class:`BadPayload` when the sender is to blame, the
transport's :class:`TransportError` when the bytes could not be had) and the caller judges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from hlbp.peer.net.pace import MIN_FETCH_RATE, body_due
from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds import guard
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.peer.rounds.spread import TRIES
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import sha256_hex
from hlbp.protocol.roundwire import ContribNotice

SENDER_TRIES = 2  # a payload is fetched from its sender twice before it counts as unreachable: one transfer is no verdict
FETCH_SLACK_S = 5.0  # what a fetch may run past its timeout and pace before the transport's backstop ends it
PARENT_WAIT_S = 1.0  # how long a peer whose parent in a fetch tree lacks a payload waits before asking it again


def prefetch_due(start: float, sizes: Iterable[int], timeout: float, min_rate: float) -> float:
    """When a prefetch begun at ``start`` of payloads of ``sizes`` bytes (one per shard, fetched one after another
    from their sender) may still be under way: each is tried :data:`SENDER_TRIES` times, each try due by the fetch's
    timeout and then the body's pace (:func:`hlbp.peer.net.pace.body_due`), plus the backstop's slack. Past it,
    a waiter gives up on the prefetch and fetches the payload itself."""
    return start + sum(SENDER_TRIES * (body_due(0.0, timeout, size, min_rate) + FETCH_SLACK_S) for size in sizes)


class BadPayload(ProtocolError):
    """An accepted or candidate payload whose bytes match the sender's signed digest but that does not decode, or
    that breaks a bound: the sender's fault, and the same verdict on every peer that holds those bytes."""


def error_text(exc: BaseException) -> str:
    """An error's whole message for the log (hostile text is bounded, but never cut mid-explanation)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + "…"


def payload_name(r: int, shard: int, sender: str) -> str:
    """The name a contribution's payload is served under on the blob transport."""
    return f"c/{r}/{shard}/{sender}"


class PayloadEncoder:
    """Our own contributions as payload bytes: what the round loop serves and announces (digest and size) for each
    shard. ``limits``: the receivers' cap per shard. A fault test wraps this part to serve lies."""

    def __init__(self, outer_cfg: OuterConfig, run_id: str, limits: Sequence[int]) -> None:
        self.outer_cfg, self.run_id, self.limits = outer_cfg, run_id, limits

    def encode(self, r: int, s: int, c: Contribution) -> bytes:
        """The payload of our contribution ``c`` to shard ``s`` of round ``r``."""
        return contribution_to_bytes(c, self.outer_cfg, self.run_id, r, s)


class Payloads:
    """Fetch, check and decode the payloads of a round loop (see the module docstring).

    ``limits``: the largest payload per shard; ``applied``: the shards whose contributions this peer applies (and
    so prefetches); ``banned(sender, r)``: whom not to prefetch; ``on_received(n)``: counts bytes fetched.
    """

    def __init__(self, me: str, transport: Any, cfg: RoundConfig, outer_cfg: OuterConfig,
                 shapes: Sequence[Mapping[str, tuple[int, ...]]], limits: Sequence[int], applied: Sequence[int],
                 banned: Callable[[str, int], bool], on_received: Callable[[int], None], stop: Any) -> None:
        self.me, self.transport, self.cfg, self.outer_cfg = me, transport, cfg, outer_cfg
        self.shapes, self.limits, self.applied = shapes, limits, applied
        self.banned, self.on_received, self.stop = banned, on_received, stop
        self.guard = cfg.guard
        self.scales: dict[int, float] = {}  # ‖θ_s‖ of the round's anchor per applied shard (set as its exchange starts)
        # (round, sender, shard, digest) -> checked payload; the digest too: a prefetch saw the sender's notice, the
        # apply takes the accepted set's digest, and an equivocating sender could make the two differ
        self._verified: dict[tuple[int, str, int, str], Contribution] = {}
        self._unreachable: set[tuple[int, str]] = set()  # (round, sender) whose payload could not be fetched
        self._count_lock = threading.Lock()
        self._prefetcher: ThreadPoolExecutor | None = None  # background fetches of notices' payloads (prefetch)
        # (round, sender) -> its prefetch, and when a waiter gives up on it (prefetch_due)
        self._prefetches: dict[tuple[int, str], tuple[Future[Exception | None], float]] = {}

    def measure_scales(self, anchor: Mapping[str, torch.Tensor], shards: Sequence[Sequence[str]]) -> None:
        """‖θ_s‖ of the round's anchor for every shard we apply: the guard's bounds are relative to it."""
        self.scales = {s: guard.scale(anchor, shards[s]) for s in self.applied}

    def check(self, r: int, sender: str, digests: Mapping[int, str]) -> Exception | None:
        """Fetch, decode and bound ``sender``'s payloads for the shards in ``digests`` not yet checked; each good
        one is kept for the apply. Returns the first failure (not raised: the caller decides)."""
        try:
            for s, digest in digests.items():
                if (r, sender, s, digest) not in self._verified:
                    c = self.decode(r, s, sender, digest, [])
                    # a shard this peer does not hold has no anchor here to bound it by: its holders do that
                    over = guard.oversized({sender: guard.contribution_norm(c)}, self.scales[s], self.guard) \
                        if s in self.scales else {}
                    if over:
                        raise BadPayload(f"shard {s}'s contribution norm is {over[sender]:.3g}x the shard's "
                                         f"parameter norm (bound {self.guard.max_contribution_ratio:g}x)")
                    self._verified[(r, sender, s, digest)] = c
        except (TransportError, ProtocolError) as exc:
            return exc
        return None

    def prefetch(self, r: int, notices: Mapping[str, ContribNotice]) -> None:
        """Start fetching and checking, in the background, the payloads of the round's notices seen so far (the
        shards we apply), so that applying the accepted set waits on no transfer. Only while the round is small
        (``prefetch_up_to``); a failure here only means the apply fetches it again (and judges it then)."""
        if len(notices) > self.cfg.prefetch_up_to or self.stop.is_set():
            return
        for sender, notice in notices.items():
            digests = {s: d for s, d in notice.digests.items() if s in self.applied}
            if (sender == self.me or (r, sender) in self._prefetches or self.banned(sender, r) or not digests
                    or any(s >= len(self.limits) or notice.sizes.get(s, 0) > self.limits[s] for s in digests)):
                continue
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(self.cfg.fetch_workers, thread_name_prefix="hlbp-prefetch")
            due = prefetch_due(time.monotonic(), [notice.sizes.get(s, self.limits[s]) for s in digests],
                               self.cfg.fetch_timeout_s, MIN_FETCH_RATE)
            self._prefetches[(r, sender)] = (self._prefetcher.submit(self.check, r, sender, digests), due)

    def await_prefetch(self, r: int, sender: str) -> None:
        """Let a prefetch of ``sender``'s round-r payloads under way finish, instead of fetching them twice."""
        pending = self._prefetches.get((r, sender))
        if pending is not None:  # it returns its failure: the caller judges
            future, due = pending
            wait_futures([future], timeout=max(0.0, due - time.monotonic()))

    def take(self, r: int, sender: str, s: int, digest: str) -> Contribution | None:
        """The checked payload of ``sender`` for shard ``s`` under ``digest``, handed over once (None: not held)."""
        return self._verified.pop((r, sender, s, digest), None)

    def checked(self, r: int) -> Iterator[tuple[str, int, Contribution]]:
        """(sender, shard, contribution) of every round-r payload checked so far (a snapshot: safe beside the
        threads that add to it)."""
        for (rr, sender, s, _digest), c in list(self._verified.items()):
            if rr == r:
                yield sender, s, c

    def outliers(self, r: int, senders: AbstractSet[str]) -> dict[str, str]:
        """Of ``senders``, whose checked round-r contribution to some shard is far above the others'
        (:func:`hlbp.peer.rounds.guard.outliers`), with why: the coordinator leaves them out."""
        norms: dict[int, dict[str, float]] = {}
        for sender, s, c in self.checked(r):
            if sender in senders:
                norms.setdefault(s, {})[sender] = guard.contribution_norm(c)
        out: dict[str, str] = {}
        for s, shard_norms in sorted(norms.items()):
            for sender, ratio in guard.outliers(shard_norms, self.guard).items():
                out.setdefault(sender, f"shard {s}'s contribution norm is {ratio:.3g}x the round's median "
                                       f"(bound {self.guard.max_vs_median:g}x)")
        return out

    def mark_unreachable(self, r: int, sender: str) -> None:
        """``sender``'s round-r payload could not be had: not retried this round."""
        self._unreachable.add((r, sender))

    def unreachable(self, r: int, sender: str) -> bool:
        return (r, sender) in self._unreachable

    def forget_through(self, r: int) -> None:
        """Drop what was kept of rounds up to r, and stop serving our payloads of round r - 2."""
        self.transport.drop_prefix(f"c/{r - 2}/")
        self._verified = {k: v for k, v in self._verified.items() if k[0] > r}
        self._prefetches = {k: v for k, v in self._prefetches.items() if k[0] > r}
        self._unreachable = {k for k in self._unreachable if k[0] > r}

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)

    def own(self, r: int, s: int) -> bytes | None:
        """Our own served payload of round r, shard s."""
        return self.transport.get(payload_name(r, s, self.me))

    def decode(self, r: int, s: int, sender: str, digest: str, sources: Sequence[str] = (),
               coordinator: str = "") -> Contribution:
        """One shard payload, fetched (or our own), digest-checked and decoded. ``sources``: whom to ask first, in
        order (our chain in the payload's fetch tree, :func:`hlbp.peer.rounds.spread.sources`)."""
        if sender == self.me:
            blob = self.own(r, s)
            if blob is None or sha256_hex(blob) != digest:
                raise TransportError("our own contribution is gone or differs from the accepted digest")
        else:
            blob = self._fetch(r, s, sender, digest, sources, coordinator)
        try:
            c = contribution_from_bytes(blob, self.outer_cfg, self.shapes[s], run=self.cfg.run_id, round=r, shard=s,
                                        max_bytes=self.limits[s])
        except ProtocolError as exc:
            raise BadPayload(str(exc)) from None
        if c.sender != sender:
            raise BadPayload(f"payload claims sender {c.sender[:12]}…, accepted for {sender[:12]}…")
        return c

    def _fetch(self, r: int, shard: int, sender: str, digest: str, sources: Sequence[str],
               coordinator: str = "") -> bytes:
        """A payload from the first ``TRIES`` of ``sources`` in order, then the coordinator (it fetched every payload it accepted, so it
        still has a sender's that died right after announcing), then the sender itself. While we fetch, peers that
        ask us for it wait for our copy (peer/net/transport.py): our children in the fetch tree ask as soon as they
        have the accepted set, often before we hold it."""
        name = payload_name(r, shard, sender)
        tries = [p for p in dict.fromkeys([*sources[:TRIES], coordinator]) if p not in (sender, self.me, "")]
        errors: list[str] = []
        with self.transport.sharing(name):
            for i, peer in enumerate([*tries, *[sender] * SENDER_TRIES]):
                began = time.monotonic()
                blob = self._fetch_from(peer, name, shard, sender, digest, errors)
                if blob is None and i == 0 and peer != sender and time.monotonic() - began < PARENT_WAIT_S:
                    # our parent answered at once without it: it has not begun its own fetch yet (it took the
                    # accepted set after us). Ask it again shortly instead of sending the whole subtree up the tree
                    self.stop.wait(PARENT_WAIT_S)
                    blob = self._fetch_from(peer, name, shard, sender, digest, errors)
                if blob is not None:
                    with self._count_lock:  # fetches run in parallel threads
                        self.on_received(len(blob))
                    self.transport.put(name, blob)  # serve it onwards: our children in the tree fetch it from us
                    return blob
        raise TransportError(f"contribution of {sender[:12]}… for round {r} shard {shard}: " + "; ".join(errors))

    def _fetch_from(self, peer: str, name: str, shard: int, sender: str, digest: str, errors: list[str]) -> bytes | None:
        """One holder's copy of a payload if it matches ``digest``; otherwise None, with why added to ``errors``."""
        try:
            blob = self.transport.fetch(peer, name, self.limits[shard],
                                        self.cfg.fetch_timeout_s if peer == sender else self.cfg.fetch_timeout_s / 5)
        except TransportError as exc:
            errors.append(error_text(exc))
            return None
        except ProtocolError as exc:  # the response itself broke the protocol (a body above the limit)
            if peer == sender:
                raise ProtocolError(f"{sender[:12]}… served its contribution out of protocol: {exc}") from None
            errors.append(f"{peer[:12]}…: {error_text(exc)}")
            return None
        if sha256_hex(blob) != digest:
            errors.append(f"{peer[:12]}… served bytes that do not match the accepted digest")
            return None
        return blob
