r"""The Monte Carlo Fisher: targets sampled from the model's predictive
distribution, reproducibly.

With `fisher_type='mc'` the output gradients that form `G` are those of
the loss on targets `ŷ` drawn from the distribution the loss is the
negative log-likelihood of, not on the labels (Martens & Grosse 2015,
§5). For the loss `L = (1/Z) Σ_z ℓ_z` over `Z` terms (see `loss_average`
in [`kfac.math`][kfac.math]), `E_ŷ[∇ℓ ∇ℓᵀ] = H`, the Hessian of one term
with respect to the model output `f`, so that `G` estimates
`(1/Z) Σ_z J_zᵀ H_z J_z` (`J_z = ∂f_z/∂s`), the `G` of the
Gauss-Newton matrix, whatever the labels:

| loss | distribution of `ŷ` | `H` |
| --- | --- | --- |
| cross-entropy, classes last | `Categorical(softmax(f))` | `diag(p) − p pᵀ` |
| mean squared error | `N(f, σ² I)`, `σ² = E / 2` | `(2 / E) I` |

`E` is the number of output elements of one term (`D` for `(N, D)`
outputs averaged over the batch; a summed loss, `loss_average=None`, has
`σ² = 1/2`). Label smoothing and class weights change the loss but not
the model's distribution: the Fisher does not depend on the targets, so
the sampled loss is plain cross-entropy. Positions outside `mask`
(`ignore_index`) are left out as `F.cross_entropy` leaves them out.

Reproducibility: every random number is a pure function of
`(seed, step, global example index, counter)`, a splitmix64 hash
(Steele et al., OOPSLA 2014) of the four, so an example gets the same
targets on whichever rank it lands and with any batch split. The counter
of draw `d` (0, or 0 and 1 for the two uniforms of a Box–Muller normal)
at position `t` of sample `s` is `(s P + t) D + d` (`P` positions of an
example, `D` draws per position). A uniform is the top 53 bits of the
hash over `2⁵³`; a class is the first whose cumulative probability
(float64) exceeds it; a normal is `√(−2 ln(1 − u₁)) cos(2π u₂)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypedDict

import torch
import torch.nn.functional as F

__all__ = [
    'gaussian_noise',
    'mc_loss',
    'sample_classes',
    'splitmix64',
    'uniforms',
]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """`value` modulo 2⁶⁴ as a signed 64-bit integer."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 `z` (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 step on int64 `z`, wrapping modulo 2⁶⁴.

    Examples:
        >>> splitmix64(torch.tensor([0])).item() == -2152535657050944081
        True
    """
    z = z + _GOLDEN
    z = (z ^ _shift(z, 30)) * _MUL1
    z = (z ^ _shift(z, 27)) * _MUL2
    return z ^ _shift(z, 31)


def uniforms(
    seed: int,
    step: int,
    indices: torch.Tensor,
    sample: int,
    positions: int,
    draws: int,
) -> torch.Tensor:
    """Uniforms in `[0, 1)` of shape `(N, positions, draws)`, float64.

    Args:
        seed: the generator's seed.
        step: the preconditioner's step.
        indices: the global indices of the `N` examples, int64 `(N,)`.
        sample: the sample number `s` (of `mc_samples`).
        positions: `P`, positions per example.
        draws: `D`, draws per position.
    """
    device = indices.device
    base = splitmix64(splitmix64(torch.tensor(seed, device=device)) + step)
    keys = splitmix64(base + indices.to(torch.int64))
    offset = sample * positions * draws
    counters = torch.arange(offset, offset + positions * draws, device=device)
    bits = splitmix64(keys[:, None] + counters)
    scaled = _shift(bits, 11).to(torch.float64) * 2.0**-53
    return scaled.reshape(len(indices), positions, draws)


def sample_classes(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Classes drawn from `softmax(logits)` by inverse transform.

    Args:
        logits: `(M, C)`.
        u: uniforms `(M,)` in `[0, 1)`.

    Returns:
        int64 `(M,)`: the first class whose cumulative probability exceeds
            `u` (the last class if rounding leaves none).
    """
    cdf = torch.softmax(logits.detach().to(torch.float64), -1).cumsum(-1)
    below = (cdf < u.to(cdf.device)[:, None]).sum(-1)
    return below.clamp(max=logits.shape[-1] - 1)


def gaussian_noise(u: torch.Tensor) -> torch.Tensor:
    """Standard normals `√(−2 ln(1 − u₁)) cos(2π u₂)` from `u` `(..., 2)`."""
    radius = torch.sqrt(-2.0 * torch.log1p(-u[..., 0]))
    return radius * torch.cos((2.0 * math.pi) * u[..., 1])


def mc_loss(
    output: torch.Tensor,
    loss: str,
    u: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    terms: int | None,
) -> torch.Tensor:
    """The loss of `output` at targets sampled with the uniforms `u`.

    Args:
        output: `(N, ..., C)` logits (classes last) or any `(N, ...)`
            regression output.
        loss: `'cross_entropy'` or `'mse'`.
        u: `(N, P, D)` uniforms (`P` the positions of an example: output
            elements for `'mse'` with `D = 2`, else `D = 1`).
        mask: `(N, ...)` bool, the positions that count
            (cross-entropy only), or None (all).
        terms: the number of terms `Z` the loss averages over (a mean
            over the counted positions, as PyTorch's), or None (summed).

    Returns:
        The scalar loss, in float32 at least.
    """
    reduction = 'sum' if terms is None else 'mean'
    wide = output.float() if output.dtype.itemsize < 4 else output
    if loss == 'mse':
        elements = output.numel() // terms if terms is not None else 1
        noise = gaussian_noise(u).reshape(output.shape) * math.sqrt(
            elements / 2
        )
        target = (wide.detach() + noise.to(wide.device, wide.dtype)).detach()
        return F.mse_loss(wide, target, reduction=reduction)
    flat = wide.reshape(-1, output.shape[-1])
    target = sample_classes(flat, u.reshape(-1))
    if mask is not None:
        target = target.masked_fill(~mask.reshape(-1).to(target.device), -100)
    return F.cross_entropy(flat, target, reduction=reduction)


class FisherState(TypedDict):
    """The Monte Carlo Fisher's settings."""

    fisher_type: str
    mc_samples: int
    mc_seed: int


def parse_fisher(state: object) -> FisherState | None:
    """The `'fisher'` entry of `state`, checked; None if it has none (or
    `state` is no mapping, which `parse_state` refuses).

    Raises:
        ValueError: the entry is malformed.
    """
    entry = state.get('fisher') if isinstance(state, Mapping) else None
    if entry is None:
        return None
    if not (
        isinstance(entry, Mapping)
        and entry.get('fisher_type') in ('empirical', 'mc')
        and all(
            type(entry.get(key)) is int and entry[key] >= low
            for key, low in (('mc_samples', 1), ('mc_seed', 0))
        )
    ):
        raise ValueError(
            "state_dict entry 'fisher' must be {'fisher_type': one of "
            "('empirical', 'mc'), 'mc_samples': int >= 1, "
            f"'mc_seed': int >= 0}}; "
            f'got {entry!r}',
        )
    return {
        'fisher_type': entry['fisher_type'],
        'mc_samples': entry['mc_samples'],
        'mc_seed': entry['mc_seed'],
    }
