"""A LLaMA-style decoder (RoPE, RMSNorm, SwiGLU, causal SDPA) that splits into pipeline stages.

The whole model is itself a :class:`Stage` that covers every layer. ``split`` builds stages whose parameter names
are exactly the whole model's names (``embed.weight``, ``blocks.3.attn.wq.weight``, ``head.weight``), so a shard
of the SparseLoCo round means the same tensors on a full replica and on a stage peer, and a stage can load its
slice of a full state dict directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.basis import fixed_table, project_rows, project_writer, subspace_basis
from hlbp.peer.model.ops import cross_entropy, head_cross_entropy, rms_norm, swiglu_down


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. Every peer of a run builds the same config from the run manifest."""

    vocab_size: int = 8192  # set from the run's tokenizer; the presets' values are what the default one has
    d_model: int = 128  # residual stream width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads; d_model must divide evenly
    d_ff: int = 352  # SwiGLU hidden width (about 8/3 of d_model, rounded to a multiple of 32)
    max_seq_len: int = 128  # longest context; RoPE tables are built for this length
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every weight matrix
    # Exact subspace network, variant A of docs/algorithms.md §3 (hlbp.peer.model.subspace); subspace_rank = 0 is the plain
    # model. The residual stream is T_fixed[x] + (something in span(U)) up to the last constrained block, so stage
    # boundaries there can be sent as k values per token without loss.
    subspace_rank: int = 0  # k: U is d_model x k; the embedding and every write of a constrained block use U·Uᵀ
    subspace_layers: int | None = None  # leading blocks under the constraint (before the last stage); None: all
    subspace_seed: int = 0  # seed of U and T_fixed (the run's): every peer rebuilds both, nobody sends them
    subspace_table_std: float = 1.0  # std of the entries of the frozen token table T_fixed
    subspace_out_gain: float = 1.0  # fixed gain of the norm on constrained sublayers' outputs
    subspace_drift: bool = False  # drift absorption: the embedding's off-span part enters as a constant (T_⊥)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise UserInputError(f"model config: {name} must be a positive integer, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise UserInputError(
                f"model config: d_model={self.d_model} must split into {self.n_heads} heads of even width"
            )
        if not 0 <= self.subspace_rank <= self.d_model:
            raise UserInputError(f"model config: subspace_rank must be in 0..{self.d_model}, got {self.subspace_rank}")
        if self.subspace_layers is not None and not 0 <= self.subspace_layers <= self.n_layers:
            raise UserInputError(f"model config: subspace_layers must be in 0..{self.n_layers}")
        if not (self.subspace_table_std >= 0 and self.subspace_out_gain > 0):
            raise UserInputError("model config: subspace_table_std must be >= 0 and subspace_out_gain > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def constrained_layers(self) -> int:
        """How many leading blocks write only into span(U): 0 for the plain model."""
        if not self.subspace_rank:
            return 0
        return self.n_layers if self.subspace_layers is None else self.subspace_layers

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed, e.g. ``vocab_size`` from the tokenizer."""
        return dataclasses.replace(self, **changes)


# Sizes with the default 8k vocabulary; the 125m and larger presets are for GPU users with a 50k vocabulary.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=8192, d_model=128, n_layers=4, n_heads=4, d_ff=352, max_seq_len=128),
    "small": ModelConfig(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, d_ff=1376, max_seq_len=256),
    "125m": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=1024),
    "350m": ModelConfig(vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, max_seq_len=1024),
    "1b": ModelConfig(vocab_size=50304, d_model=2048, n_layers=18, n_heads=16, d_ff=5632, max_seq_len=2048),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """The named preset with optional field overrides; unknown names raise :class:`UserInputError`."""
    if name not in PRESETS:
        raise UserInputError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        return PRESETS[name].replace(**overrides)
    except TypeError as exc:
        raise UserInputError(f"bad model override for preset {name!r}: {exc}") from None


class FixedNorm(nn.Module):
    """RMS normalisation times one fixed scalar: unlike per-channel gains it maps span(U) into itself."""

    def __init__(self, gain: float, eps: float) -> None:
        super().__init__()
        self.gain, self.eps = gain, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, None, self.eps, self.gain)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 so that bf16 autocast does not lose the mean-square.
        return rms_norm(x, self.weight, self.eps)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_seq_len, head_dim / 2]."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x [batch, heads, seq, head_dim] by position."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        d = config.d_model
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, basis: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        wo = self.wo.weight if basis is None else project_writer(self.wo.weight, basis)
        return F.linear(y, wo)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)  # up
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)  # down: writes the residual stream

    def forward(self, x: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
        w2 = self.w2.weight if basis is None else project_writer(self.w2.weight, basis)
        return swiglu_down(self.w1(x), self.w3(x), w2)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)).

    A constrained block (variant A) writes U·Uᵀ·W_O and U·Uᵀ·W_2 outputs, each normalised with a fixed gain, so
    whatever it adds to the residual stream lies in span(U).
    """

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = FeedForward(config)
        self.constrained = index < config.constrained_layers
        if self.constrained:
            self.out_norm = FixedNorm(config.subspace_out_gain, config.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, basis: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.constrained:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.ffn(self.ffn_norm(x))
        x = x + self.out_norm(self.attn(self.attn_norm(x), cos, sin, basis))
        return x + self.out_norm(self.ffn(self.ffn_norm(x), basis))


class Stage(nn.Module):
    """Blocks ``[start, end)`` of the decoder; the first stage adds the embedding, the last the norm and head.

    Input: token ids [batch, seq] on the first stage, else hidden states [batch, seq, d_model].
    Output: logits [batch, seq, vocab] on the last stage, else hidden states.

    ``recompute`` (off by default; a peer's own choice, ``hlbp join --recompute``) keeps only each block's input for
    the backward and runs the block's forward again there: the activations inside the blocks are not held from the
    forward to the backward, for about one more forward of compute. The gradients are the same bits on the CPU.
    """

    def __init__(self, config: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= config.n_layers:
            raise UserInputError(f"stage layers [{start}, {end}) do not fit a {config.n_layers}-layer model")
        self.config = config
        self.start, self.end = start, end
        self.recompute = False
        self.is_first, self.is_last = start == 0, end == config.n_layers
        if self.is_first:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        # Keyed by the global block index so parameter names match the whole model's.
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.subspace_rank:
            # Rebuilt from the seed on every peer, never trained, saved or sent: not part of the state dict.
            basis = subspace_basis(config.d_model, config.subspace_rank, config.subspace_seed)
            self.register_buffer("subspace_basis", basis, persistent=False)
            if self.is_first:
                table = fixed_table(config.vocab_size, config.d_model, config.subspace_seed, config.subspace_table_std)
                self.register_buffer("fixed_table", table, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init (:func:`init_std_of`) from torch's global generator; a run's peers start from
        :func:`seed_parameters` instead."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, init_std_of(self.config, name))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: embed[x], or T_fixed[x] + embed[x]·U·Uᵀ in the subspace network.

        Under drift absorption the embedding's part outside span(U) belongs to the fixed table (T_⊥ = T_fixed +
        embed − embed·U·Uᵀ, rebuilt by the codecs after every outer step): it is added, but as a constant, so
        only the in-span part T_S = embed·U·Uᵀ trains, as in variant A.
        """
        e = self.embed(ids)
        if not self.config.subspace_rank:
            return e
        trained = project_rows(e, self.subspace_basis)
        if self.config.subspace_drift:
            trained = trained + (e - trained).detach()
        return trained + self.fixed_table[ids].to(e.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._blocks(x)
        return self.head(self.norm(x)) if self.is_last else x

    def loss_of(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Last stage: ``loss(forward(x), targets)`` without the logits held for the backward or made whole
        (:func:`hlbp.peer.model.ops.head_cross_entropy`); what a training step calls."""
        if not self.is_last:
            raise ValueError("only the last stage has a loss")
        return head_cross_entropy(self.norm(self._blocks(x)), self.head.weight, targets)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed_tokens(x)
        if x.shape[1] > self.config.max_seq_len:
            raise UserInputError(f"sequence of {x.shape[1]} tokens exceeds max_seq_len={self.config.max_seq_len}")
        basis = getattr(self, "subspace_basis", None)
        recompute = self.recompute and torch.is_grad_enabled()
        for block in self.blocks.values():
            if recompute:
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, basis, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin, basis)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; only meaningful on the last stage."""
        return cross_entropy(logits, targets)


class _Part(nn.Module):
    """One step of a stage's forward pass, on the stage's own modules (registered under ``stage.``)."""

    def __init__(self, stage: Stage, run: Callable[[Stage, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.stage, self._run = stage, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.stage, x)


def forward_parts(stage: Stage) -> list[tuple[nn.Module, list[str]]]:
    """``stage``'s forward pass as steps in order (the embedding, each block, the norm and head), each with the
    names of the stage parameters it reads. Run one after another with ``torch.func.functional_call`` on each
    step's parameters alone (keyed ``"stage." + name``), they give :meth:`Stage.forward`'s result bit for bit
    while a caller holds one block's parameters at a time: how a replica scores parameters it reads from a store
    or computes on demand, beside a model in training (hlbp.peer.train.trainer.evaluate_params)."""

    def names(prefix: str) -> list[str]:
        return [prefix + n for n, _ in stage.get_submodule(prefix[:-1]).named_parameters()]

    def first(s: Stage, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > s.config.max_seq_len:
            raise UserInputError(f"sequence of {x.shape[1]} tokens exceeds max_seq_len={s.config.max_seq_len}")
        return s.embed_tokens(x) if s.is_first else x

    def block(i: str) -> Callable[[Stage, torch.Tensor], torch.Tensor]:
        return lambda s, x: s.blocks[i](x, s.rope_cos, s.rope_sin, getattr(s, "subspace_basis", None))

    parts = [(_Part(stage, first), names("embed.") if stage.is_first else [])]
    parts += [(_Part(stage, block(i)), names(f"blocks.{i}.")) for i in stage.blocks]
    if stage.is_last:
        parts.append((_Part(stage, lambda s, x: s.head(s.norm(x))), names("norm.") + names("head.")))
    return parts


def build_model(config: ModelConfig) -> Stage:
    """The whole decoder: one stage spanning every layer."""
    return Stage(config, 0, config.n_layers)


def partition(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges for ``n_stages`` stages, as even as possible.

    Earlier stages get the extra layer when the split is uneven; the last stage already carries the head.
    """
    if not 1 <= n_stages <= n_layers:
        raise UserInputError(f"cannot split {n_layers} layers into {n_stages} stages; use 1..{n_layers}")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def layer_macs(config: ModelConfig, seq_len: int) -> int:
    """Multiply-accumulates per token of one block's forward: the four attention projections, the gated
    feed-forward's three matrices, and the attention's scores and weighted sum over ``seq_len`` positions."""
    d = config.d_model
    return 4 * d * d + 3 * d * config.d_ff + 2 * seq_len * d


def head_macs(config: ModelConfig) -> int:
    """Multiply-accumulates per token of the LM head's forward (the final norm and the loss are small beside it)."""
    return config.d_model * config.vocab_size


def compute_shares(config: ModelConfig, bounds: Sequence[tuple[int, int]], seq_len: int) -> list[float]:
    """Each stage's fraction of the whole model's multiply-accumulates per token (its blocks, and the head on the
    last stage): what turns a stage's tokens/s into the whole model's. On the tiny preset split 2 + 2 the last stage
    does 0.77 of the work (measured: 28 of 39 ms per micro-batch's forward and backward), where its share of the
    layers says 0.5."""
    layer, head = layer_macs(config, seq_len), head_macs(config)
    total = config.n_layers * layer + head
    return [((end - start) * layer + (head if end == config.n_layers else 0)) / total for start, end in bounds]


def balanced_partition(config: ModelConfig, n_stages: int, seq_len: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges whose slowest stage is as fast as it can be, counting the head the last stage holds.

    A pipeline runs at its slowest stage's pace, and the even split gives the last stage its layers plus the LM
    head: on the tiny preset the head costs about five blocks (``d_model * vocab`` against ``4 d^2 + 3 d d_ff``
    multiply-accumulates per token), so with two stages the last one did 2.6 times the first's work. Here the last
    stage takes ``n`` layers and the others share the rest as evenly as :func:`partition` does; ``n`` minimises
    the largest stage's multiply-accumulates (backward costs about twice the forward on every stage alike), and
    among equal maxima the lighter last stage wins. With a head that costs nothing this is :func:`partition`."""
    if not 1 <= n_stages <= config.n_layers:
        raise UserInputError(f"cannot split {config.n_layers} layers into {n_stages} stages; use 1..{config.n_layers}")
    if n_stages == 1:
        return [(0, config.n_layers)]
    layer, head = layer_macs(config, seq_len), head_macs(config)

    def slowest(n_last: int) -> int:
        return max(-(-(config.n_layers - n_last) // (n_stages - 1)) * layer, n_last * layer + head)

    n_last = min(range(1, config.n_layers - n_stages + 2), key=lambda n: (slowest(n), n))
    front = partition(config.n_layers - n_last, n_stages - 1)
    return [*front, (config.n_layers - n_last, config.n_layers)]


def split(
    config: ModelConfig, n_stages: int, bounds: list[tuple[int, int]] | None = None
) -> list[Stage]:
    """Build the stages of a pipeline; ``bounds`` (from the run manifest) overrides the even partition."""
    bounds = bounds if bounds is not None else partition(config.n_layers, n_stages)
    if len(bounds) != n_stages or bounds[0][0] != 0 or bounds[-1][1] != config.n_layers or any(
        a[1] != b[0] for a, b in itertools.pairwise(bounds)
    ):
        raise UserInputError(f"stage partition {bounds} must tile layers 0..{config.n_layers} contiguously")
    return [Stage(config, a, b) for a, b in bounds]


WRITERS = ("attn.wo.weight", "ffn.w2.weight")  # the matrices that write the residual stream


def init_std_of(config: ModelConfig, name: str) -> float:
    """GPT-2 style: N(0, init_std), residual writers scaled by 1/sqrt(2 * n_layers)."""
    return config.init_std / math.sqrt(2 * config.n_layers) if name.endswith(WRITERS) else config.init_std


def seeded_parameter(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The run's initial value of parameter ``name`` (ones for norm gains, else :func:`init_std_of`), drawn from a
    generator keyed by (seed, name) alone: any stage, or any one tensor, is built on its own bit for bit as it
    is in the whole model, so a stage peer never builds the layers it does not hold."""
    if len(shape) == 1:
        return torch.ones(shape)
    key = int.from_bytes(hashlib.sha256(f"hlbp-init|{seed}|{name}".encode()).digest()[:8], "big") >> 1
    return torch.empty(shape).normal_(0.0, init_std_of(config, name), generator=torch.Generator().manual_seed(key))


@torch.no_grad()
def seed_parameters(stage: Stage, seed: int) -> None:
    """Set every parameter of ``stage`` to the run's initial value (:func:`seeded_parameter`)."""
    for name, p in stage.named_parameters():
        p.copy_(seeded_parameter(stage.config, name, tuple(p.shape), seed))


def load_from_full(stage: Stage, full_state: dict[str, torch.Tensor]) -> None:
    """Copy this stage's slice of a whole-model state dict into the stage (names are shared)."""
    stage.load_state_dict({k: full_state[k] for k in stage.state_dict()}, strict=True)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def gradient_bytes(config: ModelConfig, bounds: Sequence[tuple[int, int]]) -> list[int]:
    """The bytes of each stage's float32 gradient (its trained parameters), from stages built on the meta device:
    exact, and nothing allocated, so a driver knows what a trade between the peers of any stage moves."""
    with torch.device("meta"):
        stages = [Stage(config, a, b) for a, b in bounds]
    return [4 * sum(p.numel() for p in stage.parameters() if p.requires_grad) for stage in stages]
