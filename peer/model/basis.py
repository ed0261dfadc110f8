"""The shared subspace of docs/algorithms.md §3: the basis U, the anchor table T_fixed and projections onto span(U).

Pure linear algebra that every peer computes identically from the run's seed. The decoder uses it to keep variant
A's residual-stream writers in span(U); the activation codecs in :mod:`hlbp.peer.model.subspace` use it at every
stage boundary. It imports nothing of hlbp.peer but the user-facing error type, so both can import it.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from hlbp.peer.common.errors import UserInputError

_BASIS_SALT, _TABLE_SALT = 0x5B5, 0x7AB  # distinct streams for U and T_fixed from one run seed


def resolve_rank(rank: str | float, d_model: int) -> int:
    """k from a ratio of d_model ("1/32", 0.125) or an absolute count ("16", 16); at least 1, at most d_model."""
    text = str(rank).strip()
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise UserInputError(f"subspace rank {rank!r} is neither a ratio like 1/32 nor a whole number") from None
    if "/" in text or 0 < value < 1:
        k = max(1, round(d_model * value))
    elif value.denominator == 1:
        k = int(value)
    else:
        raise UserInputError(f"subspace rank {rank!r} is neither a ratio like 1/32 nor a whole number")
    if not 1 <= k <= d_model:
        raise UserInputError(f"subspace rank {rank!r} gives k={k}, outside 1..d_model={d_model}")
    return k


def subspace_basis(d_model: int, k: int, seed: int) -> torch.Tensor:
    """U [d_model, k], float32 with orthonormal columns: QR of a seeded Gaussian, identical on every peer.

    QR runs in float64 on the CPU from a seeded CPU generator, and the signs are fixed so that R has a positive
    diagonal, which makes the factor unique: different LAPACK builds can then differ only in rounding.
    """
    if not 1 <= k <= d_model:
        raise ValueError(f"k must be in 1..{d_model}, got {k}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + _BASIS_SALT)
    q, r = torch.linalg.qr(torch.randn(d_model, k, generator=g, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).float().contiguous()


def fixed_table(vocab_size: int, d_model: int, seed: int, std: float = 1.0) -> torch.Tensor:
    """T_fixed [vocab_size, d_model]: a frozen Gaussian table of full rank, rebuilt from the seed by every peer."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + _TABLE_SALT)
    return (torch.randn(vocab_size, d_model, generator=g) * std).contiguous()


def project_rows(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x·U·Uᵀ: each d_model-vector of x (last dimension) projected onto span(U)."""
    u = basis.to(x)
    return (x @ u) @ u.T


def project_writer(weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """U·Uᵀ·W for a writer weight W [d_model, in]: its outputs then lie in span(U)."""
    u = basis.to(weight)
    return u @ (u.T @ weight)


def off_span(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x − x·U·Uᵀ: what the subspace cannot carry."""
    return x - project_rows(x, basis)
