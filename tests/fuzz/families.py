"""Decoder families for the fuzzer: valid inputs built with the real encoders, and structure-aware mutations.

See :mod:`fuzzlib` for the contract each call is checked against and :mod:`oracles` for what an accepted input
must satisfy.
"""

from __future__ import annotations

import inspect
import math
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import torch
from mutators import (
    deep_nesting,
    dup_map,
    flip_bytes,
    lie_content_size,
    mutate_safetensors,
    mutate_tree,
    pack_tree,
    recompress,
    zero_frame_then_garbage,
    zstd_bomb,
)
from oracles import (
    SHAPES,
    check_contribution,
    check_records,
    check_state,
    check_zstd,
    finite,
    mutate_sealed,
    no_newline,
    reseal,
)

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.basis import fixed_table, subspace_basis
from hlbp.peer.model.codec import DenseCodec
from hlbp.peer.model.subspace import SubspaceCodec
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.statesync import encode_state, parse_state, shard_checksum
from hlbp.peer.train.checkpoint import (
    load_checkpoint,
    optimizer_from_tensors,
    optimizer_to_tensors,
    save_checkpoint,
)
from hlbp.protocol import ProtocolError
from hlbp.protocol import envelope as env
from hlbp.protocol.activations import decode_activations
from hlbp.protocol.announcement import Announcement, decode_announcement, encode_announcement
from hlbp.protocol.dense import decode_dense, encode_dense
from hlbp.protocol.frames import decode_header, encode_header, header_length, parse_body_size, parse_request
from hlbp.protocol.identity import Identity
from hlbp.protocol.manifest import Artifact, Manifest, decode_manifest, encode_manifest
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_CHECKS,
    KIND_CONTRIB,
    AcceptedSet,
    ContribNotice,
    ShardChecks,
    parse_accepted,
    parse_checks,
    parse_contrib,
    sign,
)
from hlbp.protocol.zstdframe import decompress_bounded

MAX_CALL_S = 1.0
"""Longest a single decode may take."""
MAX_RSS_GROWTH = 64 << 20
"""Largest rise of the process's peak RSS one decode may cause (inputs here expect at most a few hundred KB)."""
HANG_S = 10
"""A call still running after this long is interrupted and counted as a hang."""

RUN = "run-1"
SHA = "ab" * 32
NOW = 1_000_000.0
ID_A = Identity(bytes([1]) * 32)
ID_B = Identity(bytes([2]) * 32)


