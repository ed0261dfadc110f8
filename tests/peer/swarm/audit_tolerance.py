"""How far an honest stage peer's frames are from an auditor's recomputation when the two run on different devices.

Usage: ``python tests/peer/swarm/audit_tolerance.py [--presets tiny,small,125m] [--stages 3] [--out F.json]``

An audit of a phase's first step (:func:`hlbp.peer.swarm.audit.audit`) convicts a frame whose relative error
against the recomputation at the anchor is above :attr:`Tolerance.exact`. On the CPU both sides compute in float32
and agree to the last bit; a stage peer on a GPU computes under bf16 autocast, and its auditor may be a full replica
on the CPU, or on another GPU. This tool measures that error with the real audit, per preset, stage and pair of
(peer device, auditor device): every stage of the preset's model at its initial weights, real activations and
gradients at each boundary (the whole chain run in float32 on the CPU on random token ids), the honest peer's
frames made as its worker makes them (autocast on CUDA), encoded with the run's codec. Each row gives the error
and the auditor's own gap between its two precisions (its ``noise``), whether the error is within
:attr:`Tolerance.exact`, and whether the frame is clean (within ``exact`` or ``precision`` times the noise). Devices: the CPU, and CUDA
when present. A measuring tool beside the tests, like ``attack_costs.py``; the pure audit's unit tests are
``test_audit.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.swarm.audit import Evidence, Tolerance, audit
from hlbp.peer.train.trainer import autocast
from hlbp.protocol.stagewire import StageMessage, encode_tokens

ALWAYS = Tolerance(exact=-1.0)  # every frame above it: the auditor's second precision is measured for each
LABELS = StageMessage("fwd", session=1, step=1, mb=0, attempt=0, weight=1.0, round=0, inner=0)


def boundaries(stages: list[torch.nn.Module], ids: torch.Tensor,
               targets: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each stage's input and the gradient of its output, from the whole chain in float32 on the CPU."""
    inputs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    x: torch.Tensor = ids
    for s in stages:
        x = x if s.is_first else x.detach().requires_grad_(True)
        inputs.append(x)
        outs.append(s(x))
        x = outs[-1]
    grads = [torch.zeros(())]  # the last stage's output is the loss's input: no gradient frame
    g = torch.autograd.grad(stages[-1].loss(outs[-1], targets), inputs[-1])[0]
    for i in range(len(stages) - 2, -1, -1):  # stage i's output gradient is stage i+1's input gradient
        grads.insert(0, g)
        if i > 0:
            g = torch.autograd.grad(outs[i], inputs[i], g)[0]
    return [x.detach() for x in inputs], grads


def peer_frames(s: torch.nn.Module, codec: Any, vocab: int, x: torch.Tensor, ids: torch.Tensor,
                targets: torch.Tensor, g_out: torch.Tensor, device: torch.device) -> Evidence:
    """The frames an honest peer of stage ``s`` on ``device`` exchanges for input ``x`` and output gradient
    ``g_out``: computed under its worker's autocast, encoded with the run's codec."""
    window = encode_tokens(ids, targets, vocab)
    if not s.is_first:  # what it computes on is what it received: the frames as decoded
        x = codec.decode_forward(codec.encode_forward(x.float().cpu(), ids)).tensor
    if not s.is_last:
        g_out = codec.decode_backward(codec.encode_backward(g_out.float().cpu()), tuple(g_out.shape[:2])).tensor
    s = s.to(device)
    s.train(True)
    leaf = None if s.is_first else x.to(device).detach().requires_grad_(True)
    with torch.enable_grad(), autocast(device):
        out = s(ids.to(device) if s.is_first else leaf)
        if s.is_last:
            out = s.loss(out, targets.to(device)) * LABELS.weight
    bwd = replace(LABELS, op="bwd")
    x_frame = None if s.is_first else (LABELS, codec.encode_forward(x.float().cpu(), ids) + window)
    if s.is_last:
        (g,) = torch.autograd.grad(out, leaf)
        return Evidence(x_frame, None, None, (bwd, codec.encode_backward(g.float().cpu())))
    y = (LABELS, codec.encode_forward(out.detach().float().cpu(), ids) + window)
    g_out_frame = (bwd, codec.encode_backward(g_out.float().cpu()))
    if s.is_first:
        return Evidence(None, y, g_out_frame, None)
    (g,) = torch.autograd.grad(out, leaf, g_out.to(device, out.dtype))
    return Evidence(x_frame, y, g_out_frame, (bwd, codec.encode_backward(g.float().cpu())))


