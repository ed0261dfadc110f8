"""Signed round records in the DHT: store, read, parse and protect them, and the records peers push to us.

One :class:`RoundRecords` per round loop owns the inbox of pushed records, the two DHT pollers that read into it,
the set of live peers we push our own records to, and the DHT stores under way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from hlbp.peer.net.dht import DHT_DIED
from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.inbox import Both, DhtPoll, Inbox, found_entries, merge
from hlbp.protocol import ProtocolError
from hlbp.protocol.bundle import pack_bundles, parse_bundle
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_BUNDLE,
    KIND_CHECKS,
    KIND_CONTRIB,
    MAX_RECORD_BYTES,
    ShardChecks,
    checks_key,
    parse_checks,
    round_key,
    sign,
)

logger = logging.getLogger(__name__)


MAX_BUNDLERS = 1024  # peers a round's bundles are noted from (the committee has at most 32 seats)


def checks_name(r: int) -> str:
    """The transport name our checksum record of round r is served under (a committee's readers fetch it)."""
    return f"k/{r}"


def _newer(parse: Callable[..., Any], both: Both, signer: str, run_id: str, **kw: Any) -> Any:
    """The later-round one of a sender's stored and pushed records that parses (the stored one on a tie: the DHT
    is the record of truth); raises the pushed one's error when neither does."""
    good, error = [], None
    for value in (both.stored, both.pushed):
        try:
            good.append(parse(value, signer, run_id, **kw))
        except ProtocolError as exc:
            error = exc
    if not good:
        raise error or ProtocolError("no valid record")
    return max(good, key=lambda rec: getattr(rec, "round", -1))  # max keeps the first (stored) on a tie


class RoundRecords:
    """The signed round records of one round loop.

    ``current_round`` tells which round the loop is in (pushes of records near it are kept; peers seen in the
    last two rounds are pushed to). ``keep_store`` decides, per key, whether a record also goes to the DHT (a
    fault test's lost stores; production: always). ``protect`` registers round keys with our DHT node's record
    validator. A ``transport`` of None: a loop that only trains (tests of the inner phase).
    """

    def __init__(self, dht: Any, identity: Identity, transport: Any, cfg: RoundConfig, stop: Any,
                 current_round: Callable[[], int], protect: Callable[[dict[str, tuple[str, int]]], None] | None = None,
                 keep_store: Callable[[str], bool] = lambda key: True) -> None:
        self.dht, self.identity, self.transport, self.cfg, self.stop = dht, identity, transport, cfg, stop
        self.me = identity.peer_id
        self.current_round, self.protect_keys, self.keep_store = current_round, protect, keep_store
        self.inbox = Inbox(MAX_RECORD_BYTES)  # round records their signers pushed to us (rounds/inbox.py)
        self.inbox.wanted = self.wants
        self.poller = DhtPoll(dht, self.inbox, cfg.poll_s, cfg.dht_timeout_s, self.stuck)
        # the inner phase's own poller: its checks never block a step, and never cancel the reads of an exchange
        # running beside it (a DhtPoll keeps one read in flight, for one set of keys)
        self.phase_poller = DhtPoll(dht, self.inbox, cfg.poll_s, cfg.dht_timeout_s, self.stuck)
        self.live: dict[int, set[str]] = {}  # round -> peers seen in it: who we push our records to
        self._complete: dict[int, frozenset[str]] = {}  # round -> who passed on a complete part (take_bundle)
        self._bundled: dict[int, dict[str, float]] = {}  # round -> who passed records on to us, and when last
        self._live_lock = threading.Lock()
        self._stores: list[tuple[Any, str, float]] = []  # DHT stores under way (future, key, started)
        self._logged: set[tuple[str, str]] = set()
        self.pushes_in = self.pushes_out = self.reads = 0  # round records pushed to us, by us, and read here
        if transport is not None:
            transport.set_push_handler(self.on_push)

    def store(self, key: str, body: dict[str, Any], kind: str, to: AbstractSet[str] = frozenset(),
              only: AbstractSet[str] | None = None) -> bytes:
        """Sign and publish a round record: pushed at once to the live members (and ``to``; to ``only`` those,
        when given: a round with a committee), kept in our own inbox, and stored in the DHT (the record of truth,
        for whoever the push missed) without waiting for it. Returns the signed bytes."""
        from hivemind.utils import get_dht_time

        value = sign(kind, body, self.identity)
        self.inbox.offer(self.me, key, value)
        targets = set(only) if only is not None else self.pushed_to() | set(to)
        self.pushes_out += len(targets - {self.me})
        self.transport.push(targets, key, value)
        self._reap_stores()
        if not self.keep_store(key):
            return value
        future = self.dht.store(key, value, get_dht_time() + self.cfg.record_ttl_s, subkey=self.me,
                                return_future=True)
        self._stores.append((future, key, time.monotonic()))
        return value

    def pass_on(self, targets: AbstractSet[str], r: int, records: list[tuple[str, str, bytes]],
                complete: bool) -> None:
        """Push others' signed records of round r to ``targets`` as bundles (:mod:`hlbp.protocol.bundle`): a
        committee member's forward to the leads, or its relay of the accepted set."""
        targets = set(targets) - {self.me}
        if not targets:
            return
        key = round_key(self.cfg.run_id, r, KIND_BUNDLE)
        for body in pack_bundles(r, records, complete):
            self.pushes_out += len(targets)
            self.transport.push(targets, key, body)

    def restore(self, evidence: dict[str, dict[str, bytes]]) -> None:
        """Store others' signed records again as they signed them (a checkpoint's evidence of its round's members,
        after a restart): into our inbox and the DHT under their signers' subkeys. Nothing is trusted by this:
        every reader verifies each record's signature, as for any other."""
        from hivemind.utils import get_dht_time

        for key, by_signer in evidence.items():
            for signer, value in by_signer.items():
                self.inbox.offer(signer, key, value)
                future = self.dht.store(key, value, get_dht_time() + self.cfg.record_ttl_s, subkey=signer,
                                        return_future=True)
                self._stores.append((future, key, time.monotonic()))

    def _reap_stores(self) -> None:
        """Log the DHT stores that failed or outlasted ``dht_timeout_s``; forget the finished ones."""
        pending = []
        for future, key, started in self._stores:
            if future.done():
                try:
                    future.result(timeout=0)
                except Exception as exc:  # noqa: BLE001 - the pushes went out; the DHT copy is the fallback
                    logger.warning("a DHT store under %s failed: %s", key, exc)
            elif time.monotonic() - started > self.cfg.dht_timeout_s:
                self.stuck(f"store under {key}")
            else:
                pending.append((future, key, started))
        self._stores = pending

    def stuck(self, what: str) -> None:
        if not self.dht.is_alive():
            raise ConnectionError(DHT_DIED)
        logger.warning("a DHT %s took over %.0f s; going on without it", what, self.cfg.dht_timeout_s)

    def pushed_to(self) -> set[str]:
        """The peers we push round records to: those seen in the last two rounds, not us."""
        live = self.live  # replaced whole, never changed in place: safe beside an overlapped exchange's thread
        return set().union(*(peers for r, peers in live.items() if r >= self.current_round() - 2)) - {self.me}

    def seen(self, r: int, peers: Iterable[str]) -> None:
        """Note ``peers`` as live in round r (their notices arrived, or they pushed us their checksums). Called
        from the main, exchange and transport threads: the lock keeps one caller's peers from replacing another's."""
        peers = set(peers)
        with self._live_lock:
            if peers <= self.live.get(r, set()):
                return
            live = {k: set(v) for k, v in self.live.items() if k >= r - 2}
            live.setdefault(r, set()).update(peers)
            self.live = live

    def on_push(self, sender: str, key: str, body: bytes) -> None:
        """A record ``sender`` pushed to us (the transport authenticated who sent it): into the inbox. A peer that
        pushes us its checksums has just applied a round with us, and is live from then on, so our next records
        reach it by push. That is how a restarted or joining peer, which sits its first round out and so sends no
        notice in it, hears of the next round's notices at once instead of by polling the DHT (measured before:
        its catch-up phase then ran 1.4-2.3 s, longer than the others' whole phase, and its notice missed the
        window). A hostile pusher gains one push of each of our few records a round; the inbox bounds senders
        per key, and so how many peers this adds."""
        self.pushes_in += 1
        r = self._bundle_round(key)
        if r is not None:
            self.take_bundle(sender, r, body)
        elif self.inbox.offer(sender, key, body) and sender != self.me and key == checks_key(self.cfg.run_id):
            self.seen(self.current_round(), (sender,))

    def _bundle_round(self, key: str) -> int | None:
        prefix, suffix = f"hlbp:{self.cfg.run_id}:round:", f":{KIND_BUNDLE}"
        if key.startswith(prefix) and key.endswith(suffix) and key[len(prefix):-len(suffix)].isdigit():
            return int(key[len(prefix):-len(suffix)])
        return None

    def take_bundle(self, sender: str, r: int, body: bytes) -> None:
        """Others' records of round r that ``sender`` passed on: each into the inbox under its signer, parsed later
        like any record its signer pushed (a bundle vouches for nothing). A bundle that says its sender's part is
        complete is noted (:meth:`complete_parts`)."""
        now = self.current_round()
        if not now - 2 <= r <= now + 2:
            self.inbox.refused += 1
            return
        try:
            bundle = parse_bundle(body, r)
        except ProtocolError as exc:
            tag = ("bundle", sender)
            if tag not in self._logged:
                self._logged.add(tag)
                logger.warning("ignoring a malformed bundle from %s: %s", sender[:16], exc)
            return
        for kind, signer, value in bundle.records:
            self.inbox.offer(signer, round_key(self.cfg.run_id, r, kind), value)
        with self._live_lock:  # who sent one, bounded: only a round's committee members' bundles are looked at
            seen = {k: v for k, v in self._bundled.items() if k >= now - 2}
            if sender in seen.get(r, {}) or len(seen.get(r, {})) < MAX_BUNDLERS:
                seen[r] = {**seen.get(r, {}), sender: time.monotonic()}
                if bundle.complete:
                    done = {k: v for k, v in self._complete.items() if k >= now - 2}
                    done[r] = done.get(r, frozenset()) | {sender}
                    self._complete = done
            self._bundled = seen
        self.inbox.poke()

    def bundles_from(self, r: int) -> dict[str, float]:
        """Who passed records of round r on to us, and when last (``time.monotonic()``)."""
        return dict(self._bundled.get(r, {}))

    def complete_parts(self, r: int) -> frozenset[str]:
        """The committee members whose bundles of round r said their part of the notices is complete."""
        return self._complete.get(r, frozenset())

    def wants(self, key: str) -> bool:
        """Whether a pushed record under ``key`` is one we can use now: the checksums, or this run's notices
        and accepted sets of a round near ours."""
        run = self.cfg.run_id
        if key == checks_key(run):
            return True
        prefix = f"hlbp:{run}:round:"
        if not key.startswith(prefix):
            return False
        r, _, kind = key[len(prefix):].partition(":")
        now = self.current_round()
        return kind in (KIND_CONTRIB, KIND_ACCEPTED, KIND_BUNDLE) and r.isdigit() and now - 2 <= int(r) <= now + 2

    def _result(self, future: Any, what: str) -> Any:
        """A DHT call's result, or None (logged) if it outlasts ``dht_timeout_s``. A dead DHT process never
        answers: the wait checks every second that it runs, else raises ConnectionError (save and exit, not hang)."""
        deadline = time.monotonic() + self.cfg.dht_timeout_s
        while True:
            try:
                return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except TimeoutError:  # concurrent.futures.TimeoutError is the builtin since Python 3.11
                if not self.dht.is_alive():
                    raise ConnectionError(DHT_DIED) from None
                if self.stop.is_set():
                    return None  # leaving: SIGTERM must end the peer within seconds, whatever the DHT does
                if time.monotonic() >= deadline:
                    logger.warning("a DHT %s took over %.0f s; going on without it", what, self.cfg.dht_timeout_s)
                    return None

    def read(self, *keys: str) -> list[dict[str, Any]]:
        """The entries (subkey -> value) under each key, looked up side by side (a poll of two keys pays its round
        trips once). A lookup that outlasts ``dht_timeout_s`` reads as empty, like a record not there yet."""
        futures = [self.dht.get(key, latest=True, return_future=True) for key in keys]
        out = []
        for key, future in zip(keys, futures):
            found = found_entries(self._result(future, f"lookup of {key}"))
            self.reads += len(found)
            out.append(merge(found, self.inbox.entries(key)))
        return out

    def records(self, key: str, parse: Callable[..., Any], entries: dict[str, Any] | None = None,
                 **kw: Any) -> list[Any]:
        """The valid records under ``key`` (``entries``: already read), each bad one logged once and skipped."""
        out = []
        for subkey, value in (self.read(key)[0] if entries is None else entries).items():
            if not self.cfg.admits(str(subkey)):
                tag = ("outsider", str(subkey))
                if tag not in self._logged:
                    self._logged.add(tag)
                    logger.warning("ignoring round records of %s: it is not in the run's allow-list", str(subkey)[:16])
                continue
            try:
                out.append(_newer(parse, value, str(subkey), self.cfg.run_id, **kw) if isinstance(value, Both)
                           else parse(value, str(subkey), self.cfg.run_id, **kw))
            except ProtocolError as exc:
                tag = (key, str(subkey))
                if tag not in self._logged:  # log each bad record once, not at every poll
                    self._logged.add(tag)
                    logger.warning("ignoring a bad round record under %s from %s: %s", key, str(subkey)[:16], exc)
        return out

    def protect(self, r: int) -> None:
        """Have our DHT node refuse unsigned or mis-signed records under this round's keys, so a forgery with a
        later expiration cannot shadow a real record (hivemind keeps the latest-expiring value per subkey)."""
        if self.protect_keys is None:
            return
        run = self.cfg.run_id
        keys = {round_key(run, r, KIND_CONTRIB): (KIND_CONTRIB, MAX_RECORD_BYTES),
                round_key(run, r, KIND_ACCEPTED): (KIND_ACCEPTED, MAX_RECORD_BYTES),
                checks_key(run): (KIND_CHECKS, MAX_RECORD_BYTES)}
        try:
            self.protect_keys(keys)
        except Exception as exc:  # noqa: BLE001 - readers still verify every record; this is defence in depth
            logger.warning("could not register round %d keys with the DHT validator: %s", r, exc)

    def traffic(self) -> tuple[int, int]:
        """Round records received (pushed to us, and returned by every DHT read, repeats included) and pushed by
        us, since this loop started: what a round's control messages cost a peer, as ``hlbp bench scale`` counts
        them."""
        received = self.pushes_in + self.reads + self.poller.entries_read + self.phase_poller.entries_read
        return received, self.pushes_out

    def fetch_checks(self, peer: str, r: int, timeout: float) -> ShardChecks | None:
        """``peer``'s checksum record of round r, fetched from it (it serves it under :func:`checks_name`); None
        when it has none yet, cannot be reached, or serves anything but its own signed record of round r."""
        try:
            value = self.transport.fetch(peer, checks_name(r), MAX_RECORD_BYTES, timeout)
            self.reads += 1
            found = parse_checks(value, peer, self.cfg.run_id)
        except (TransportError, ProtocolError):
            return None
        return found if found.round == r else None

    def latest_checks(self) -> list[ShardChecks]:
        """Every admitted peer's latest checksum record (a peer's record holds only its latest round)."""
        return self.records(checks_key(self.cfg.run_id), parse_checks)
