"""Outer optimizers: the error-feedback identity, aggregation modes, withdrawal, DiLoCo's Nesterov step."""

import pytest
import torch

from hlbp.peer.rounds.outer import DiLoCo, OuterConfig, SparseLoCo, make_outer, move_mass
from hlbp.protocol.sparse import compress, decompress


def _params(seed, shapes=None):
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"w": (128, 192), "b": (300,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_error_feedback_identity_over_rounds():
    opt = SparseLoCo(OuterConfig(k=64, beta=0.95))
    anchor = _params(0)
    e_old = {n: torch.zeros_like(t) for n, t in anchor.items()}
    for r in range(3):
        local = {n: t - 0.01 * torch.randn_like(t) for n, t in anchor.items()}
        delta = {n: anchor[n] - local[n] for n in anchor}
        c = opt.contribute(anchor, local)
        for n in anchor:
            sent = decompress(c.tensors[n])
            # e_new + Δ̂ = β·e_old + Δ: nothing is lost, the quantisation residual stays in e
            torch.testing.assert_close(opt.ef[n] + sent, 0.95 * e_old[n] + delta[n], atol=1e-6, rtol=0)
            e_old[n] = opt.ef[n].clone()


def test_single_contribution_mean_applies_exactly_what_was_sent():
    opt = SparseLoCo(OuterConfig(k=64, alpha=1.0))
    anchor = _params(1)
    local = _params(2)
    c = opt.contribute(anchor, local, "a", 100)
    new = opt.apply(anchor, [c])
    for n in anchor:
        torch.testing.assert_close(new[n], anchor[n] - decompress(c.tensors[n]))


def test_selector_mean_averages_only_over_selectors():
    anchor = {"w": torch.zeros(4096)}
    a = SparseLoCo(OuterConfig(k=1, quant_bits=None, aggregation="selectors"))
    b = SparseLoCo(OuterConfig(k=1, quant_bits=None, aggregation="selectors"))
    la, lb = torch.zeros(4096), torch.zeros(4096)
    la[10], lb[20] = -4.0, -2.0  # Δ = anchor - local = +4 at 10, +2 at 20
    ca, cb = a.contribute(anchor, {"w": la}), b.contribute(anchor, {"w": lb})
    sel = a.apply(anchor, [ca, cb])["w"]
    assert sel[10] == -4.0 and sel[20] == -2.0
    mean = SparseLoCo(OuterConfig(k=1, quant_bits=None, aggregation="mean")).apply(anchor, [ca, cb])["w"]
    assert mean[10] == -2.0 and mean[20] == -1.0


def test_median_norm_clipping_limits_an_outlier():
    cfg = OuterConfig(k=4096, quant_bits=None, clip_median=True)
    anchor = {"w": torch.zeros(4096)}
    contribs = []
    for scale in (1.0, 1.0, 1.0, 1000.0):
        opt = SparseLoCo(cfg)
        contribs.append(opt.contribute(anchor, {"w": -scale * torch.ones(4096)}))
    out = SparseLoCo(cfg).apply(anchor, contribs)["w"]
    torch.testing.assert_close(out, -torch.ones(4096))  # the 1000x outlier is scaled down to the median norm


def test_token_weighting():
    cfg = OuterConfig(k=4096, quant_bits=None, token_weighted=True)
    anchor = {"w": torch.zeros(4096)}
    c1 = SparseLoCo(cfg).contribute(anchor, {"w": -torch.ones(4096)}, "a", tokens=300)
    c2 = SparseLoCo(cfg).contribute(anchor, {"w": torch.ones(4096)}, "b", tokens=100)
    out = SparseLoCo(cfg).apply(anchor, [c1, c2])["w"]
    torch.testing.assert_close(out, torch.full((4096,), -0.5))


def test_a_claimed_token_count_weighs_no_more_than_a_full_round_of_the_manifests_batch():
    cfg = OuterConfig(k=4096, quant_bits=None, token_weighted=True, max_tokens=100)
    anchor = {"w": torch.zeros(4096)}
    liar = SparseLoCo(cfg).contribute(anchor, {"w": -torch.ones(4096)}, "liar", tokens=2**40)
    honest = SparseLoCo(cfg).contribute(anchor, {"w": torch.ones(4096)}, "b", tokens=100)
    out = SparseLoCo(cfg).apply(anchor, [liar, honest])["w"]
    torch.testing.assert_close(out, torch.zeros(4096))  # capped at 100 tokens: equal weights, they cancel
    dense = DiLoCo(OuterConfig(kind="diloco", token_weighted=True, max_tokens=100, momentum=0.0, outer_lr=1.0))
    c1 = dense.contribute(anchor, {"w": -torch.ones(4096)}, "liar", tokens=2**40)
    c2 = dense.contribute(anchor, {"w": torch.ones(4096)}, "b", tokens=100)
    torch.testing.assert_close(dense.apply(anchor, [c1, c2])["w"], torch.zeros(4096))


def test_withdraw_restores_the_buffer():
    opt = SparseLoCo(OuterConfig(k=64))
    anchor, local = _params(3), _params(4)
    c = opt.contribute(anchor, local)
    opt.withdraw(c)
    for n in anchor:
        torch.testing.assert_close(opt.ef[n], anchor[n] - local[n], atol=1e-6, rtol=0)


def test_forgetting_a_tainted_phase_leaves_exactly_what_earlier_phases_left():
    """A tainted phase (refused, not withdrawn) is taken back out of the buffer: what stays is the earlier clean
    phases' remainder, decayed as the tainted phase's contribution decayed it, and the next contribution is the
    one a peer that never ran the tainted phase makes."""
    anchor = _params(3)
    opt, twin = SparseLoCo(OuterConfig(k=64)), SparseLoCo(OuterConfig(k=64))
    for o in (opt, twin):
        o.contribute(anchor, _params(4))  # a clean phase, taken: its unsent part stays in the buffer
    clean = {n: e.clone() for n, e in opt.ef.items()}
    tainted_local = _params(5)
    tainted = opt.contribute(anchor, tainted_local)  # computed from a liar's frames: refused, and not withdrawn
    opt.forget_phase(tainted, anchor, tainted_local)
    for n in anchor:
        torch.testing.assert_close(opt.ef[n], 0.95 * clean[n], atol=1e-6, rtol=0)
    twin.ef = {n: 0.95 * e for n, e in twin.ef.items()}  # a round without a phase of its own decays it alike
    nxt, ref = opt.contribute(anchor, _params(6)), twin.contribute(anchor, _params(6))
    for n in anchor:  # the same positions, the same values up to float32 rounding of the buffer's arithmetic
        assert torch.equal(nxt.tensors[n].flat_indices(), ref.tensors[n].flat_indices()), n
        torch.testing.assert_close(decompress(nxt.tensors[n]), decompress(ref.tensors[n]), atol=1e-5, rtol=1e-5)


def test_forgetting_the_first_phase_empties_the_buffer_exactly():
    anchor, local = _params(3), _params(5)
    opt = SparseLoCo(OuterConfig(k=64, ef_dtype="bf16"))
    tainted = opt.contribute(anchor, local)
    assert any(float(e.abs().sum()) > 0 for e in opt.ef.values())
    opt.forget_phase(tainted, anchor, local)
    assert opt.ef == {} and opt.phases == 0
    nxt, ref = opt.contribute(anchor, _params(6)), SparseLoCo(OuterConfig(k=64)).contribute(anchor, _params(6))
    for n in anchor:  # what a fresh buffer sends: nothing of the tainted phase, not even its rounding
        assert torch.equal(decompress(nxt.tensors[n]), decompress(ref.tensors[n])), n


def test_forgetting_a_backlogged_phase_keeps_the_earlier_phases_in_the_backlog():
    anchor = _params(3)
    opt = SparseLoCo(OuterConfig(k=64))
    c0 = opt.contribute(anchor, _params(4))
    opt.withdraw(c0)  # left out: that phase stays, and the next contribution carries two phases
    before = {n: e.clone() for n, e in opt.ef.items()}
    local = _params(5)
    tainted = opt.contribute(anchor, local)
    opt.forget_phase(tainted, anchor, local)
    assert opt.phases == 1
    for n in anchor:
        torch.testing.assert_close(opt.ef[n], 0.95 * before[n], atol=1e-5, rtol=0)


def test_a_backlog_is_sent_as_its_average_and_cleared_where_sent():
    """Left out once (a gather set without room), the next contribution carries two phases: averaged, it sends
    the top-k of half the buffer and gives up the whole buffer at those positions; summed, the buffer as it is."""
    cfg = {"k": 64, "beta": 0.95, "quant_bits": None}
    avg, whole = SparseLoCo(OuterConfig(**cfg)), SparseLoCo(OuterConfig(**cfg, backlog="sum"))
    anchor = _params(5)
    first, second = _params(6), _params(7)
    for opt in (avg, whole):
        opt.withdraw(opt.contribute(anchor, first))
    buffer = {n: avg.ef[n].clone() for n in anchor}
    a, w = avg.contribute(anchor, second), whole.contribute(anchor, second)
    for n in anchor:
        expected = 0.95 * buffer[n] + (anchor[n] - second[n])
        sent_a, sent_w = decompress(a.tensors[n]), decompress(w.tensors[n])
        chosen = sent_a != 0
        assert torch.equal(chosen, sent_w != 0)  # the same positions
        torch.testing.assert_close(sent_a, sent_w / 2, atol=1e-6, rtol=0)
        assert torch.count_nonzero(avg.ef[n][chosen]) == 0  # the whole backlog there is spent
        torch.testing.assert_close(avg.ef[n][~chosen], expected[~chosen], atol=1e-6, rtol=0)
        torch.testing.assert_close(whole.ef[n] + sent_w, expected, atol=1e-6, rtol=0)
    # taken, the next phase is one phase again; left out again, the backlog is back in the buffer
    avg.withdraw(a)
    assert avg.phases == 2


def test_apply_is_deterministic_and_state_round_trips():
    anchor = _params(5)
    opts = [SparseLoCo(OuterConfig(k=32)) for _ in range(3)]
    contribs = [o.contribute(anchor, _params(10 + i)) for i, o in enumerate(opts)]
    x = opts[0].apply(anchor, contribs)
    y = opts[1].apply(anchor, contribs)
    assert all(torch.equal(x[n], y[n]) for n in anchor)
    clone = SparseLoCo(OuterConfig(k=32))
    clone.load_state(opts[0].state_tensors())
    assert all(torch.equal(clone.ef[n], opts[0].ef[n]) for n in anchor)


def test_diloco_nesterov_step():
    opt = make_outer(OuterConfig(kind="diloco", outer_lr=0.5, momentum=0.9))
    assert isinstance(opt, DiLoCo)
    anchor = {"w": torch.zeros(10)}
    c = opt.contribute(anchor, {"w": -torch.ones(10)})
    new = opt.apply(anchor, [c])["w"]
    # m = g = 1; update = g + 0.9 m = 1.9; θ = 0 - 0.5 * 1.9
    torch.testing.assert_close(new, torch.full((10,), -0.95))
    new2 = opt.apply({"w": new}, [c])["w"]
    # m = 0.9 + 1 = 1.9; update = 1 + 0.9 * 1.9 = 2.71
    torch.testing.assert_close(new2, new - 0.5 * 2.71)
    bf = make_outer(OuterConfig(kind="diloco", wire_dtype="bf16")).contribute(anchor, {"w": -torch.ones(10)})
    assert bf.tensors["w"].dtype == torch.bfloat16


def test_bf16_error_feedback_is_half_the_bytes_and_keeps_the_identity_to_its_rounding():
    """A peer may keep its error feedback in bfloat16: e_new + Δ̂ = β·e_old + Δ holds to bf16's rounding of e_new,
    the sent payload is computed in float32 as before, and a saved buffer loads back in the same dtype."""
    opt = SparseLoCo(OuterConfig(k=64, beta=0.95, ef_dtype="bf16"))
    ref = SparseLoCo(OuterConfig(k=64, beta=0.95))
    anchor = _params(0)
    local = {n: t - 0.01 * torch.randn_like(t) for n, t in anchor.items()}
    c, c_ref = opt.contribute(anchor, local), ref.contribute(anchor, local)
    for n in anchor:
        assert opt.ef[n].dtype == torch.bfloat16 and opt.ef[n].element_size() == 2
        assert torch.equal(decompress(c.tensors[n]), decompress(c_ref.tensors[n]))  # the first round sends the same
        torch.testing.assert_close(opt.ef[n].float(), ref.ef[n], rtol=2 ** -8, atol=0)
    opt.contribute(anchor, {n: t - 0.01 * torch.randn_like(t) for n, t in anchor.items()})
    again = SparseLoCo(OuterConfig(k=64, ef_dtype="bf16"))
    again.load_state(opt.state_tensors())
    assert all(torch.equal(again.ef[n], opt.ef[n]) and again.ef[n].dtype == torch.bfloat16 for n in anchor)
    opt.withdraw(c)  # a withdrawn contribution goes back into the bf16 buffer
    assert all(opt.ef[n].dtype == torch.bfloat16 for n in anchor)


def _dense_reference(opt, anchor, contributions):
    """The round's result summed over whole dense buffers, the way the aggregation was first written."""
    cfg = opt.config
    w = opt.weights(contributions, list(anchor))
    total = sum(c.tokens if cfg.token_weighted else 1.0 for c in contributions)
    out = {}
    for name, a in anchor.items():
        num, den = torch.zeros(a.numel()), torch.zeros(a.numel())
        for wi, c, v in zip(w, contributions, opt._values(contributions, name)):
            idx = c.tensors[name].flat_indices()
            num.index_add_(0, idx, v * wi)
            den.index_add_(0, idx, torch.full((idx.numel(),), wi))
        delta = num / total if cfg.aggregation == "mean" else \
            torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))
        out[name] = a - cfg.alpha * delta.view(a.shape)
    return out


