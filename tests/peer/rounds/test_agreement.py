"""Agreement after a round, as pure decisions over checksum records: exact majorities and fingerprint clusters."""

from __future__ import annotations

import torch

from hlbp.peer.rounds.agreement import ExactAgreement, FingerprintAgreement
from hlbp.protocol.roundwire import ShardChecks

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_exact_agreement_names_the_donors_of_each_held_shard() -> None:
    checks = [ShardChecks("p1", 4, {0: A, 1: B}), ShardChecks("p2", 4, {0: A, 1: B}), ShardChecks("p3", 4, {0: C}),
              ShardChecks("old", 3, {0: C, 1: C})]
    donors, expect = ExactAgreement().agreed(checks, 4, [0, 1], 2)
    assert donors == ["p1", "p2"] and expect == {"p1": {0: A, 1: B}, "p2": {0: A, 1: B}}
    assert ExactAgreement().agreed(checks, 5, [0], 2) is None  # nobody published round 5
    assert ExactAgreement().agrees(checks, ShardChecks("me", 4, {0: A}))
    assert not ExactAgreement().agrees(checks, ShardChecks("me", 4, {0: C, 1: B}))
    assert ExactAgreement().fingerprints({"w": torch.ones(2)}, [["w"]]) == {}


def test_fingerprint_agreement_tolerates_rounding_and_needs_every_shard() -> None:
    params = {"w": torch.linspace(-1, 1, 64), "v": torch.linspace(0, 2, 16)}
    shards = [["w"], ["v"]]
    agreement = FingerprintAgreement()
    mine = agreement.fingerprints(params, shards)
    close = agreement.fingerprints({n: t + 1e-9 for n, t in params.items()}, shards)
    far = agreement.fingerprints({n: 2 * t for n, t in params.items()}, shards)
    odd = agreement.fingerprints({n: 3 * t for n, t in params.items()}, shards)
    checks = [ShardChecks("p1", 2, {0: A, 1: A}, close), ShardChecks("p2", 2, {0: B, 1: B}, close),
              ShardChecks("odd", 2, {0: C, 1: C}, odd)]
    assert agreement.agrees(checks, ShardChecks("me", 2, {0: A, 1: A}, mine))
    assert not agreement.agrees(checks, ShardChecks("me", 2, {0: A, 1: A}, far))
    donors, _ = agreement.agreed(checks, 2, [0, 1], 2)
    assert sorted(donors) == ["p1", "p2"]
    assert agreement.agreed(checks, 2, [0, 1], 3) is None  # a partial holder is no donor of the whole model
