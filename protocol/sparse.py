"""SparseLoCo compression of one tensor: chunked top-k plus 2-bit quantisation (docs/algorithms.md §1).

This module is the numeric half of the codec: it turns a dense float tensor into a :class:`SparseTensor` and back.
The wire formats live in :mod:`hlbp.protocol.indexcodec` and :mod:`hlbp.protocol.shard`.

Chunking (a pure function of shape and ``k``, so sender and receiver derive the same layout and it is never sent):

- A tensor with two or more dims is viewed as 2-D ``[shape[0], numel // shape[0]]`` and cut into tiles. The tile
  side along each dim is 64 when the dim is a multiple of 64, else the largest divisor of the dim that is <= 64
  (the reference behaviour). A chunk is one tile, flattened row-major, so an index is ``row_in_tile * tile_cols +
  col_in_tile``. A prime dim > 64 gets tile side 1, so e.g. a ``97 x 64`` weight is cut into 97 chunks of 64.
- A 0-D or 1-D tensor is cut into contiguous chunks of 4096; the last one may be shorter.
- ``k`` is stated per 4096 values. A chunk of ``C`` values keeps ``k_eff = clamp((k * C + 2048) // 4096, 1, C)``
  values: the density stays ``k / 4096`` while every chunk keeps at least one value. Very small chunks (a 1 x 1 tile
  from two prime dims, the tail of a 1-D tensor) therefore keep a larger fraction, up to all of their values. That
  costs little because such tensors are rare and small, and it keeps the layout identical to the reference.

Quantisation (per tensor, over the selected values ``v``, computed in float64): ``shift = mean(v)``, ``c = v -
shift``, ``scale = 1.5 * std(c)`` (population std, so a single value is well defined), ``q = clamp(round(c / scale
+ 2), 0, 3)``, and a lookup table holding the mean of the actual ``c`` in each bin (an empty bin gets its nominal
centre ``(q - 2) * scale``). Table and shift are stored as float32 and the reconstruction is ``table[q] + shift``
evaluated in float32, on the sender (for error feedback) and on every receiver alike, so all of them agree bit for
bit. When ``std(c)`` is 0 (all selected values equal, or a single one) every code is 2 and the table is exact.

With ``quant_bits=None`` the selected values travel as float32: that mode exists to measure what the 2-bit
quantiser costs, so it must not add a second rounding of its own.

Small tensors (the run's ``small_tensors`` rule, :func:`tensor_k`): under ``"topk"`` every tensor keeps ``k`` per
4096, so a 512-value norm weight sends 8 of its values per round at k = 64. Under ``"dense"`` a 1-D tensor, or any
tensor no larger than one chunk, keeps all of its values (k = 4096, still 2-bit), as the production codec does.
The rule is part of the run's codec: a receiver derives each tensor's k from its shape and refuses any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

from hlbp.protocol.manifest import SMALL_TENSOR_RULES

CHUNK_SIZE = 4096
"""Values per full chunk: a 64 x 64 tile or a 4096-long run of a 1-D tensor."""
BLOCK_VALUES = 1 << 20
"""Values of a host tensor :func:`compress` ranks at a time (4 MiB of float32 magnitudes)."""
TILE_SIDE = 64
"""Largest tile side along each dim of a 2-D view."""
DEFAULT_K = 64
"""Values kept per 4096 (1.56 % density), the reference default."""
QUANT_LEVELS = 4
"""Number of 2-bit codes and of entries in the lookup table."""
SCALE_SIGMAS = 1.5
"""Bin width in units of std(c): 4 bins of 1.5 sigma cover a 6 sigma range."""


@dataclass(frozen=True)
class ChunkGroup:
    """A run of equally sized chunks that keep the same number of values each."""

    n_chunks: int  # chunks in this run
    chunk_size: int  # values per chunk (<= 4096, so an index fits in 12 bits)
    k: int  # values kept per chunk

    @property
    def nnz(self) -> int:
        """Number of values this run keeps."""
        return self.n_chunks * self.k


@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of a given shape is cut into chunks; derived from (shape, k) alone."""

    shape: tuple[int, ...]  # shape of the original tensor
    tile: tuple[int, int] | None  # (rows, cols) of one tile for tensors with >= 2 dims, None for 1-D chunking
    cols: int  # columns of the 2-D view (numel // shape[0]); 0 for 1-D chunking
    groups: tuple[ChunkGroup, ...]  # 2-D: one group of tiles; 1-D: full chunks, then the shorter tail

    @property
    def nnz(self) -> int:
        """Number of values kept in the whole tensor."""
        return sum(g.nnz for g in self.groups)

    @property
    def numel(self) -> int:
        """Number of values of the dense tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def largest_divisor_at_most(n: int, limit: int = TILE_SIDE) -> int:
    """Largest divisor of ``n`` that is <= ``limit``: the tile side the reference uses for a dim of size ``n``."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def kept_per_chunk(k: int, chunk_size: int) -> int:
    """Values kept in a chunk of ``chunk_size`` when ``k`` are kept per 4096: density ``k/4096``, at least one."""
    return max(1, min(chunk_size, (k * chunk_size + CHUNK_SIZE // 2) // CHUNK_SIZE))


def tensor_k(shape: tuple[int, ...], k: int, small_tensors: str = "topk") -> int:
    """The k (per 4096) that a tensor of ``shape`` is sent with in a run with ``k`` and rule ``small_tensors``.

    ``"dense"`` sends a 1-D tensor, or one of at most :data:`CHUNK_SIZE` values, whole (k = 4096): norm weights
    and biases are a tiny share of the values but are starved by a per-chunk top-k of about 1.5 %.
    """
    if small_tensors not in SMALL_TENSOR_RULES:
        raise ValueError(f"small_tensors must be one of {SMALL_TENSOR_RULES}, got {small_tensors!r}")
    if small_tensors == "dense":
        numel = 1
        for d in shape:
            numel *= int(d)
        if len(shape) <= 1 or numel <= CHUNK_SIZE:
            return CHUNK_SIZE
    return k


def transmitted_fraction(shape: tuple[int, ...], k: int, small_tensors: str = "topk") -> float:
    """Share of a tensor's values sent each round (nnz / numel) under ``k`` and ``small_tensors``."""
    layout = chunk_layout(tuple(shape), tensor_k(tuple(shape), k, small_tensors))
    numel = sum(g.n_chunks * g.chunk_size for g in layout.groups)
    return layout.nnz / numel if numel else 0.0


@lru_cache(maxsize=4096)
def chunk_layout(shape: tuple[int, ...], k: int = DEFAULT_K) -> ChunkLayout:
    """The chunking of a tensor of ``shape`` with ``k`` kept values per 4096 (see the module docstring).

    Raises ValueError for a ``k`` outside 1..4096 or a negative dim; callers that parse untrusted input check both
    before calling.
    """
    shape = tuple(int(d) for d in shape)
    if not 1 <= k <= CHUNK_SIZE:
        raise ValueError(f"k must be in 1..{CHUNK_SIZE}, got {k}")
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dim in shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return ChunkLayout(shape, None, 0, ())
    if len(shape) >= 2:
        rows, cols = shape[0], numel // shape[0]
        tr, tc = largest_divisor_at_most(rows), largest_divisor_at_most(cols)
        size = tr * tc
        group = ChunkGroup((rows // tr) * (cols // tc), size, kept_per_chunk(k, size))
        return ChunkLayout(shape, (tr, tc), cols, (group,))
    full, tail = divmod(numel, CHUNK_SIZE)
    groups = []
    if full:
        groups.append(ChunkGroup(full, CHUNK_SIZE, kept_per_chunk(k, CHUNK_SIZE)))
    if tail:
        groups.append(ChunkGroup(1, tail, kept_per_chunk(k, tail)))
    return ChunkLayout(shape, None, 0, tuple(groups))


def _chunk_views(flat: torch.Tensor, layout: ChunkLayout) -> list[torch.Tensor]:
    """The chunks of each group as ``[n_chunks, chunk_size]`` tensors (a copy for tiles, views for 1-D)."""
    if layout.tile is not None:
        tr, tc = layout.tile
        rows, cols = layout.shape[0], layout.cols
        tiles = flat.view(rows // tr, tr, cols // tc, tc).permute(0, 2, 1, 3)
        return [tiles.reshape(-1, tr * tc)]
    out, start = [], 0
    for g in layout.groups:
        end = start + g.n_chunks * g.chunk_size
        out.append(flat[start:end].view(g.n_chunks, g.chunk_size))
        start = end
    return out


def _chunk_blocks(flat: torch.Tensor, layout: ChunkLayout, block_values: int
                  ) -> Iterator[tuple[ChunkGroup, torch.Tensor]]:
    """The chunks of each group, in layout order, as ``[n, chunk_size]`` blocks of about ``block_values`` values or
    fewer (at least one tile row, or one chunk): the same chunks :func:`_chunk_views` gives, so that a per-chunk
    top-k over the blocks is the one over the whole, with the copies and magnitudes it makes bounded by a block."""
    if layout.tile is not None:
        (g,) = layout.groups
        tr, tc = layout.tile
        rows, cols = layout.shape[0], layout.cols
        tiles = flat.view(rows // tr, tr, cols // tc, tc).permute(0, 2, 1, 3)
        step = max(1, block_values // (tr * cols))  # tile rows per block
        for i in range(0, rows // tr, step):
            yield g, tiles[i:i + step].reshape(-1, tr * tc)
        return
    for g, chunks in zip(layout.groups, _chunk_views(flat, layout)):
        step = max(1, block_values // g.chunk_size)
        for i in range(0, g.n_chunks, step):
            yield g, chunks[i:i + step]


def flat_positions(layout: ChunkLayout, indices: torch.Tensor) -> torch.Tensor:
    """Positions in the flattened tensor (int64) of chunk-local ``indices`` laid out chunk after chunk."""
    idx = indices.to(torch.int64)
    if layout.tile is not None:
        (g,) = layout.groups
        tr, tc = layout.tile
        chunk = torch.arange(idx.numel(), dtype=torch.int64, device=idx.device) // g.k
        tiles_per_row = layout.cols // tc
        row = (chunk // tiles_per_row) * tr + idx // tc
        col = (chunk % tiles_per_row) * tc + idx % tc
        return row * layout.cols + col
    parts, start, base = [], 0, 0
    for g in layout.groups:
        part = idx[start : start + g.nnz]
        chunk = torch.arange(g.nnz, dtype=torch.int64, device=idx.device) // g.k
        parts.append(base + chunk * g.chunk_size + part)
        start += g.nnz
        base += g.n_chunks * g.chunk_size
    return torch.cat(parts) if parts else idx


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """A compressed tensor: the kept positions of each chunk and their (quantised) values.

    ``indices`` are chunk-local (0..chunk_size-1), strictly increasing within each chunk, chunks in layout order, so
    the form is canonical: equal inputs give equal fields. Exactly one of (``codes`` and ``table``) or ``values`` is
    set.
    """

    shape: tuple[int, ...]  # shape of the dense tensor
    k: int  # values kept per 4096
    indices: torch.Tensor  # int16 [nnz], chunk-local positions
    codes: torch.Tensor | None = None  # uint8 [nnz] in 0..3 when quantised
    table: torch.Tensor | None = None  # float32 [4], mean of the centred values in each bin
    shift: float = 0.0  # mean of the selected values, exactly representable in float32
    values: torch.Tensor | None = None  # float32 [nnz] when not quantised

    @property
    def layout(self) -> ChunkLayout:
        """The chunk layout implied by shape and k."""
        return chunk_layout(self.shape, self.k)

    @property
    def quantized(self) -> bool:
        """True when values are carried as 2-bit codes plus a lookup table."""
        return self.codes is not None

    @property
    def nnz(self) -> int:
        """Number of kept values."""
        return int(self.indices.numel())

    def flat_indices(self) -> torch.Tensor:
        """Positions of the kept values in the flattened dense tensor (int64), for scatter-style aggregation."""
        return flat_positions(self.layout, self.indices)

    def dense_values(self) -> torch.Tensor:
        """The reconstructed float32 value at each kept position: ``table[code] + shift`` or the raw value."""
        if self.codes is not None:
            assert self.table is not None
            shift = torch.tensor(self.shift, dtype=torch.float32, device=self.table.device)
            return self.table[self.codes.to(torch.int64)] + shift
        assert self.values is not None
        return self.values


def _quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """2-bit codes, float32 lookup table and float32-exact shift for the selected values ``v`` (float32)."""
    dev = v.device
    if v.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=dev), torch.zeros(QUANT_LEVELS, device=dev), 0.0
    v64 = v.to(torch.float64)
    shift = v64.mean()
    c = v64 - shift
    scale = SCALE_SIGMAS * c.std(correction=0)
    nominal = (torch.arange(QUANT_LEVELS, dtype=torch.float64, device=dev) - 2) * scale
    if scale > 0:
        q = torch.clamp(torch.round(c / scale + 2), 0, QUANT_LEVELS - 1).to(torch.int64)
    else:
        q = torch.full_like(c, 2, dtype=torch.int64)
        nominal = torch.zeros(QUANT_LEVELS, dtype=torch.float64, device=dev)
    counts = torch.bincount(q, minlength=QUANT_LEVELS).to(torch.float64)
    sums = torch.bincount(q, weights=c, minlength=QUANT_LEVELS)
    table = torch.where(counts > 0, sums / counts.clamp(min=1), nominal)
    fmax = torch.finfo(torch.float32).max
    table32 = table.clamp(-fmax, fmax).to(torch.float32)
    shift32 = float(shift.clamp(-fmax, fmax).to(torch.float32))
    return q.to(torch.uint8), table32, shift32


def compress(t: torch.Tensor, k: int = DEFAULT_K, quant_bits: int | None = 2, *,
             block_values: int = BLOCK_VALUES) -> SparseTensor:
    """Chunked top-k of ``t`` by magnitude, then 2-bit quantisation (``quant_bits=2``) or none (``None``).

    ``t`` may have any shape, float dtype and device; it is read as float32 and not modified, and the result lives
    on the same device. The caller keeps error feedback with ``e -= decompress(compress(e))``: that is exactly
    what every receiver reconstructs, so only the quantisation residual and the unsent values stay in ``e``.
    Raises ValueError for a non-finite input, since no receiver would accept it. ``block_values``: how many values
    a host tensor's chunks are ranked in at a time (the result does not depend on it).
    """
    if quant_bits not in (2, None):
        raise ValueError(f"quant_bits must be 2 or None, got {quant_bits}")
    shape = tuple(t.shape)
    layout = chunk_layout(shape, k)
    flat = t.detach().reshape(-1).to(torch.float32)
    idx_parts, val_parts = [], []
    # on the host, a block of chunks at a time: a top-k per chunk is the same over blocks as over the whole, and
    # the magnitudes (and a matrix's tiles) it makes are then a block's, not the tensor's (the largest parameter's
    # three float32 copies were part of a full replica's round peak)
    blocks = (_chunk_blocks(flat, layout, block_values) if flat.device.type == "cpu"
              else ((g, c) for g, c in zip(layout.groups, _chunk_views(flat, layout))))
    for g, chunks in blocks:
        pos = torch.topk(chunks.abs(), g.k, dim=1, sorted=False).indices
        pos = pos.sort(dim=1).values
        val_parts.append(chunks.gather(1, pos).reshape(-1))
        idx_parts.append(pos.reshape(-1).to(torch.int16))
    indices = torch.cat(idx_parts) if idx_parts else torch.zeros(0, dtype=torch.int16, device=t.device)
    vals = torch.cat(val_parts) if val_parts else torch.zeros(0, dtype=torch.float32, device=t.device)
    # top-k ranks NaN and inf above every finite magnitude, so checking the kept values checks the whole input
    if not bool(torch.isfinite(vals).all()):
        raise ValueError("cannot compress a tensor with NaN or inf values")
    if quant_bits is None:
        return SparseTensor(shape, k, indices, values=vals.contiguous())
    codes, table, shift = _quantize(vals)
    return SparseTensor(shape, k, indices, codes=codes, table=table, shift=shift)


def decompress(s: SparseTensor) -> torch.Tensor:
    """Dense float32 reconstruction of ``s`` with its original shape, on its device; zero where nothing was kept."""
    layout = s.layout
    out = torch.zeros(layout.numel, dtype=torch.float32, device=s.indices.device)
    if s.nnz:
        out[s.flat_indices()] = s.dense_values()
    return out.view(s.shape)


def payload_bits_formula(numel: int, k: int = DEFAULT_K, index_bits: int = 12, value_bits: int = 2) -> float:
    """Nominal wire cost of the body in bits: ``numel / 4096 * k * (index_bits + value_bits)`` (docs/algorithms.md §1).

    It ignores headers and the rounding of per-chunk k; :func:`hlbp.protocol.shard.packed12_size` gives the exact
    byte count of a packed12 shard.
    """
    return numel / CHUNK_SIZE * k * (index_bits + value_bits)
