"""NoLoCo's pure core (hlbp.peer.rounds.noloco): the seeded pairs, the outer step, sparse payloads, hostile
messages."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.rounds.noloco import (
    NoLoCoConfig,
    NoLoCoState,
    check_message,
    message,
    partners,
    spread,
    step,
)

PEERS = [f"peer{i:02d}" for i in range(9)]


def test_pairs_are_a_matching_every_peer_derives_alike_and_change_with_the_round() -> None:
    pairs = partners(PEERS, "run-seed", 4)
    assert set(pairs) == set(PEERS)
    assert sum(v is None for v in pairs.values()) == 1  # 9 peers: one sits out
    for p, q in pairs.items():
        if q is not None:
            assert pairs[q] == p and q != p
    assert partners(list(reversed(PEERS)), "run-seed", 4) == pairs  # the order peers are known in does not matter
    rounds = [partners(PEERS, "run-seed", r) for r in range(6)]
    assert len({tuple(sorted((p, q or "") for p, q in x.items())) for x in rounds}) > 1
    assert partners(PEERS, "another-run", 4) != pairs
    assert partners(PEERS[:4], "s", 0)[PEERS[0]] is not None  # an even count: everybody paired


def _replica(seed: int, shape: tuple[int, ...] = (64, 64)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(shape, generator=g), "b": torch.randn(shape[1], generator=g)}


def _near(phi: dict[str, torch.Tensor], seed: int, scale: float = 0.001) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in phi.items()}


def test_the_dense_step_is_the_update_rule_and_a_pair_ends_closer() -> None:
    cfg = NoLoCoConfig()
    phi_i = _replica(0)
    phi_j = _near(phi_i, 1)
    theta_i = {n: t + 0.01 * torch.ones_like(t) for n, t in phi_i.items()}
    theta_j = {n: t - 0.03 * torch.ones_like(t) for n, t in phi_j.items()}
    si, sj = NoLoCoState.start(phi_i), NoLoCoState.start(phi_j)
    mi, mj = message(si, theta_i, cfg), message(sj, theta_j, cfg)
    before = spread([si.phi, sj.phi])
    new_i, new_j = step(si, mi, mj, cfg), step(sj, mj, mi, cfg)
    for n in phi_i:
        d_bar = 0.5 * ((theta_i[n] - phi_i[n]) + (theta_j[n] - phi_j[n]))
        phi_bar = 0.5 * (phi_i[n] + phi_j[n])
        # m starts at 0: m = β·d̄ + γ·(φ̄ − φ_i), φ ← φ + m
        assert torch.allclose(new_i[n], phi_i[n] + 0.7 * d_bar + 0.7 * (phi_bar - phi_i[n]), atol=1e-6)
        assert torch.allclose(new_j[n], phi_j[n] + 0.7 * d_bar + 0.7 * (phi_bar - phi_j[n]), atol=1e-6)
    assert spread([new_i, new_j]) < 0.5 * before  # the pull brings them together
    assert si.bounded == sj.bounded == 0  # honest partners are within the bounds
    # momentum carries over: a second round with no progress still moves φ by α·m
    m_before = si.momentum["w"].clone()
    again = step(si, message(si, si.phi, cfg), None, cfg)
    assert torch.allclose(again["w"], new_i["w"] + 0.5 * m_before, atol=1e-6)


def test_alone_a_replica_follows_its_own_progress() -> None:
    cfg = NoLoCoConfig(momentum=0.0)
    phi = _replica(2)
    theta = {n: t + 0.1 for n, t in phi.items()}
    s = NoLoCoState.start(phi)
    out = step(s, message(s, theta, cfg), None, cfg)
    assert all(torch.allclose(out[n], phi[n] + 0.7 * 0.1, atol=1e-6) for n in phi)


def test_sparse_messages_carry_the_top_k_and_the_rest_waits_in_error_feedback() -> None:
    cfg = NoLoCoConfig(sparse=True, k=64)
    phi = _replica(3)
    g = torch.Generator().manual_seed(9)
    theta = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in phi.items()}
    s = NoLoCoState.start(phi)
    msg = message(s, theta, cfg)
    dense = message(NoLoCoState.start(phi), theta, NoLoCoConfig())
    assert msg.nbytes() * 20 < dense.nbytes()  # 2-bit values, 1.6 % of positions and their φ: far below 2 x fp32
    sent = msg.progress_dense("w")
    assert 0 < int((sent != 0).sum()) <= 64 * 64 * 64 // 4096 + 64
    # what was not sent is in the buffer, to within the 2-bit quantisation of what was
    d = theta["w"] - phi["w"]
    assert torch.allclose(s.ef["w"] + sent, d, atol=1e-6)
    # φ travels at exactly the positions of the progress
    idx = msg.progress["w"].flat_indices()
    assert torch.equal(msg.phi["w"], phi["w"].reshape(-1)[idx])


def test_sparse_pairs_pull_on_the_partners_positions_and_agree_on_the_mean_progress() -> None:
    cfg = NoLoCoConfig(sparse=True, k=64)
    phi_i = _replica(4)
    phi_j = _near(phi_i, 5)
    g = torch.Generator().manual_seed(1)
    theta_i = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in phi_i.items()}
    theta_j = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in phi_j.items()}
    si, sj = NoLoCoState.start(phi_i), NoLoCoState.start(phi_j)
    mi, mj = message(si, theta_i, cfg), message(sj, theta_j, cfg)
    new_i, new_j = step(si, mi, mj, cfg), step(sj, mj, mi, cfg)
    idx_j = mj.progress["w"].flat_indices()
    other = torch.ones(64 * 64, dtype=torch.bool)
    other[idx_j] = False
    other[mi.progress["w"].flat_indices()] = False
    moved_i = (new_i["w"] - phi_i["w"]).reshape(-1)
    assert torch.count_nonzero(moved_i[other]) == 0  # nothing moves where neither sent anything
    d_bar = 0.5 * (mi.progress_dense("w") + mj.progress_dense("w")).reshape(-1)
    pull = 0.5 * (phi_j["w"].reshape(-1)[idx_j] - phi_i["w"].reshape(-1)[idx_j])
    assert torch.allclose(moved_i[idx_j], 0.7 * d_bar[idx_j] + 0.7 * pull, atol=1e-6)
    # both sides move by the same mean progress where neither pulls (the positions only i sent)
    only_i = torch.zeros(64 * 64, dtype=torch.bool)
    only_i[mi.progress["w"].flat_indices()] = True
    only_i[idx_j] = False
    moved_j = (new_j["w"] - phi_j["w"]).reshape(-1)
    assert torch.allclose(moved_i[only_i], 0.7 * d_bar[only_i], atol=1e-6)
    assert spread([new_i, new_j]) < spread([phi_i, phi_j])
    assert not torch.equal(moved_j, moved_i)  # j pulled on i's positions instead


@pytest.mark.parametrize("sparse", [False, True])
def test_a_poisoned_partner_moves_us_no_further_than_the_bounds_allow(sparse: bool) -> None:
    """Finite, well-formed and 1000x too large: the progress and the pull it contributes are scaled down to a few
    times our own progress, per tensor."""
    cfg = NoLoCoConfig(sparse=sparse, momentum=0.0)
    phi = _replica(11)
    theta = _near(phi, 12, 0.01)
    honest_partner = NoLoCoState.start(_near(phi, 13))
    liar = NoLoCoState.start(_near(phi, 13))
    theta_partner = _near(honest_partner.phi, 14, 0.01)
    good = message(honest_partner, theta_partner, cfg)
    bad = message(liar, {n: t + 1000 * (t - phi[n]) for n, t in theta_partner.items()}, cfg)
    bad.phi = {n: 1000 * v for n, v in bad.phi.items()}
    s_good, s_bad = NoLoCoState.start(phi), NoLoCoState.start(phi)
    mine_good, mine_bad = message(s_good, theta, cfg), message(s_bad, theta, cfg)
    after_good, after_bad = step(s_good, mine_good, good, cfg), step(s_bad, mine_bad, bad, cfg)
    assert s_good.bounded == 0 and s_bad.bounded > 0
    for n in phi:
        own = float(mine_bad.progress_dense(n).norm())
        moved = float((after_bad[n] - phi[n]).norm())
        limit = (0.7 * (1 + cfg.progress_bound) + 0.7 * cfg.pull_bound) / 2 * own
        assert moved <= limit * 1.0001, (n, moved, limit)
        assert float((after_good[n] - phi[n]).norm()) < limit


@pytest.mark.parametrize("sparse", [False, True])
def test_a_hostile_message_is_refused_before_the_step(sparse: bool) -> None:
    cfg = NoLoCoConfig(sparse=sparse)
    phi = _replica(6)
    shapes = {n: tuple(t.shape) for n, t in phi.items()}
    good = message(NoLoCoState.start(phi), {n: t + 0.01 for n, t in phi.items()}, cfg)
    check_message(good, shapes, cfg)
    missing = type(good)({k: v for k, v in good.progress.items() if k != "b"}, good.phi)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        check_message(missing, shapes, cfg)
    bad_phi = type(good)(good.progress, {**good.phi, "w": good.phi["w"].clone().fill_(float("nan"))})
    with pytest.raises(ValueError):
        check_message(bad_phi, shapes, cfg)
    wrong_kind = message(NoLoCoState.start(phi), phi, NoLoCoConfig(sparse=not sparse))
    with pytest.raises(ValueError):
        check_message(wrong_kind, shapes, cfg)


def test_spread_is_zero_for_identical_replicas() -> None:
    a = _replica(7)
    assert spread([a, {n: t.clone() for n, t in a.items()}]) == 0.0
    assert spread([a]) == 0.0
    assert spread([a, _replica(8)]) > 0.5


@pytest.mark.parametrize("sparse", [False, True])
def test_messages_round_trip_through_the_wire_and_garbage_raises_one_error(sparse: bool) -> None:
    from hlbp.peer.rounds.noloco import message_from_bytes, message_to_bytes
    from hlbp.protocol import ProtocolError

    cfg = NoLoCoConfig(sparse=sparse)
    phi = _replica(10)
    shapes = {n: tuple(t.shape) for n, t in phi.items()}
    msg = message(NoLoCoState.start(phi), {n: t + 0.02 for n, t in phi.items()}, cfg)
    data = message_to_bytes(msg, cfg, "peer00", "run", 3)
    back = message_from_bytes(data, cfg, shapes, "run", 3)
    for n in shapes:
        assert torch.equal(back.progress_dense(n), msg.progress_dense(n))
        assert torch.equal(back.phi[n], msg.phi[n])
    if sparse:
        assert len(data) * 20 < len(message_to_bytes(message(NoLoCoState.start(phi), phi, NoLoCoConfig()),
                                                     NoLoCoConfig(), "peer00", "run", 3))
    for bad in (b"", data[:7], data[:-5], b"\xff" * 8 + data[8:], data[:8] + b"\x00" * 40):
        with pytest.raises(ProtocolError):
            message_from_bytes(bad, cfg, shapes, "run", 3)
    with pytest.raises(ProtocolError):
        message_from_bytes(data, cfg, shapes, "run", 4)  # another round's
