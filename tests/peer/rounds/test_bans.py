"""A round loop's bans (hlbp.peer.rounds.bans) kept across a restart: saved in the checkpoint with its strikes,
read back from a hostile file only when well-formed, and in force again for a peer that resumes its current state."""

from __future__ import annotations

from pathlib import Path

from hlbp.peer.rounds.bans import MAX_SAVED_BANS, RoundBans
from hlbp.peer.rounds.persist import Checkpoints


def _bans() -> RoundBans:
    bans = RoundBans()
    bans.ban(3, "garbage", "a table of 1e30")
    bans.ban(6, "garbage", "again")  # a second strike: 4 rounds
    bans.ban_by_guard(5, "poisoner", "the guard refused round 5")
    return bans


def test_bans_and_strikes_survive_the_checkpoint_record() -> None:
    bans = _bans()
    back = RoundBans()
    assert back.load_json(bans.to_json())
    assert back.until == bans.until == {"garbage": (11, 2), "poisoner": (8, 1)}
    assert back.banned("garbage", 10) and not back.banned("garbage", 11) and back.refused_by_all("poisoner", 7)
    back.ban(12, "garbage", "a third time")
    assert back.until["garbage"] == (21, 3)  # the strikes went on counting


def test_a_hostile_record_is_ignored_whole() -> None:
    good = _bans().to_json()
    hostile = [None, [], {"until": []}, {"until": {}}, {"until": {"p": [1]}, "by_guard": {}},
               {"until": {"p": [1, True]}, "by_guard": {}}, {"until": {"p": [-1, 1]}, "by_guard": {}},
               {"until": {"p" * 200: [1, 1]}, "by_guard": {}}, {"until": {"p": [1, 1]}, "by_guard": {"q": 1}},
               {"until": {"p": [1, 1]}, "by_guard": {"p": 2**40}},
               {"until": {f"p{i}": [1, 1] for i in range(MAX_SAVED_BANS + 1)}, "by_guard": {}}]
    for raw in hostile:
        bans = RoundBans()
        assert bans.load_json(good)
        assert not bans.load_json(raw), raw
        assert bans.until == {"garbage": (11, 2), "poisoner": (8, 1)}  # what it held stays


def test_a_resumed_replica_refuses_whom_it_banned_before_it_stopped(tmp_path: Path, tiny_replica) -> None:
    trainer, state = tiny_replica
    before = state()
    before.round, before.bans = 7, _bans()
    path = tmp_path / "rounds.safetensors"
    Checkpoints(path, 60.0, trainer, "bans-run").save(before)
    after = state()
    same = after.bans  # the parts that judge senders hold this object: it is filled, not replaced
    assert Checkpoints(path, 60.0, trainer, "bans-run").resume(after) and after.round == 7
    assert after.bans is same and same.banned("garbage", 7) and same.banned("poisoner", 7)


def test_a_pardon_lifts_the_last_ban_and_its_strike_only() -> None:
    bans = _bans()
    bans.pardon("garbage")
    assert not bans.banned("garbage", 7) and bans.until["garbage"] == (0, 1)
    bans.ban(8, "garbage", "once more")
    assert bans.until["garbage"] == (13, 2)  # its second strike again, not a third
    bans.pardon("poisoner")
    assert "poisoner" not in bans.until and not bans.refused_by_all("poisoner", 6)
    bans.pardon("nobody")  # never banned: nothing to lift
    assert "nobody" not in bans.until


def test_a_ban_for_undelivered_contributions_travels_marked_until_a_fault_replaces_it() -> None:
    bans = _bans()
    bans.miss(4, "silent")
    assert bans.travelling_missed(4) == ()  # one miss bans nobody
    bans.miss(6, "silent")
    assert bans.banned("silent", 7) and bans.travelling_missed(6) == ("silent",)
    assert dict(bans.travelling(6))["silent"] == 9 and bans.travelling_missed(9) == ()  # the mark ends with the ban
    back = RoundBans()
    assert back.load_json(bans.to_json()) and back.missed == {"silent"}  # kept across a restart
    assert not RoundBans().load_json({**bans.to_json(), "missed": ["nobody banned"]})
    assert RoundBans().load_json({k: v for k, v in bans.to_json().items() if k != "missed"})  # an older file
    back.ban(7, "silent", "a table of 1e30")  # then it sent garbage: no longer a miss alone
    assert back.travelling_missed(7) == () and back.banned("silent", 7)
