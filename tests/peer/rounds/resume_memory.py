"""What resuming a replica's checkpoint adds to the host's resident set, per parameter: run as a process of its own.

Usage: ``python tests/peer/rounds/resume_memory.py DIR`` prints one JSON line: the parameters, the bytes the
checkpoint holds per parameter, and the growth of the resident set's peak over what the restarting peer held
before :meth:`hlbp.peer.rounds.persist.Checkpoints.resume` (its model, optimizer, anchor and outer optimizer already
built, as a restarting peer has them) per parameter. A separate process, so that the peak (``VmHWM``, reset through
``/proc/self/clear_refs``) is this resume's alone. ``test_resume_memory.py`` runs it; it also measures what a
change to the resume path costs.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from hlbp.peer.common.memory import current_host_bytes, trim
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.persist import Checkpoints, save_replica
from hlbp.peer.rounds.state import ReplicaState
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig

SEQ, BATCH = 32, 2


def _peer() -> tuple[InnerTrainer, ReplicaState]:
    """A replica as it stands right before it resumes: the model built, a fresh AdamW, the initial anchor, and an
    outer optimizer with an empty error-feedback buffer."""
    torch.manual_seed(0)
    model = build_model(preset("small", max_seq_len=SEQ))
    g = torch.Generator().manual_seed(1)

    def batches(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 8192, (BATCH, SEQ + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    trainer = InnerTrainer(model, OptimConfig(lr=1e-3, warmup_steps=0, total_steps=10), batches, torch.device("cpu"))
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trainer, ReplicaState(anchor, {0: make_outer(OuterConfig(ef_dtype="bf16"))})


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(folder: Path) -> dict[str, float]:
    path = folder / "checkpoint.safetensors"
    trainer, state = _peer()
    trainer.train_step()  # AdamW's moments exist
    state.outers[0].ef = {n: torch.randn(t.shape).to(torch.bfloat16) for n, t in state.anchor.items()}
    save_replica(path, state.anchor, {0: state.outers[0].state_tensors()}, trainer, 3, True, "resume-memory")
    params = sum(t.numel() for t in state.anchor.values())
    del trainer, state
    gc.collect()
    trim()
    trainer, state = _peer()
    gc.collect()
    trim()
    before = current_host_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    assert Checkpoints(path, 60.0, trainer, "resume-memory").resume(state) and state.round == 3
    grown = _peak() - before
    return {"params": params, "file_bytes_per_param": path.stat().st_size / params,
            "peak_growth_bytes_per_param": grown / params}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