@pytest.mark.parametrize("aggregation", ["mean", "selectors"])
@pytest.mark.parametrize("clip", [False, True])
def test_the_sparse_aggregation_is_the_dense_sum_bit_for_bit(aggregation, clip):
    """The round's result is summed over the positions sent only (temporaries as large as those, not the parameter),
    and every peer's checksum depends on its bits: they must be a dense sum's exactly."""
    anchor = _params(0, {"w": (300, 500), "b": (77,), "e": (1000, 64)})
    contributions = []
    for i in range(4):
        local = {n: t - 0.01 * torch.randn_like(t) for n, t in anchor.items()}
        contributions.append(SparseLoCo(OuterConfig(k=64)).contribute(anchor, local, f"p{i}", 100 + 10 * i))
    opt = SparseLoCo(OuterConfig(k=64, aggregation=aggregation, clip_median=clip, alpha=0.8))
    want = _dense_reference(opt, anchor, contributions)
    got = opt.apply(anchor, contributions)
    for n in anchor:
        assert torch.equal(got[n].view(torch.int32), want[n].view(torch.int32))
        assert torch.equal(opt.applied(anchor, contributions, n).view(torch.int32), want[n].view(torch.int32))


@pytest.mark.parametrize("ef_dtype", ["fp32", "bf16"])
def test_an_error_feedback_kept_in_a_file_is_the_one_kept_in_memory(tmp_path, ef_dtype):
    """The buffer spilled to a file (``ef_dir``) sends, withdraws, forgets and saves bit for bit what the buffer
    in memory does, over rounds of every kind."""
    opts = [SparseLoCo(OuterConfig(k=64, beta=0.95, ef_dtype=ef_dtype, ef_dir=d)) for d in ("", str(tmp_path))]
    anchor = _params(0)
    for r in range(4):
        local = {n: t - 0.01 * torch.randn_like(t, generator=torch.Generator().manual_seed(r)) for n, t in anchor.items()}
        made = [o.contribute(anchor, local) for o in opts]
        for n in anchor:
            assert torch.equal(decompress(made[0].tensors[n]), decompress(made[1].tensors[n]))
        if r == 1:
            for o, c in zip(opts, made):
                o.withdraw(c)  # a straggler's contribution goes back into the buffer
        if r == 2:
            for o, c in zip(opts, made):
                o.forget_phase(c, anchor, local)  # a refused round takes the phase back out
        for n in anchor:
            assert torch.equal(opts[0].ef[n], opts[1].ef[n]), (r, n)
    assert not isinstance(opts[1].ef, dict) and opts[1].ef.nbytes() == sum(
        t.numel() * opts[0].ef[n].element_size() for n, t in anchor.items())
    saved = dict(opts[1].state_tensors())
    assert sorted(saved) == sorted(f"ef.{n}" for n in anchor)
    again = SparseLoCo(OuterConfig(k=64, ef_dtype=ef_dtype, ef_dir=str(tmp_path / "again")))
    again.load_state(saved)
    assert all(torch.equal(again.ef[n], opts[0].ef[n]) for n in anchor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("phases", [1, 3])
def test_the_mass_moved_at_the_sent_positions_is_the_dense_one(dtype, phases):
    """The buffer gives up (or takes back) a contribution's mass at its sent positions only, bit for bit what the
    dense ``e ∓ decompress(sent) * phases`` gives, without a parameter-sized buffer."""
    g = torch.Generator().manual_seed(phases)
    e = torch.randn(300, 4096, generator=g).to(dtype)
    sent = compress(e.float(), 64, 2)
    dense = decompress(sent) * phases if phases > 1 else decompress(sent)
    assert torch.equal(move_mass(e.clone(), sent, phases, -1.0), e.float().sub(dense).to(dtype))
    back = e.clone()
    back.add_(dense)  # in place, in e's dtype: what withdraw did
    assert torch.equal(move_mass(e.clone(), sent, phases, 1.0), back)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_round_applied_at_its_positions_into_the_anchor_is_the_dense_sum_bit_for_bit(tmp_path, where):
    """The applier changes each anchor parameter at the positions the round selected (a spilled one a block at a
    time, without a copy of it): the result and a snapshot taken before must be the dense ones, bit for bit."""
    from hlbp.peer.rounds.anchor import Anchor

    start = _params(0, {"w": (300, 500), "b": (77,), "e": (1000, 64)})
    contributions = []
    for i in range(3):
        local = {n: t - 0.01 * torch.randn_like(t) for n, t in start.items()}
        contributions.append(SparseLoCo(OuterConfig(k=64)).contribute(start, local, f"p{i}", 100))
    opt = SparseLoCo(OuterConfig(k=64, alpha=0.8))
    want = _dense_reference(opt, start, contributions)
    anchor = Anchor(start, spill_dir=str(tmp_path) if where == "disk" else "")
    before = anchor.snapshot()
    for n, step in opt.sparse_steps(list(anchor), contributions):
        old_at = anchor.values_at(n, step.positions)
        anchor.put_at(n, step.positions, step.new_values(old_at), old_at)
    for n in start:
        assert torch.equal(anchor[n].view(torch.int32), want[n].view(torch.int32))
        assert torch.equal(before[n].view(torch.int32), start[n].view(torch.int32))
    assert opt.sparse_steps(list(anchor), []) is None
    assert DiLoCo(OuterConfig(kind="diloco")).sparse_steps(list(anchor), contributions) is None


@pytest.mark.parametrize("ef_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_buffer_added_into_the_delta_a_block_at_a_time_is_the_whole_formula_bit_for_bit(tmp_path, monkeypatch,
                                                                                           ef_dtype, where):
    """A contribution adds β times the kept buffer into the phase's delta a block at a time (a spilled buffer in
    blocks of 64 bytes here): its contributions and its buffer are bit for bit those of ``β·e + Δ`` made whole, over
    rounds with a backlog of two phases among them."""
    from hlbp.peer.common import spill

    monkeypatch.setattr(spill, "BLOCK_BYTES", 64)
    opt = SparseLoCo(OuterConfig(k=64, beta=0.95, ef_dtype=ef_dtype, ef_dir=str(tmp_path) if where == "disk" else ""))
    store = torch.float32 if ef_dtype == "fp32" else torch.bfloat16
    anchor = _params(0)
    for r in range(4):
        local = {n: t - 0.01 * torch.randn_like(t, generator=torch.Generator().manual_seed(r)) for n, t in anchor.items()}
        before = {n: opt.ef[n].clone() for n in opt.ef}
        m = opt.phases + 1
        made = opt.contribute(anchor, local)
        for n in anchor:
            delta = anchor[n] - local[n]
            e = delta if n not in before else before[n].float().mul_(0.95).add_(delta)
            want = compress(e / m if m > 1 else e, 64, 2)
            got = made.tensors[n]
            assert torch.equal(got.indices, want.indices) and torch.equal(got.codes, want.codes), (r, n)
            assert torch.equal(got.table, want.table) and got.shift == want.shift, (r, n)
            kept = move_mass(e, want, m, -1.0).to(store)
            assert torch.equal(opt.ef[n].view(-1).view(torch.uint8), kept.view(-1).view(torch.uint8)), (r, n)
        if r == 1:
            opt.withdraw(made)  # a straggler: the next contribution carries two phases
    opt.ef["b"] = torch.zeros(299, dtype=store)  # a buffer that is not the parameter's shape is refused
    with pytest.raises(ValueError):
        opt.contribute(anchor, anchor)
