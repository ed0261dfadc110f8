"""A replica's checkpoint reads its round state kept in files a block at a time: the file is the one the same
tensors held in memory make, byte for byte, and saving a spilled anchor and error-feedback buffer grows the host's
peak by a few blocks, not by the largest parameter (a full replica's peak was at a checkpoint)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from peak_growth import needs_clear_refs, peak_growth_mib

from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.outer import Prefixed
from hlbp.peer.rounds.persist import save_replica
from hlbp.peer.train.checkpoint import load_checkpoint


class _Model:
    """A trainer's checkpoint part: its parameters and header (what :func:`save_replica` asks of a trainer)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.tensors, {"step": 7}


def _state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    anchor = {"emb": torch.randn(300, 70, generator=g), "norm": torch.randn(70, generator=g)}
    ef = {n: torch.randn(t.shape, generator=g).bfloat16() for n, t in anchor.items()}
    own = {"emb": torch.randn(300, 70, generator=g), "flag": torch.tensor([True, False])}
    return anchor, ef, own


def test_a_checkpoint_of_spilled_state_is_the_file_of_the_same_state_in_memory(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    from hlbp.peer.common import spill

    monkeypatch.setattr(spill, "BLOCK_BYTES", 4096)  # the 84,000-byte embedding in 21 blocks
    anchor, ef, own = _state()
    save_replica(tmp_path / "held.safetensors", anchor, {0: Prefixed(ef, "ef.")}, _Model(own), 4, True, "run")
    spilled_ef = spill.SpilledTensors(tmp_path / "ef")
    for n, t in ef.items():
        spilled_ef[n] = t
    save_replica(tmp_path / "spilled.safetensors", Anchor(anchor, spill_dir=str(tmp_path / "anchor")),
                 {0: Prefixed(spilled_ef, "ef.")}, _Model(own), 4, True, "run")
    held, spilled = (tmp_path / "held.safetensors").read_bytes(), (tmp_path / "spilled.safetensors").read_bytes()
    assert held == spilled
    tensors, header = load_checkpoint(tmp_path / "spilled.safetensors")  # its digest checked on the way
    assert header["round"] == 4 and torch.equal(tensors["emb"], own["emb"])
    # a non-finite value in a spilled anchor's last block still stops the save
    anchor["emb"][-1, -1] = float("nan")
    assert not save_replica(tmp_path / "poisoned.safetensors", Anchor(anchor, spill_dir=str(tmp_path / "a2")), {},
                            _Model(own), 5, True, "run")
    assert not (tmp_path / "poisoned.safetensors").exists()


_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from hlbp.peer.common.spill import SpilledTensors
    from hlbp.peer.rounds.anchor import Anchor
    from hlbp.peer.rounds.outer import Prefixed
    from hlbp.peer.rounds.persist import save_replica

    class Model:
        def state_tensors(self):
            return {"w": torch.zeros(16)}, {}

    folder = Path(sys.argv[1])
    shape = (8192, 4096)  # 128 MiB in float32
    anchor = Anchor(spill_dir=str(folder / "anchor"))
    anchor["emb"] = torch.full(shape, 0.5)
    ef = SpilledTensors(folder / "ef")
    ef["emb"] = torch.full(shape, -0.25, dtype=torch.bfloat16)
""")


@needs_clear_refs
def test_saving_spilled_state_holds_a_few_blocks_not_a_parameter(tmp_path: Path) -> None:
    grown = peak_growth_mib(_SCRIPT, 'assert save_replica(folder / "ckpt.safetensors", anchor, {0: Prefixed(ef, "ef.")}, '
                                              'Model(), 1, True, "run")', tmp_path)
    # a 128 MiB anchor parameter and its 64 MiB buffer: read whole, the peak grew by at least the parameter
    assert grown < 64, grown  # 22 MiB here: two 4 MiB blocks and the first use of the kernels it runs
