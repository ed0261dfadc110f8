"""Capacity measurement (toy model, forced values, failures) and the bootstrap's run config."""

from __future__ import annotations

import pytest
import torch

from hlbp.bootstrap.config import build_manifest, load_run_config
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.spill import NoRoomError
from hlbp.peer.node.capacity import (
    WarmupSpec,
    available_memory_gb,
    measure,
    measure_bandwidth,
    measure_throughput,
)
from hlbp.peer.node.replica import require_state_room


def test_available_memory_is_positive():
    assert available_memory_gb() > 0


def test_throughput_of_a_toy_model_is_positive_and_scaled():
    def factory() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))

    spec = WarmupSpec(batch_size=2, seq_len=8, vocab_size=50, steps=2, time_budget_s=5.0)
    tps = measure_throughput(factory, spec)
    assert tps > 0
    scaled = measure_throughput(factory, WarmupSpec(**{**spec.__dict__, "scale": 1000.0}))
    assert scaled > tps  # a 1000x scale dwarfs timing noise


def test_forced_values_skip_measurement_and_failures_degrade_to_zero():
    def boom(*_args):
        raise RuntimeError("no model here")

    cap = measure(8.0, 123.0, 4.0, boom, boom)
    assert (cap.memory_gb, cap.throughput, cap.bandwidth) == (8.0, 123.0, 4.0)
    cap = measure(8.0, None, None, boom, boom)
    assert (cap.throughput, cap.bandwidth) == (0.0, 0.0)
    assert measure_bandwidth(lambda n: 0.5, 1000) == 2000.0
    assert measure_bandwidth(lambda n: 0.0, 1000) == 0.0


def test_default_run_config_builds_a_valid_manifest_with_a_stable_run_id():
    cfg = load_run_config(None)
    a = build_manifest(cfg, b'{"tok": 1}', issued_at=10.0)
    b = build_manifest(cfg, b'{"tok": 1}', issued_at=20.0)
    c = build_manifest(cfg, b'{"tok": 2}', issued_at=10.0)
    assert a.run_id == b.run_id != c.run_id and a.run_id.startswith("hlbp-")
    assert a.stages == ((0, 3), (3, 4)) and a.model == "tiny"  # the head weighs about five blocks
    assert a.artifact("tokenizer.json").size == len(b'{"tok": 1}')


def test_run_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "demo"\nn_stages = 4\n[hparams]\ninner_steps = 5\n[placement]\n'
                    'replica_min_throughput = 1000.0\n[codec]\nname = "subspace-a"\nk = 16\n')
    m = build_manifest(load_run_config(path), b"{}", issued_at=1.0)
    assert m.run_id == "demo" and len(m.stages) == 4 and m.hparams.inner_steps == 5
    assert m.placement.replica_min_throughput == 1000.0 and m.codec.k == 16


@pytest.mark.parametrize("text, match", [
    ("lr = 0.1\n", "unknown keys lr"),
    ("[hparams]\nlearning_rate = 1\n", "unknown \\[hparams\\] keys"),
    ("run_id = 'a b'\n", "run config"),
    ("[codec]\nname = 'subspace-a'\n", "needs k"),
    ("stages = [[0, 1], [2, 4]]\n", "contiguous"),
    ("this is not toml", "not valid TOML"),
])
def test_bad_run_configs_are_user_errors(tmp_path, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(UserInputError, match=match):
        build_manifest(load_run_config(path), b"{}", issued_at=1.0)


def test_a_peer_refuses_to_start_when_its_folder_cannot_hold_the_round_state(small_disk):
    """The anchor (4 B a parameter) and the error feedback (2 in bf16, 4 in fp32) must fit the 1 MiB disk."""
    require_state_room(str(small_disk), 100_000, "bf16")  # 600 kB
    with pytest.raises(NoRoomError, match="1,000,000 parameters .* --state-in-memory"):
        require_state_room(str(small_disk), 1_000_000, "bf16")
    with pytest.raises(NoRoomError):
        require_state_room(str(small_disk), 150_000, "fp32")  # 1.2 MB: fits in bf16, not in fp32
    require_state_room(str(small_disk), 150_000, "bf16")
    require_state_room("", 10**12, "fp32")  # in memory: nothing to check


def test_in_a_run_with_stage_peers_no_takeover_comes_while_the_coordinator_in_charge_may_still_be_auditing():
    """The coordinator in charge audits the stage peers for up to the audit budget between its close and its set;
    the next-ranked one's set must not count before that, or peers that read early and late apply different sets."""
    from hlbp.peer.node.replica import round_settings, takeover_delay
    from hlbp.peer.rounds.config import RoundConfig
    from hlbp.peer.rounds.rules import set_counts
    from hlbp.peer.swarm.auditor import AuditConfig
    from hlbp.protocol.roundwire import AcceptedSet

    budget = AuditConfig().budget_s
    assert takeover_delay(1) == RoundConfig.takeover_s  # full replicas only: nobody audits
    assert takeover_delay(4) == RoundConfig.takeover_s + budget
    m = build_manifest(load_run_config(None), b'{"tok": 1}', issued_at=10.0)  # the default run: 2 stages
    assert len(m.stages) == 2 and round_settings(m, 0.0)[1].takeover_s == takeover_delay(2)
    members = (("first", 10, {0: "a" * 64}), ("second", 10, {0: "b" * 64}))
    window, first_seen = 4.0, 100.0
    late_publish = first_seen + window + budget  # the first set, published at the end of a spent audit budget
    second = AcceptedSet("second", 7, members)
    assert not set_counts(second, ["first", "second"], prior_known=True, complete=False, first_seen=first_seen,
                          now=late_publish, window=window, max_window=60.0, takeover_s=takeover_delay(4),
                          min_contributors=1)
    assert set_counts(second, ["first", "second"], prior_known=True, complete=False, first_seen=first_seen,
                      now=late_publish, window=window, max_window=60.0, takeover_s=takeover_delay(1),
                      min_contributors=1)  # what the base delay allowed: the split this delay prevents
