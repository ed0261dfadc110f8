"""The dense (DiLoCo over hivemind) round runner's pure parts: group keys, byte counts, gathered metadata, and
agreement by fingerprint, which must tell float rounding apart from a missed round."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.rounds.diloco import dense_allreduce_bytes, parse_gathered, round_group_bits
from hlbp.peer.rounds.rules import fingerprint_cluster, fingerprints_agree
from hlbp.peer.rounds.statesync import shard_fingerprint
from hlbp.peer.sim.launcher import states_agree
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import Identity
from hlbp.protocol.manifest import Hyperparameters
from hlbp.protocol.roundwire import KIND_CHECKS, ShardChecks, parse_checks, sign

D = "ab" * 32


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 128, generator=g) * 0.02, "norm": torch.ones(128)}


def test_group_bits_name_the_round_and_wrap() -> None:
    assert round_group_bits(0) == "0" * 16
    assert round_group_bits(5) == "0" * 13 + "101"
    assert round_group_bits(5 + (1 << 16)) == round_group_bits(5)
    assert round_group_bits(6) != round_group_bits(5)


def test_allreduce_bytes_follow_butterfly() -> None:
    assert dense_allreduce_bytes(1000, 1) == 0
    assert dense_allreduce_bytes(1000, 2) == 4000  # 2 * 1/2 * 4 B * 1000
    assert dense_allreduce_bytes(1000, 4) == 6000  # 2 * 3/4 * 4 B * 1000


def test_gathered_metadata_is_checked() -> None:
    good = {"p1": {"round": 3, "ready": 10.5, "tokens": 7}, "p2": {"round": 3, "ready": 11.0, "tokens": 7}}
    assert set(parse_gathered(good, 3)) == {"p1", "p2"}
    for bad in ({}, None, {"p1": {"round": 2, "ready": 1.0}}, {"p1": {"round": 3, "ready": "x"}},
                {"p1": {"round": 3, "ready": float("nan")}}, {"p1": [3]}):
        with pytest.raises(ValueError):
            parse_gathered(bad, 3)


def test_fingerprint_ignores_ulps_and_catches_a_missed_step() -> None:
    p = _params()
    base = shard_fingerprint(p, ["w", "norm"])
    ulp = {k: torch.nextafter(v, torch.full_like(v, 1e9)) if k == "w" else v for k, v in p.items()}
    assert fingerprints_agree(base, shard_fingerprint(ulp, ["w", "norm"]))
    # an outer step of relative size 1e-3 that one replica did not take
    step = {k: v - 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
            for k, v in p.items()}
    assert not fingerprints_agree(base, shard_fingerprint(step, ["w", "norm"]))
    assert shard_fingerprint(p, ["w", "norm"]) == base  # deterministic, cached sign pattern


def test_cluster_is_the_largest_agreeing_set() -> None:
    same, other = (1.0, 10.0), (1.5, 10.0)
    checks = [ShardChecks(f"peer{i}", 4, {0: D}, {0: fp}) for i, fp in enumerate([other, same, same, same])]
    checks.append(ShardChecks("peer9", 3, {0: D}, {0: other}))  # an older round does not vote
    assert [c.peer for c in fingerprint_cluster(checks, 4)] == ["peer1", "peer2", "peer3"]
    assert fingerprint_cluster(checks, 5) == []
    tie = [ShardChecks("b", 1, {0: D}, {0: same}), ShardChecks("a", 1, {0: D}, {0: other})]
    assert [c.peer for c in fingerprint_cluster(tie, 1)] == ["a"]  # ties: the smallest peer id, on every peer


def test_fingerprints_travel_signed_and_bad_ones_are_refused() -> None:
    me = Identity.generate()
    c = ShardChecks(me.peer_id, 2, {0: D, 1: D}, {0: (0.25, 3.0), 1: (-1.0, 2.0)})
    assert parse_checks(sign(KIND_CHECKS, c.to_body("run"), me), me.peer_id, "run") == c
    plain = ShardChecks(me.peer_id, 2, {0: D})
    assert parse_checks(sign(KIND_CHECKS, plain.to_body("run"), me), me.peer_id, "run").fingerprints == {}
    for bad in ({"0": [1.0]}, {"0": [float("inf"), 1.0]}, {"0": [1.0, -1.0]}, {"5": [1.0, 1.0]}, {"0": ["a", 1.0]},
                [1.0, 2.0]):
        body = {**plain.to_body("run"), "fingerprints": bad}
        with pytest.raises(ProtocolError):
            parse_checks(sign(KIND_CHECKS, body, me), me.peer_id, "run")


def test_states_agree_accepts_fp_rounding_only() -> None:
    def rec(sums: str, fp: tuple[float, float]) -> dict:
        return {"in_sync": True, "checksums": {"0": sums}, "fingerprints": {"0": list(fp)}}

    assert states_agree([rec("a", (1.0, 5.0)), rec("b", (1.0 + 1e-9, 5.0))])
    assert not states_agree([rec("a", (1.0, 5.0)), rec("b", (1.1, 5.0))])
    assert not states_agree([{"in_sync": True, "checksums": {"0": "a"}}, {"in_sync": True, "checksums": {"0": "b"}}])


def test_manifest_names_the_outer_optimizer() -> None:
    assert Hyperparameters.from_body({}).outer == "sparseloco"
    hp = Hyperparameters.from_body({"outer": "diloco", "outer_lr": 0.5, "momentum": 0.8})
    assert (hp.outer, hp.outer_lr, hp.momentum) == ("diloco", 0.5, 0.8)
    for bad in ({"outer": "adam"}, {"outer": 3}, {"outer_lr": 0.0}, {"momentum": 1.0}):
        with pytest.raises(ProtocolError):
            Hyperparameters.from_body(bad)