def trained(stages: list[torch.nn.Module], steps: int, batch: int, seq: int, vocab: int) -> None:
    """``steps`` AdamW steps (lr 1e-3) of the whole chain on random tokens, in place: weights that moved away from
    their initial values, whose activations are less tame."""
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        x: torch.Tensor = tokens[:, :-1]
        for s in stages:
            x = s(x)
        opt.zero_grad()
        stages[-1].loss(x, tokens[:, 1:]).backward()
        opt.step()


def measure(name: str, n_stages: int, batch: int, seq: int, codec_kind: str, wire: str, seed: int,
            steps: int = 0) -> list[dict]:
    cfg = preset(name, vocab_size=8192)
    codec = make_codec(CodecConfig(codec_kind, wire_dtype=wire), cfg.d_model, cfg.vocab_size, cfg.max_seq_len)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    torch.manual_seed(seed)
    base = split(cfg, n_stages)
    state = initial_state(cfg, seed)
    for s in base:
        load_from_full(s, state)
    trained(base, steps, batch, seq, cfg.vocab_size)

    def built(device: torch.device) -> list[torch.nn.Module]:
        return [copy.deepcopy(s).to(device) for s in base]

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    inputs, grads = boundaries(built(torch.device("cpu")), ids, targets)
    rows = []
    for peer_dev in devices:
        peer_stages = built(peer_dev)
        for audit_dev in devices:
            auditor = built(audit_dev)
            for i in range(n_stages):
                e = peer_frames(peer_stages[i], codec, cfg.vocab_size, inputs[i], ids, targets, grads[i], peer_dev)
                r = audit(auditor[i], codec, cfg.vocab_size, e, ALWAYS)  # the second precision for every frame
                pairs = [(c, n) for c, n in ((r.forward, r.forward_noise), (r.backward, r.backward_noise)) if c]
                tol = Tolerance()
                rows.append({"preset": name, "stages": n_stages, "trained_steps": steps, "stage": i,
                             "codec": f"{codec_kind} {wire}", "peer": peer_dev.type, "auditor": audit_dev.type,
                             "forward_error": r.forward.error if r.forward else None,
                             "backward_error": r.backward.error if r.backward else None,
                             "forward_noise": r.forward_noise.error if r.forward_noise else None,
                             "backward_noise": r.backward_noise.error if r.backward_noise else None,
                             "within_exact": all(c.error <= tol.exact for c, _ in pairs),
                             "clean": all(tol.passes(c, 0, n) for c, n in pairs)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small,125m")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--codecs", default="dense:bf16,dense:fp32", help="comma-separated KIND:WIRE_DTYPE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="0", help="comma-separated AdamW steps to train the weights first")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.presets.split(","):
        for spec in args.codecs.split(","):
            kind, wire = spec.split(":")
            for steps in (int(x) for x in args.steps.split(",")):
                rows += measure(name, args.stages, args.batch, args.seq, kind, wire, args.seed, steps)
    tol = Tolerance()
    print(f"{'preset':7s} {'codec':11s} {'steps':>5s} {'peer':5s} {'auditor':7s} {'stage':>5s} "
          f"{'fwd error / noise':>20s} {'bwd error / noise':>20s}  within {tol.exact} / clean")

    def pair(err: float | None, noise: float | None) -> str:
        return "-" if err is None else f"{err:.2e} / {noise:.2e}"

    for r in rows:
        print(f"{r['preset']:7s} {r['codec']:11s} {r['trained_steps']:5d} {r['peer']:5s} {r['auditor']:7s} "
              f"{r['stage']:5d} {pair(r['forward_error'], r['forward_noise']):>20s} "
              f"{pair(r['backward_error'], r['backward_noise']):>20s}  {r['within_exact']} / {r['clean']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"exact": tol.exact, "precision": tol.precision, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
