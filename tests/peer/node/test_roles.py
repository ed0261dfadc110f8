"""Role policy: pure decisions from capacity, announced peers and thresholds."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.bench.stepcost import held_for_backward
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.model.ops import fused_head
from hlbp.peer.node.join import thresholds_for, tokenizer_vocab
from hlbp.peer.node.roles import (
    Capacity,
    PeerView,
    StateLayout,
    Thresholds,
    activation_bytes,
    choose_role,
    recompute_hint,
    training_memory_gb,
)
from hlbp.protocol.manifest import Hyperparameters, Manifest

T = Thresholds(replica_memory_gb=10.0, stage_memory_gb=3.0, replica_min_throughput=1000.0, max_peers_per_stage=1)
STRONG = Capacity(memory_gb=32.0, throughput=5000.0, bandwidth=1e8)
WEAK = Capacity(memory_gb=4.0, throughput=300.0, bandwidth=1e7)


def stage(peer: str, swarm: int, s: int, tps: float = 300.0) -> PeerView:
    return PeerView(peer, "stage", swarm, s, tps)


def test_empty_swarm_strong_is_replica_weak_opens_swarm_zero():
    assert choose_role(STRONG, [], 3, T).kind == "replica"
    role = choose_role(WEAK, [], 3, T)
    assert (role.kind, role.swarm, role.stage, role.fits) == ("stage", 0, 0, True)
    assert "no pipeline swarm" in role.reason


def test_one_weak_peer_next_weak_completes_its_swarm():
    role = choose_role(WEAK, [stage("a", 0, 0)], 3, T)
    assert (role.swarm, role.stage) == (0, 1)


def test_all_strong_every_peer_is_a_replica():
    peers: list[PeerView] = []
    for i in range(5):
        role = choose_role(STRONG, peers, 2, T)
        assert role.kind == "replica"
        peers.append(PeerView(f"p{i}", "replica", throughput=STRONG.throughput))


def test_a_stage_gone_is_refilled_before_anything_else():
    # Swarm 0 lost stage 1; swarm 1 is complete. The gap is filled, no new swarm opened.
    peers = [stage("a", 0, 0), stage("b", 0, 2), stage("c", 1, 0), stage("d", 1, 1), stage("e", 1, 2)]
    role = choose_role(WEAK, peers, 3, T)
    assert (role.swarm, role.stage) == (0, 1)


def test_completes_the_most_complete_swarm_first():
    peers = [stage("a", 0, 0), stage("b", 1, 0), stage("c", 1, 1)]
    assert (choose_role(WEAK, peers, 3, T).swarm, choose_role(WEAK, peers, 3, T).stage) == (1, 2)


def test_full_swarms_open_a_new_one_or_strengthen_the_weakest_stage():
    peers = [stage("a", 0, 0, 500.0), stage("b", 0, 1, 200.0)]
    role = choose_role(WEAK, peers, 2, T)
    assert (role.swarm, role.stage) == (1, 0)
    roomy = Thresholds(10.0, 3.0, 1000.0, max_peers_per_stage=2)
    role = choose_role(WEAK, peers, 2, roomy)
    assert (role.swarm, role.stage) == (0, 1)
    assert "least throughput" in role.reason


def test_replicas_bootstrap_offline_stage_out_of_range_are_ignored():
    peers = [PeerView("r", "replica", throughput=9000.0), PeerView("b", "bootstrap"), stage("x", 0, 7)]
    role = choose_role(WEAK, peers, 2, T)
    assert (role.swarm, role.stage) == (0, 0)


def test_memory_or_speed_alone_is_not_enough_for_a_replica():
    slow_big = Capacity(memory_gb=64.0, throughput=10.0, bandwidth=1e8)
    fast_small = Capacity(memory_gb=5.0, throughput=9000.0, bandwidth=1e8)
    assert choose_role(slow_big, [], 2, T).kind == "stage"
    assert choose_role(fast_small, [], 2, T).kind == "stage"
    assert "GB <" in choose_role(fast_small, [], 2, T).reason


def test_overrides():
    assert choose_role(WEAK, [], 2, T, force_role="replica").kind == "replica"
    assert not choose_role(WEAK, [], 2, T, force_role="replica").fits
    role = choose_role(STRONG, [stage("a", 0, 0)], 2, T, force_stage=0)
    assert (role.kind, role.swarm, role.stage) == ("stage", 1, 0)
    assert choose_role(STRONG, [], 2, T, force_role="stage").kind == "stage"
    for kwargs in ({"force_role": "king"}, {"force_stage": 2}, {"force_role": "replica", "force_stage": 0}):
        with pytest.raises(ValueError):
            choose_role(WEAK, [], 2, T, **kwargs)


def test_too_little_memory_for_any_stage_is_reported_not_hidden():
    tiny = Capacity(memory_gb=1.0, throughput=100.0, bandwidth=1e6)
    assert not choose_role(tiny, [], 2, T).fits


def test_the_bytes_per_parameter_follow_the_dtypes_each_state_layout_keeps():
    from hlbp.peer.node.replica import STATE_LAYOUTS
    from hlbp.peer.node.roles import ROUND_STATE_BYTES, STEP_STATE_BYTES
    from hlbp.peer.train.adamw import MOMENT_LAYOUTS, STATE_DTYPES

    assert set(STEP_STATE_BYTES) == set(ROUND_STATE_BYTES) == set(STATE_LAYOUTS)
    for name, (ef, moments) in STATE_LAYOUTS.items():
        moment_bytes = sum(d.itemsize for d in MOMENT_LAYOUTS[moments].values())
        assert STEP_STATE_BYTES[name] == 4 + 4 + moment_bytes, name  # parameters, gradients, moments
        assert ROUND_STATE_BYTES[name] == 4 + STATE_DTYPES[ef].itemsize, name  # anchor, error feedback


def test_each_parameter_costs_its_step_state_the_round_state_it_keeps_in_memory_and_the_heap_slack():
    assert StateLayout().bytes_per_param() == 16 + 3  # parameters, gradients, fp32 moments; the round state on disk
    assert StateLayout(on_disk=False).bytes_per_param() == 16 + 6 + 3  # + the anchor and a bf16 error feedback
    assert StateLayout("fp32", on_disk=False).bytes_per_param() == 16 + 8 + 3
    assert StateLayout("bf16-all").bytes_per_param() == 12 + 3
    assert training_memory_gb(0, 0.0, StateLayout()) == pytest.approx(0.5)  # the runtime alone
    assert training_memory_gb(10**9, 2e9, StateLayout(), extra_gb=0.25) == pytest.approx(19 + 2 + 0.5 + 0.25)


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_activation_estimate_covers_what_a_step_holds_for_its_backward(name, recompute):
    config = preset(name)
    model = build_model(config)
    model.recompute = recompute
    for batch, tokens in ((2, 32), (4, 64)):
        x = torch.randint(0, config.vocab_size, (batch, tokens))
        held, _ = held_for_backward(model, x, x)
        estimate = activation_bytes(config.d_model, config.d_ff, config.n_layers, config.vocab_size, batch * tokens,
                                    recompute, head=True)
        assert held <= estimate <= 1.25 * held, (held, estimate)  # measured: 1.04-1.07x, and 1.02-1.08x recomputed


def _run(model: str, batch: int, seq: int, stages: tuple[tuple[int, int], ...]) -> Manifest:
    return Manifest(run_id="need", seed=0, model=model, tokenizer_hash="0" * 64, stages=stages,
                    hparams=Hyperparameters(batch_size=batch, seq_len=seq))


def test_a_1b_replica_fits_24_gb_only_with_its_blocks_recomputed():
    # the manifest's default batch, 16 x 128 tokens: the activations of a step outweigh what recomputing costs
    m = _run("1b", 16, 128, ((0, 9), (9, 18)))
    held, recomputed = thresholds_for(m), thresholds_for(m, StateLayout(recompute=True))
    assert held.replica_memory_gb > 24 >= recomputed.replica_memory_gb > 21  # 19 B/param x 1.13 B alone is 21.5
    assert thresholds_for(m, StateLayout(on_disk=False)).replica_memory_gb > held.replica_memory_gb + 6
    # a stage needs its own parameters' share and its layers' activations, the last stage the head's as well
    assert recomputed.stage_memory_gb < held.stage_memory_gb < held.replica_memory_gb / 1.5


def test_the_run_tokenizers_vocabulary_sizes_the_embedding_and_head_a_role_needs():
    m = _run("small", 16, 128, ((0, 3), (3, 6)))
    preset_vocab = preset("small").vocab_size
    same, larger = thresholds_for(m, vocab_size=preset_vocab), thresholds_for(m, vocab_size=4 * preset_vocab)
    assert same == thresholds_for(m)
    config = preset("small")
    # the embedding and the head each grow by 3 x vocab x d_model parameters, and so does the head's gradient, which
    # its loss holds from the forward at 2,048 tokens a step (fused_head) in place of the logits
    assert fused_head(16 * 128, 4 * preset_vocab, config.d_model)
    extra = 2 * 3 * preset_vocab * config.d_model * 19 + 3 * preset_vocab * config.d_model * 4
    assert larger.replica_memory_gb - same.replica_memory_gb == pytest.approx(extra / 1e9, rel=0.05)


def test_a_tokenizer_file_that_does_not_load_leaves_the_presets_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    real = tmp_path / "real.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(real))
    assert tokenizer_vocab(real) == 3
    for name, text in (("stand-in", '{"model": "not a tokenizer"}'), ("broken", "{"), ("binary", "\x00\xff")):
        bad = tmp_path / f"{name}.json"
        bad.write_text(text)
        assert tokenizer_vocab(bad) is None, name
    assert tokenizer_vocab(tmp_path / "missing.json") is None


def test_a_spare_moves_to_the_one_stage_another_swarm_lacks():
    from hlbp.peer.node.roles import propose_move

    me = stage("spare", 0, 1)
    peers = [stage("a", 0, 0), stage("b", 0, 1), stage("c", 1, 0)]
    move = propose_move(me, peers, 2, idle=True)
    assert (move.swarm, move.stage) == (1, 1) and "spare of stage 1 in swarm 0" in move.reason
    # a peer that trains never moves; neither does the only holder of a stage of a whole swarm
    assert propose_move(me, peers, 2, idle=False) is None
    assert propose_move(stage("b", 0, 1), [stage("a", 0, 0), stage("c", 1, 0)], 2, idle=True) is None
    # a swarm lacking two stages is no clear gain
    assert propose_move(me, [stage("a", 0, 0), stage("b", 0, 1), stage("c", 1, 0)], 3, idle=True) is None


def test_half_swarms_merge_into_the_lower_one_and_never_swap():
    from hlbp.peer.node.roles import propose_move

    low, high = stage("x", 0, 0), stage("y", 1, 1)
    assert propose_move(low, [high], 2, idle=True) is None
    move = propose_move(high, [low], 2, idle=True)
    assert (move.swarm, move.stage) == (0, 1) and "swarm 1 lacks a stage" in move.reason


def test_a_move_needs_the_same_proposal_twice_a_period_apart():
    from hlbp.peer.node.roles import MoveConfirmer, Role

    c = MoveConfirmer(period_s=10.0)
    a, b = Role("stage", 1, 1, "gap"), Role("stage", 2, 0, "other gap")
    assert c.observe(a, 0.0) is None
    assert c.observe(a, 9.9) is None  # too soon
    assert c.observe(b, 12.0) is None  # a different proposal starts over
    assert c.observe(b, 21.0) is None
    assert c.observe(None, 23.0) is None  # the gap closed: start over
    assert c.observe(b, 24.0) is None
    moved = c.observe(b, 34.5)
    assert (moved.swarm, moved.stage) == (2, 0) and "seen for 10 s" in moved.reason


def test_a_forced_swarm_gets_its_missing_stage():
    peers = [stage("a", 0, 0), stage("b", 0, 1), stage("c", 1, 1)]
    role = choose_role(WEAK, peers, 2, T, force_swarm=1)
    assert (role.kind, role.swarm, role.stage) == ("stage", 1, 0) and "forced by --swarm" in role.reason
    role = choose_role(WEAK, peers, 2, T, force_swarm=0)
    assert (role.swarm, role.stage) == (0, 0)
    assert choose_role(WEAK, peers, 2, T, force_swarm=3, force_stage=1).stage == 1
    with pytest.raises(ValueError):
        choose_role(WEAK, peers, 2, T, force_role="replica", force_swarm=1)
    with pytest.raises(ValueError):
        choose_role(WEAK, peers, 2, T, force_swarm=-1)


def test_a_peer_that_would_hold_a_replica_with_recompute_is_told_so():
    needs = Thresholds(replica_memory_gb=29.0, stage_memory_gb=15.0)
    recomputed = Thresholds(replica_memory_gb=23.0, stage_memory_gb=12.0)
    on_24 = Capacity(memory_gb=24.0, throughput=5000.0, bandwidth=1e8)
    role = choose_role(on_24, [], 2, needs)
    assert role.kind == "stage"
    hint = recompute_hint(24.0, role, needs, recomputed)
    assert hint is not None and "--recompute" in hint and "23.0 GB" in hint
    assert recompute_hint(24.0, role, needs, None) is None  # it recomputes already
    assert recompute_hint(20.0, choose_role(Capacity(20.0, 5000.0, 1e8), [], 2, needs), needs, recomputed) is None
    forced = choose_role(on_24, [], 2, needs, force_role="stage")
    assert recompute_hint(24.0, forced, needs, recomputed, forced=True) is None  # the operator chose the stage
    replica = choose_role(Capacity(32.0, 5000.0, 1e8), [], 2, needs)
    assert replica.kind == "replica" and recompute_hint(32.0, replica, needs, recomputed) is None
