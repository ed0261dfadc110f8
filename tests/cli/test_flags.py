"""Flags dataclasses: each command's flags are read, checked and turned into the peer's config objects in one place."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from hlbp.cli.join_flags import MAX_STAGE_PEERS, SCHEDULES, JoinFlags, join_plan
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.swarm.step import Schedule
from hlbp.protocol import stagewire


def test_join_flags_become_the_plan_of_one_peer(monkeypatch):
    monkeypatch.setenv("HLBP_ROUNDS", "3")
    plan = join_plan(["--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/a,/ip4/1.2.3.4/tcp/2/p2p/b", "--probe-mb", "2",
                      "--role", "replica", "--micro-batches", "4", "--threads", "2", "--local-only"])
    assert plan.join.net.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/a", "/ip4/1.2.3.4/tcp/2/p2p/b"]
    assert plan.join.net.host_maddrs == ["/ip4/0.0.0.0/tcp/0"] and plan.join.net.connect_timeout_s == 60.0
    assert plan.join.probe_bytes == 2 << 20 and plan.join.role == "replica" and plan.join.out_dir == Path("runs/join")
    assert plan.replica.rounds == 3 and plan.replica.threads == 2 and plan.stage.threads == 2
    assert plan.stage.micro_batches == 4 and plan.local_only
    assert plan.replica.state_dtype == plan.stage.state_dtype == "bf16"  # the default: bf16 error feedback
    fp32 = join_plan(["--state-dtype", "fp32"])
    assert fp32.replica.state_dtype == fp32.stage.state_dtype == "fp32"
    assert not plan.replica.recompute and not plan.stage.recompute  # activations held: no extra forward by default
    monkeypatch.setenv("HLBP_RECOMPUTE", "1")
    assert join_plan([]).replica.recompute and join_plan([]).stage.recompute
    assert not join_plan(["--no-recompute"]).replica.recompute
    assert plan.stage.schedule is Schedule.UNIFORM  # the driver's default cut of a step's batch
    assert join_plan(["--micro-batch-schedule", "tapered"]).stage.schedule is Schedule.TAPERED
    assert set(SCHEDULES) == {s.value for s in Schedule}  # the flag's light list names every schedule
    assert plan.stage.stage_peers == 4 and join_plan(["--stage-peers", "1"]).stage.stage_peers == 1
    assert MAX_STAGE_PEERS == stagewire.MAX_STAGE_PEERS  # the flag's bound is the wire's


@pytest.mark.parametrize(("changes", "message"), [
    ({"probe_mb": 0.0}, "--probe-mb must be > 0"),
    ({"max_steps": -1}, "--max-steps >= 0"),
    ({"metrics_port": 70000}, "--metrics-port must be 0..65535, got 70000"),
    ({"micro_batches": 0}, "--micro-batches and --in-flight must be >= 1"),
    ({"stage_deadline": 0.0}, "--stage-deadline > 0"),
    ({"rounds": -1}, "--rounds, --checkpoint-every, --wait-replicas and --wait-replicas-timeout must be >= 0"),
    ({"wait_replicas_timeout": -1.0}, "--wait-replicas-timeout must be >= 0"),
    ({"state_dtype": "fp8"}, "--state-dtype must be fp32, bf16, bf16-v or bf16-all, got 'fp8'"),
    ({"micro_batch_schedule": "1f1b"}, "--micro-batch-schedule must be uniform or tapered, got '1f1b'"),
    ({"stage_peers": 0}, "--stage-peers 1..8"),
    ({"stage_peers": 9}, "--stage-peers 1..8"),
])
def test_join_flags_refuse_values_no_peer_runs_with(changes, message):
    with pytest.raises(UserInputError, match=message.replace(".", r"\.")):
        JoinFlags(**changes)


def test_join_command_takes_its_flags_as_one_value():
    from hlbp.cli.control_cmds import join

    flags = inspect.signature(join).parameters
    assert list(flags) == [f for f in JoinFlags.__dataclass_fields__]
    assert "faults" not in flags and inspect.getsource(join.__wrapped__).count("\n") < 60


def test_sim_flags_become_one_sim_config():
    from hlbp.cli.options import parse_flags
    from hlbp.cli.sim_flags import SimFlags

    flags = parse_flags(SimFlags, ["--quick", "--deadline", "0.5", "--swarms", "1", "--stages", "3"], "hlbp simulate")
    cfg = flags.config()
    assert (cfg.n_full, cfg.rounds, cfg.inner_steps, cfg.n_swarms, cfg.n_stages) == (2, 2, 5, 1, 3)
    assert (cfg.round_deadline_s, cfg.min_deadline_s, cfg.max_deadline_s) == (0.5, 0.5, 30.0)
    assert flags.overlap_mode == "eager" and SimFlags(outer="diloco").overlap_mode == "none"


@pytest.mark.parametrize(("changes", "message"), [
    ({"outer": "adam"}, "--outer must be one of sparseloco, diloco, noloco, got 'adam'"),
    ({"outer": "noloco", "noloco_payload": "half"}, "--noloco-payload must be dense or sparse, got 'half'"),
    ({"outer": "noloco", "swarms": 1}, "pipeline swarms take part in sparseloco rounds only"),
    ({"overlap": "eager", "outer": "diloco"}, "--overlap works with --outer sparseloco only"),
    ({"full": 0}, "--full and --swarms must be >= 0, and together start at least one peer"),
    ({"swarms": 1, "stages": 1}, "--stages must be >= 1, and >= 2 for pipeline swarms"),
    ({"swarm_wan_mbps": 0.0}, "--swarm-wan-mbps must be positive"),
    ({"seq_len": 1}, "--rounds, --inner-steps, --batch-size, --micro-batches and --threads must be >= 1"),
])
def test_sim_flags_refuse_values_no_simulation_runs_with(changes, message):
    from hlbp.cli.sim_flags import SimFlags

    with pytest.raises(UserInputError, match=message.replace(".", r"\.")):
        SimFlags(**changes)


def test_every_state_dtype_join_takes_names_a_layout_the_peer_can_build():
    """``--state-dtype`` is checked without importing torch; each value it allows maps to an error-feedback dtype
    and an AdamW moment layout the round loop and the trainer accept, and nothing else is allowed."""
    from hlbp.peer.node.replica import STATE_LAYOUTS, inner_schedule
    from hlbp.peer.rounds.outer import OuterConfig

    for name, (ef, moments) in STATE_LAYOUTS.items():
        JoinFlags(state_dtype=name)
        OuterConfig(ef_dtype=ef).validate()  # type: ignore[arg-type]
        inner_schedule(1e-3, 10, moments).validate()
    with pytest.raises(UserInputError):
        JoinFlags(state_dtype="bf16-x")
    assert set(STATE_LAYOUTS) == {"fp32", "bf16", "bf16-v", "bf16-all"}
