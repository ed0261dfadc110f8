"""How long a peer waits for the other members' checksums after a round (the verification step).

A member that left or died after its contribution was accepted never publishes its checksums; waiting the whole
``checks_wait_s`` for it cost every survivor that long (rounds of 12 s instead of 2.5 s under chaos). The wait
ends instead as soon as :func:`hlbp.peer.rounds.rules.checks_settled` says the verdict is in: every member still
announced online has published (or has already published a later round's: a peer's record holds only its latest
round, so a verifier a round behind, a straggler under overlap, would otherwise wait out the window for records
that are gone), or the records seen form a per-shard majority the others cannot overturn.
The announcements come from the same DHT poll as the checksums (one round trip for both); the members also push
their checksums to each other (:mod:`hlbp.peer.rounds.inbox`), so the wait usually ends without a DHT read.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import checks_settled
from hlbp.protocol import ProtocolError
from hlbp.protocol.records import decode_announcement, peers_key
from hlbp.protocol.roundrecords import ShardChecks, checks_key, parse_checks


def online_members(entries: Mapping[Any, Any], run_id: str, now: float, me: str,
                   members: AbstractSet[str]) -> set[str] | None:
    """The ``members`` whose signed announcement of ``run_id`` says online, from raw DHT entries; None when the
    read tells nothing (our own announcement missing: a failed read, or a runner without announcements), so a
    lost lookup never reads as "everybody left"."""
    online: set[str] = set()
    for subkey, value in entries.items():
        if not isinstance(subkey, str) or (subkey != me and subkey not in members):
            continue
        try:
            record = decode_announcement(getattr(value, "value", value), now=now, signer=subkey, run_id=run_id)
        except ProtocolError:
            continue  # expired, forged or malformed: as good as absent
        if record.announcement.online:
            online.add(subkey)
    return online - {me} if me in online else None


def wait_for_checks(records: RoundRecords, r: int, members: Mapping[str, AbstractSet[int] | None],
                    mine: ShardChecks) -> list[ShardChecks]:
    """The round-r checksum records seen when the wait ended: settled, ``checks_wait_s`` passed, or stopping.
    ``records``: the round loop's records; ``members``: peer -> shards it contributed."""
    from hivemind.utils import get_dht_time

    cfg = records.cfg
    run = cfg.run_id
    deadline = time.monotonic() + cfg.checks_wait_s
    while True:
        raw_checks, raw_peers = records.poller.entries(checks_key(run), peers_key(run))
        latest = records.records(checks_key(run), parse_checks, raw_checks)
        checks = [c for c in latest if c.round == r]
        moved_on = {c.peer for c in latest if c.round > r}  # their round-r records are gone: none will come
        online = online_members(raw_peers, run, get_dht_time(), records.me, set(members))
        if (checks_settled(checks, mine, members, online, moved_on) or time.monotonic() >= deadline
                or records.stop.is_set()):
            return checks
        records.inbox.wait(cfg.poll_s)  # wakes at once for a pushed record or a finished DHT read
