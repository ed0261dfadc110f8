"""Full replicas and a pipeline swarm with a subspace codec, as real ``hlbp join`` processes on loopback.

Like ``test_heterogeneous_run.py`` (2 full replicas, a swarm of 2 stage peers, the same SparseLoCo rounds), with
the swarm's boundary compressed to k = 16 of d = 128 values per token:

- each variant run (B and A+drift; see the note on the parametrization): all 4 contributions accepted every round, each shard's checksum equal on every peer holding it,
  and the full replicas' and the swarm's validation losses fall;
- A and A+drift: the full replicas train the constrained network the stage peers train (the codec is then
  lossless), so the swarm, scoring the global parameters through its compressed chain, gets the full replicas'
  validation loss to float rounding;
- B and A+drift: stage 1 follows shard 0, so after every round its codec table is stage 0's (equal digests in
  their ``table`` records), it never had to fetch shard 0 (its own apply matched the holders' bit for bit), and
  after the last round both tables are the ``anchor_table`` of the full replicas' embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hlbp.peer.model.basis import fixed_table
from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.sim.launcher import SimConfig
from hlbp.peer.sim.run import run_simulation
from hlbp.peer.train.metricslog import read_metrics

pytestmark = pytest.mark.slow

ROUNDS = 4
# The swarm lands a second or two after the full replicas here (its steps cross two processes), and on a loaded
# 2-core CI box that lag jumps from round to round; a round's window then left the swarm out once in a CI run. The
# claim here is that all four contributions combine every round, so the window's floor is kept above that jitter.
# It costs nothing while all four are on time: the coordinator closes as soon as every expected one is in.
FLOOR_S = 8.0  # 4 s left the swarm out (5 of its 8 steps done) with a second process test beside it
K = 16
SEED = 3


def _one(workdir: Path, pattern: str) -> Path:
    found = sorted(workdir.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def _tables(workdir: Path, name: str) -> dict[int, dict]:
    records = read_metrics(_one(workdir, f"{name}/*/*/metrics.jsonl"))
    return {r["round"]: r for r in records if r.get("event") == "table"}


def _expected_digest(workdir: Path, codec: str) -> str:
    """The anchor table of the full replicas' embedding after the last round, as a stage peer computes it."""
    embed = load_file(_one(workdir, "peer0/*/*/checkpoint.safetensors"))["anchor.embed.weight"]
    vocab, d = embed.shape
    base = fixed_table(vocab, d, SEED) if codec == "subspace-a-drift" else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stage peers compute it (--threads 1): the projection's sums in their order
    try:
        table = make_codec(CodecConfig(kind=codec, rank=str(K), seed=SEED), d, vocab, 128, base, embed)
        return table.table_digest()
    finally:
        torch.set_num_threads(threads)


# Plain A is not run here, to keep the suite within CI's time: A+drift makes every check A does (the constrained
# full replicas, the lossless score) plus B's, and plain A's swarm is checked against the in-process pipeline in
# tests/peer/swarm/test_pipeline_network.py.
@pytest.mark.parametrize("codec", ["subspace-b", "subspace-a-drift"])
def test_subspace_swarm_and_full_replicas_agree_and_learn(tmp_path: Path, codec: str) -> None:
    cfg = SimConfig(n_full=2, n_swarms=1, n_stages=2, rounds=ROUNDS, inner_steps=8, batch_size=4, seq_len=64,
                    run_id="hetero-sub", ttl_s=10.0, seed=SEED, round_deadline_s=FLOOR_S, min_deadline_s=FLOOR_S,
                    codec=codec, codec_k=K)
    report = run_simulation(cfg, tmp_path, timeout_s=300)
    assert not report["timed_out"], report
    assert report["rounds_completed"] == ROUNDS, report["rounds"]
    for r in report["rounds"]:
        assert r["checksums_equal"] and r["in_sync"], r
        assert r["members"] == 4 and set(r["accepted"]) == {"peer0", "peer1", "sw0s0", "sw0s1"}, r
    full = [r["full_val_loss"] for r in report["rounds"]]
    swarm = [r["swarm_val_loss"]["sw0s0"] for r in report["rounds"]]
    assert full[-1] < full[0] - 0.3 and swarm[-1] < swarm[0] - 0.3, (full, swarm)
    if codec == "subspace-b":  # lossy: the swarm sees the global parameters through a rank-16 boundary, which the
        # balanced split puts after layer 3 of 4: one run there measured gaps up to 0.114 (under 0.1 after layer 2)
        assert all(abs(a - b) < 0.15 for a, b in zip(full, swarm)), (full, swarm)
    else:  # lossless on the constrained model that the full replicas now train too
        assert all(abs(a - b) < 1e-3 for a, b in zip(full, swarm)), (full, swarm)

    first, second = _tables(tmp_path, "sw0s0"), _tables(tmp_path, "sw0s1")
    if codec == "subspace-a":
        assert not first and not second  # A's table is the seed's for good: nothing to rebuild or follow
        return
    assert set(range(ROUNDS)) <= set(first) and set(range(ROUNDS)) <= set(second), (first, second)
    digests = [first[r]["table"] for r in range(ROUNDS)]
    assert [second[r]["table"] for r in range(ROUNDS)] == digests  # both sides of the boundary, every round
    assert len(set(digests)) == ROUNDS  # the table moved with the embedding each round
    assert all(second[r]["follow_fetches"] == 0 for r in range(ROUNDS)), second  # following was bit-identical
    assert digests[-1] == _expected_digest(tmp_path, codec)
