"""NoLoCo rounds between real ``hlbp join`` processes on loopback: seeded pairs, no coordinator, no all-reduce.

Four full replicas of a run whose manifest says ``outer = "noloco"``: every round each one is paired by the seed
with one other, fetches only its partner's message, and takes its own step. The replicas' losses fall; their outer
weights differ but stay close (the spread, read from their final checkpoints); a replica killed mid-run leaves its
partners stepping alone for the rounds it is paired with, nobody waits for it beyond the window, and a joiner
started afterwards loads one replica's outer weights and takes part from the run's current round.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from faulty_peer import program

from hlbp.peer.rounds.noloco import spread
from hlbp.peer.sim.launcher import Replica, SimConfig, Swarm, poll
from hlbp.peer.train.checkpoint import load_checkpoint
from hlbp.peer.train.metricslog import read_metrics

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0
HLBP = (sys.executable, "-m", "hlbp.cli.main")


def _records(peer: Replica) -> list[dict[str, Any]]:
    path = peer.metrics_path()
    return [r for r in read_metrics(path) if r.get("event") == "round"] if path is not None and path.exists() else []


def _phi(peer: Replica) -> dict[str, torch.Tensor]:
    path = peer.metrics_path().parent / "checkpoint.safetensors"
    tensors, header = load_checkpoint(path)
    assert header["outer"] == "noloco"
    return {n[4:]: t for n, t in tensors.items() if n.startswith("phi.")}


@pytest.mark.parametrize("payload", ["sparse", "dense"])
def test_four_replicas_pair_by_the_seed_learn_and_stay_close(tmp_path: Path, payload: str) -> None:
    cfg = SimConfig(n_stages=1, inner_steps=5, batch_size=4, seq_len=64, seed=7, run_id=f"noloco-{payload}",
                    outer="noloco", noloco_payload=payload, rounds=5, round_deadline_s=10.0, ttl_s=8.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        # one replica starts its rounds later than a round's window after announcing itself (its data and model
        # slow to load, as on a busy box): the others wait for it to be ready, not for its announcement
        late = {"program": program(f"slow-start:{2 * cfg.round_deadline_s:g}")} if payload == "dense" else {}
        peers = [sw.add(f"peer{i}", "--wait-replicas", "4", "--checkpoint-every", "0", **(late if i == 3 else {}))
                 for i in range(4)]
        poll(lambda: all(p.proc.popen.poll() is not None for p in peers), TIMEOUT_S, "every replica's 5 rounds")
        outputs = {p.name: p.proc.output for p in peers}
        recs = {p.name: _records(p) for p in peers}
        ids = {p.name: p.proc.find(r"connected as (\S+)")[0].group(1) for p in peers}
        phis = [_phi(p) for p in peers]
        # any replica's outer weights are a model: it exports and generates as a round-based replica's does
        exported = tmp_path / "exported"
        done = subprocess.run([*HLBP, "export", str(peers[0].metrics_path().parent), str(exported)],
                              env=sw.env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        sample = subprocess.run([*HLBP, "generate", str(peers[0].metrics_path().parent), "--prompt", "The",
                                 "--max-tokens", "5", "--temperature", "0"], env=sw.env, capture_output=True,
                                text=True, timeout=120, check=False)
        assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr[-2000:]
    assert all(p.proc.popen.returncode == 0 for p in peers), {n: o[-2000:] for n, o in outputs.items()}
    by_id = {v: k for k, v in ids.items()}
    for name, rows in recs.items():
        assert [r["round"] for r in rows] == list(range(5)), (name, rows)
        # everyone started together: every round paired (4 peers), each with the partner the seed gave it, and
        # the pairs were mutual: my partner's record of the round names me
        for r in rows:
            assert r["paired"] and r["partner"] in by_id, (name, r)
            theirs = recs[by_id[r["partner"]]][r["round"]]
            assert theirs["partner"] == ids[name], (name, r, theirs)
            assert r["bounded"] == 0  # honest partners stay within the bounds
        assert rows[-1]["val_loss"] < rows[0]["val_loss"], (name, rows)
    partners_seen = {recs["peer0"][r]["partner"] for r in range(5)}
    assert len(partners_seen) > 1  # the pairs change with the round
    # the replicas differ (no all-reduce makes them equal) but stay close
    s = spread(phis)
    assert 0 < s < (0.15 if payload == "dense" else 0.3), s  # measured after 5 rounds: dense 0.069, sparse 0.10
    sent = [r["bytes_sent"] for rows in recs.values() for r in rows]
    n_params = sum(t.numel() for t in phis[0].values())
    if payload == "dense":
        assert all(8 * n_params <= b < 8 * n_params + 65536 for b in sent)  # φ and d in fp32
    else:
        assert all(b * 20 < 8 * n_params for b in sent)  # SparseLoCo's payload: far below the dense pair's


def test_a_dead_partner_is_not_waited_for_and_a_joiner_takes_up_the_current_round(tmp_path: Path) -> None:
    cfg = SimConfig(n_stages=1, inner_steps=5, batch_size=4, seq_len=64, seed=8, run_id="noloco-churn",
                    outer="noloco", rounds=1000, round_deadline_s=3.0, ttl_s=6.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        peers = [sw.add(f"peer{i}", "--wait-replicas", "3") for i in range(3)]
        poll(lambda: all(len(_records(p)) >= 2 for p in peers), TIMEOUT_S, "two rounds on every replica")
        peers[2].proc.kill()
        killed_at = max(len(_records(p)) for p in peers[:2])
        # the two left go on; a round whose partner is the dead peer is taken alone within the window
        poll(lambda: all(len(_records(p)) >= killed_at + 4 for p in peers[:2]), TIMEOUT_S, "four more rounds")
        joiner = sw.add("peer3", rounds=3)
        poll(lambda: joiner.proc.popen.poll() is not None, TIMEOUT_S, "the joiner's 3 rounds")
        survivors = {p.name: _records(p) for p in peers[:2]}
        joined = _records(joiner)
        out = joiner.proc.output
    assert joiner.proc.popen.returncode == 0, out[-3000:]
    assert "loaded the outer weights of" in out, out[-3000:]
    after = [r for rows in survivors.values() for r in rows if r["round"] >= killed_at + 1]
    assert any(not r["paired"] for r in after)  # paired with the dead peer (or nobody) at least once
    assert all(r["wait_s"] < cfg.round_deadline_s + 10 for r in after)  # never waited for beyond the window
    # the joiner took up the run's round (not round 0) and its loss is the run's, not a fresh model's
    assert joined[0]["round"] > killed_at, (joined[0], killed_at)
    assert joined[0]["val_loss"] < survivors["peer0"][0]["val_loss"]


def test_a_lying_partner_is_bounded_and_poisons_nobody(tmp_path: Path) -> None:
    """One of four replicas sends its progress scaled by 1000 every round: whoever it is paired with bounds it to
    4x its own (the records say how many tensors), nobody exits, every honest loss falls. (A partner that scales
    its outer weights instead is not held off by the pull's bound: docs/security.md.)"""

    cfg = SimConfig(n_stages=1, inner_steps=5, batch_size=4, seq_len=64, seed=9, run_id="noloco-liar",
                    outer="noloco", rounds=6, round_deadline_s=10.0, ttl_s=8.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        honest = [sw.add(f"peer{i}", "--wait-replicas", "4") for i in range(3)]
        liar = sw.add("liar", "--wait-replicas", "4", program=program("noloco-liar:1000"))
        poll(lambda: all(p.proc.popen.poll() is not None for p in honest), TIMEOUT_S, "the honest replicas' rounds")
        recs = {p.name: _records(p) for p in honest}
        liar_id = liar.proc.find(r"connected as (\S+)")[0].group(1)
        outputs = {p.name: p.proc.output for p in honest}
    assert all(p.proc.popen.returncode == 0 for p in honest), {n: o[-2000:] for n, o in outputs.items()}
    met = [r for rows in recs.values() for r in rows if r["partner"] == liar_id and r["paired"]]
    assert met, recs  # the seed paired the liar with honest replicas
    assert all(r["bounded"] >= 30 for r in met)  # and every time its message was cut to the bounds (39 tensors)
    # honest pairs: a few tensors whose pull the 8x bound cuts (the liar pushed one side away: measured up to 6),
    # never the whole model as each pairing with the liar is
    assert all(r["bounded"] <= 12 for rows in recs.values() for r in rows if r["partner"] != liar_id), recs
    # every honest replica learns: its loss falls below its first round's. The rounds' losses are noisy (an honest
    # pairing has lifted one by 0.4 between rounds) and a pairing with the liar moves a replica at most 4.6x its own
    # progress, so a late one can lift a round's loss: the honest mean of a late round has come out above the first's
    # (8.26 against 8.23 under a busy loop). What poison does is not noise: unbounded, a lying partner takes honest
    # losses from 8.8 to 25 (docs/security.md); here none rises a nat above its first round's
    for name, rows in recs.items():
        assert len(rows) == cfg.rounds and min(r["val_loss"] for r in rows[1:]) < rows[0]["val_loss"], (name, rows)
        assert all(r["val_loss"] < rows[0]["val_loss"] + 1.0 for r in rows), (name, rows)
    means = [sum(rows[i]["val_loss"] for rows in recs.values()) / len(recs) for i in range(cfg.rounds)]
    assert min(means[1:]) < means[0], means