def _rng_tensors(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


# --- families ----------------------------------------------------------------------------------------------------


@dataclass
class Family:
    """One decoder family: how to make a hostile input, and how to feed it to the decoders."""

    name: str
    make: Callable[[random.Random], Any]
    decode: Callable[[Any], Any]
    allowed: tuple[type[BaseException], ...] = (ProtocolError,)
    honest: list[Any] = field(default_factory=list)  # unmutated inputs: each must decode (checked in warm-up)
    check: Callable[[Any, Any], None] | None = None  # oracle on an accepted (input, output): raises if malformed


def _contrib_family(kind: str) -> Family:
    cfgs = ([OuterConfig(k=64), OuterConfig(k=64, quant_bits=None)] if kind == "sparse"
            else [OuterConfig(kind="diloco", wire_dtype="fp32"), OuterConfig(kind="diloco", wire_dtype="bf16")])
    seeds = []
    for i, cfg in enumerate(cfgs):
        anchor = _rng_tensors(i, SHAPES)
        local = {n: t + 0.01 * torch.randn(t.shape) for n, t in anchor.items()}
        c = make_outer(cfg).contribute(anchor, local, ID_A.peer_id, 4096)
        for fmt in ("entropy", "packed12") if kind == "sparse" else ("entropy",):
            seeds.append((cfg, contribution_to_bytes(c, cfg, RUN, 7, 2, index_format=fmt)))

    def mutate_body(rng: random.Random, body: bytes) -> bytes:
        if kind == "dense":
            return mutate_safetensors(rng, body, [*SHAPES, "extra"]) if rng.random() < 0.85 else flip_bytes(rng, body)
        tree = msgpack.unpackb(body, raw=False)
        r = rng.random()
        if r < 0.25 and tree.get("fmt") == "entropy":
            key = rng.choice(["una", "val"])
            sec = tree[key]
            if sec[0]:
                sec[1] = recompress(rng, sec[1])
            else:
                sec[1] = zstd_bomb() if rng.random() < 0.2 else recompress(
                    rng, __import__("zstandard").ZstdCompressor(write_content_size=True).compress(sec[1] * 40))
                sec[0] = True
        elif r < 0.3:
            return flip_bytes(rng, body)
        else:
            tree = mutate_tree(rng, tree, n=rng.choice([1, 1, 2]))
        return pack_tree(tree)

    def make(rng: random.Random) -> Any:
        cfg, data = rng.choice(seeds)
        prefix_len = env.PREFIX_SIZE + int.from_bytes(data[5:9], "big")
        fields = msgpack.unpackb(data[env.PREFIX_SIZE:prefix_len], raw=False)
        body = data[prefix_len:]
        r = rng.random()
        if r < 0.1:
            return cfg, flip_bytes(rng, data)
        if r < 0.2:  # amplification: a small valid zstd frame that declares (and holds) 1 GiB
            bomb = zstd_bomb()
            fields.update(enc="zstd", len=len(bomb), raw_len=rng.choice([1 << 30, 1 << 20, len(body)]),
                          digest=bytes(32))
            body = bomb
        elif r < 0.3:  # the body travels zstd-compressed, honestly or with a lying size
            frame = __import__("zstandard").ZstdCompressor(write_content_size=True).compress(body)
            if rng.random() < 0.5:
                frame = lie_content_size(frame, rng.choice([0, len(body) - 1, len(body) + 1]))
            if rng.random() < 0.2:
                frame = zero_frame_then_garbage(rng)
            fields.update(enc="zstd", len=len(frame), raw_len=len(body), digest=env.body_digest(body))
            body = frame
        elif r < 0.55:
            fields = mutate_tree(rng, fields, n=1)
        else:
            body = mutate_body(rng, body)
            if isinstance(fields, dict):  # re-digest, so the body codec's own checks run
                fields.update(len=len(body), raw_len=len(body), digest=env.body_digest(body))
        head = pack_tree(fields)
        return cfg, env.PREFIX.pack(env.MAGIC, env.ENVELOPE_VERSION, len(head)) + head + body

    def decode(inp: Any) -> Any:
        cfg, data = inp
        return contribution_from_bytes(data, cfg, SHAPES, run=RUN, round=7, shard=2)

    return Family(f"contribution-{kind}", make, decode, honest=seeds, check=check_contribution)


def _dense_family() -> Family:
    seeds = [(w, encode_dense(_rng_tensors(3, SHAPES), w)) for w in ("fp32", "bf16", "fp16")]

    def make(rng: random.Random) -> Any:
        wire, data = rng.choice(seeds)
        return wire, mutate_safetensors(rng, data, list(SHAPES))

    return Family("dense-body", make, lambda inp: decode_dense(inp[1], SHAPES, inp[0]), honest=seeds,
                  check=lambda inp, out: finite(out, "dense"))


def _manifest_family() -> Family:
    manifest = Manifest(run_id=RUN, seed=7, model="tiny", tokenizer_hash=SHA, stages=((0, 2), (2, 4)),
                        artifacts=(Artifact("tokenizer.json", SHA, 123),), issued_at=NOW,
                        model_overrides={"d_model": 64, "tie": True})
    seed = encode_manifest(manifest, ID_A)
    return Family("manifest", lambda rng: mutate_sealed(rng, seed, "manifest", ID_A),
                  lambda data: decode_manifest(data, signer=ID_A.peer_id), honest=[seed],
                  check=lambda inp, out: no_newline(out.manifest.run_id, out.manifest.tokenizer_hash,
                                                     *(a.name + a.sha256 for a in out.manifest.artifacts)))


def _announcement_family() -> Family:
    ann = Announcement(run_id=RUN, role="stage", swarm=0, stage=1, throughput=1500.0, bandwidth=2e7, memory_gb=8.0,
                       software="0.1.0", reachability="public", maddrs=("/ip4/127.0.0.1/tcp/4001",), artifacts=(SHA,),
                       manifest_signer=ID_B.peer_id, manifest_digest=SHA, seq=3, issued_at=NOW, expires_at=NOW + 60)
    seed = encode_announcement(ann, ID_A)
    return Family("announcement", lambda rng: mutate_sealed(rng, seed, "announce", ID_A),
                  lambda data: decode_announcement(data, now=NOW, signer=ID_A.peer_id, run_id=RUN), honest=[seed],
                  check=lambda inp, out: no_newline(out.announcement.run_id, *out.announcement.artifacts))


def _roundrecords_family() -> Family:
    notice = ContribNotice(ID_A.peer_id, 5, 4096, {0: SHA, 1: "cd" * 32}, {0: 1000, 1: 2000})
    accepted = AcceptedSet(ID_A.peer_id, 5, ((ID_A.peer_id, 10, {0: SHA}), (ID_B.peer_id, 20, {0: SHA, 3: SHA})),
                           banned=((ID_B.peer_id, 9),))
    accepted = replace(accepted, members=tuple(sorted(accepted.members)))
    checks = ShardChecks(ID_A.peer_id, 5, {0: SHA, 1: SHA}, {0: (1.5, 2.0), 1: (-0.5, 0.0)})
    seeds = [(KIND_CONTRIB, sign(KIND_CONTRIB, notice.to_body(RUN), ID_A), lambda d: parse_contrib(d, ID_A.peer_id,
                                                                                                     RUN, 5)),
             (KIND_ACCEPTED, sign(KIND_ACCEPTED, accepted.to_body(RUN), ID_A),
              lambda d: parse_accepted(d, ID_A.peer_id, RUN, 5)),
             (KIND_CHECKS, sign(KIND_CHECKS, checks.to_body(RUN), ID_A), lambda d: parse_checks(d, ID_A.peer_id, RUN))]

    def make(rng: random.Random) -> Any:
        i = rng.randrange(len(seeds))
        kind, data, _ = seeds[i]
        if rng.random() < 0.2:  # shard keys: non-canonical, non-ASCII digits, duplicates
            items = msgpack.unpackb(data, raw=False)
            body = msgpack.unpackb(items[4], raw=False)
            key = next((k for k in ("digests", "sizes", "checksums", "fingerprints") if k in body), None)
            if key:
                pairs = list(body[key].items())
                k0, v0 = pairs[0]
                bad = rng.choice(["00", "²", "٠", "+0", " 0", "0\n", "256", "1000", "-1", k0])
                body[key] = dup_map([*pairs, (bad, v0)]) if bad == k0 else {**body[key], bad: v0}
                return i, reseal(kind, pack_tree(body), ID_A)
        return i, mutate_sealed(rng, data, kind, ID_A)

    return Family("round-records", make, lambda inp: seeds[inp[0]][2](inp[1]),
                  honest=[(i, s[1]) for i, s in enumerate(seeds)], check=check_records)


def _state_family() -> Family:
    shapes = dict(SHAPES)
    params = _rng_tensors(4, shapes)
    outer = {f"momentum.{n}": torch.randn(s) for n, s in shapes.items()}
    outer["ef.norm.weight"] = torch.randn(130)
    seeds = [encode_state(params, list(shapes), outer), encode_state(params, list(shapes), {})]
    names = [f"o.momentum.{n}" for n in shapes] + [f"o.ef.{n}" for n in shapes] + ["o.momentum.other", "x.y"]

    def decode(blob: bytes) -> Any:
        state = parse_state(blob, shapes)
        if len(inspect.signature(shard_checksum).parameters) < 3:  # before the checksum covered optimizer state
            return shard_checksum(state.params, list(shapes))
        return shard_checksum(state.params, list(shapes), state.outer)

    return Family("state-sync", lambda rng: mutate_safetensors(rng, rng.choice(seeds), names), decode, honest=seeds,
                  check=check_state)


def _activation_family() -> Family:
    d, k, vocab = 32, 8, 300
    basis = subspace_basis(d, k, 0)
    codecs = {"sub": SubspaceCodec("subspace-a", basis, fixed_table(vocab, d, 0)), "dense": DenseCodec(d, "fp32")}
    ids = torch.randint(0, vocab, (2, 5))
    seeds = [("sub", codecs["sub"].encode_forward(torch.randn(2, 5, d), ids)),
             ("sub-b", codecs["sub"].encode_backward(torch.randn(2, 5, d))),
             ("dense", codecs["dense"].encode_forward(torch.randn(2, 5, d), ids)),
             ("dense-b", codecs["dense"].encode_backward(torch.randn(2, 5, d)))]
    fmt = "<4sBBBBQIII"

    def make(rng: random.Random) -> Any:
        which, data = rng.choice(seeds)
        r = rng.random()
        b = bytearray(data)
        if r < 0.4:  # finite values that overflow once decoded, or NaN / inf
            import struct

            value = rng.choice([3.4e38, -3.4e38, 1e38, math.inf, math.nan, 1e30])
            for _ in range(rng.choice([1, 4, 80])):
                i = 28 + 4 * rng.randrange((len(b) - 28) // 4)
                b[i : i + 4] = struct.pack("<f", value)
            return which, bytes(b)
        if r < 0.7:
            import struct

            fields = list(struct.unpack_from(fmt, data))
            j = rng.randrange(1, len(fields))
            fields[j] = rng.choice([0, 1, 2, 3, 4, 255, 2**32 - 1, 2**16, 5, 10, 2**31]) % (
                256 if j <= 4 else 2**64 if j == 5 else 2**32)
            return which, struct.pack(fmt, *fields) + data[28:]
        return which, flip_bytes(rng, data)

    def decode(inp: Any) -> Any:
        which, data = inp
        codec = codecs["sub" if which.startswith("sub") else "dense"]
        out = (codec.decode_backward if which.endswith("-b") else codec.decode_forward)(data, (2, 5))
        spec = codec.backward_spec if which.endswith("-b") else codec.forward_spec
        decode_activations(data, spec)
        return out

    return Family("activations", make, decode, honest=seeds,
                  check=lambda inp, out: finite({"output": out.tensor}, "activation frame"))


def _checkpoint_family() -> Family:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tensors, desc = optimizer_to_tensors(opt)
    tensors.update({f"model.{k}": v for k, v in model.state_dict().items()})
    folder = Path(tempfile.mkdtemp(prefix="hlbp-fuzz-ckpt-"))
    seed_path = folder / "seed.safetensors"
    save_checkpoint(seed_path, tensors, {"step": 1, "tokens": 10, "optimizer": desc, "run": RUN})
    seed = seed_path.read_bytes()
    path = folder / "fuzz.safetensors"

    def make(rng: random.Random) -> bytes:
        if rng.random() < 0.3:  # mutate the hlbp JSON header inside the metadata
            import json

            from mutators import split_safetensors

            header, body = split_safetensors(seed)
            meta = header["__metadata__"]
            inner = json.loads(meta["header"])
            choice = rng.randrange(6)
            if choice == 0:
                meta["header"] = "[" * rng.choice([1000, 100_000])
            elif choice == 1:
                inner["optimizer"]["scalars"] = {rng.choice(["²", "00", "-1", "x", "0"]): {"step": 1}}
            elif choice == 2:
                inner[rng.choice(["step", "tokens", "optimizer"])] = rng.choice([None, "1", -1, 2**70, [], 1.5])
            elif choice == 3:
                meta[rng.choice(["format", "version"])] = rng.choice(["", "2", "hlbp-checkpoint\n"])
            elif choice == 4:
                inner["optimizer"]["param_groups"] = rng.choice([[], None, [{}], "x"])
            else:
                meta["header"] = rng.choice(["null", "1", '"x"', "{" * 3])
            if choice != 0 and choice != 3 and choice != 5:
                meta["header"] = json.dumps(inner)
            from mutators import join_safetensors

            return join_safetensors(header, body)
        return mutate_safetensors(rng, seed, ["optim.0.exp_avg", "optim.².step", "optim.00.step", "model.bias"])

    def decode(data: bytes) -> Any:
        path.write_bytes(data)
        tensors, header = load_checkpoint(path)
        model2 = torch.nn.Linear(4, 3)
        opt2 = torch.optim.AdamW(model2.parameters())
        desc2 = header.get("optimizer")
        if not isinstance(desc2, dict):
            raise UserInputError("no optimizer")
        optimizer_from_tensors(opt2, tensors, desc2)
        return header

    return Family("checkpoint", make, decode, (UserInputError,), honest=[seed])


def _dataplane_family() -> Family:
    seeds = [encode_header({"op": "artifact", "sha256": SHA}), encode_header({"op": "probe", "bytes": 1000}),
             encode_header({"op": "dialback", "maddrs": ["/ip4/1.2.3.4/tcp/1"]}), encode_header({"size": 100}),
             encode_header({"error": "no such artifact"})]

    def make(rng: random.Random) -> bytes:
        data = rng.choice(seeds)
        if rng.random() < 0.7:
            tree = mutate_tree(rng, msgpack.unpackb(data[4:], raw=False), n=rng.choice([1, 2]))
            payload = pack_tree(tree)
            return len(payload).to_bytes(4, "big") + payload
        return flip_bytes(rng, data)

    def decode(data: bytes) -> Any:
        n = header_length(data[:4])
        if len(data) - 4 != n:
            raise ProtocolError("length")
        header = decode_header(data[4:])
        if "op" in header:
            return parse_request(header)
        return parse_body_size(header, 1 << 20)

    return Family("dataplane-header", make, decode, honest=seeds[:-1])  # the last is a refusal by design


def _zstd_family() -> Family:
    import zstandard

    raw = bytes(range(256)) * 20
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(raw)

    def make(rng: random.Random) -> Any:
        r = rng.random()
        if r < 0.2:
            return lie_content_size(frame, rng.choice([0, 1, 63, 64, len(raw) - 1, len(raw) + 1, 2**40])), len(raw)
        if r < 0.3:
            return zero_frame_then_garbage(rng), len(raw)
        if r < 0.4:  # 1 GiB of zeros in 33 KB, where the receiver expects 5 KB
            return zstd_bomb(), len(raw)
        if r < 0.7:
            return recompress(rng, frame), len(raw) + rng.choice([0, 1, 64])
        return flip_bytes(rng, frame), len(raw)

    return Family("zstd-frame", make, lambda inp: decompress_bounded(inp[0], inp[1], "fuzz"),
                  honest=[(frame, len(raw))], check=check_zstd)


def _nesting_family() -> Family:
    """Containers nested about 1000 deep (and more) in every msgpack decoder's input."""
    targets: list[Callable[[bytes], Any]] = [
        lambda b: env.unpack(env.PREFIX.pack(env.MAGIC, env.ENVELOPE_VERSION, len(b)) + b, 1 << 20),
        lambda b: decode_manifest(reseal("manifest", b, ID_A), signer=ID_A.peer_id),
        lambda b: parse_accepted(reseal(KIND_ACCEPTED, b, ID_A), ID_A.peer_id, RUN),
        lambda b: decode_header(b),
        lambda b: decode_manifest(b),
        lambda b: contribution_from_bytes(env.pack(env.EnvelopeHeader(RUN, 7, 2, "p", 1, "sparseloco",
                                                                      {"k": 64, "q": 2, "fmt": "entropy"}), b,
                                                   compress=False), OuterConfig(k=64), SHAPES),
    ]

    def make(rng: random.Random) -> Any:
        depth = rng.choice([100, 511, 1000, 1023, 1024, 1100, 5000, 100_000])
        nest = deep_nesting(depth, rng.choice(["array", "map"]))
        tree = rng.choice([nest, {"run": RUN, "round": nest}, [nest], {"v": 1, "t": [[nest]]}, {"members": nest}])
        return rng.randrange(len(targets)), pack_tree(tree)

    return Family("deep-nesting", make, lambda inp: targets[inp[0]](inp[1]))


FAMILY_BUILDERS: dict[str, Callable[[], Family]] = {
    "contribution-sparse": lambda: _contrib_family("sparse"),
    "contribution-dense": lambda: _contrib_family("dense"),
    "dense-body": _dense_family,
    "manifest": _manifest_family,
    "announcement": _announcement_family,
    "round-records": _roundrecords_family,
    "state-sync": _state_family,
    "activations": _activation_family,
    "checkpoint": _checkpoint_family,
    "dataplane-header": _dataplane_family,
    "zstd-frame": _zstd_family,
    "deep-nesting": _nesting_family,
}

