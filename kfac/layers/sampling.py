"""Factor statistics on a sample of each example's weight-sharing positions.

A Linear on `(N, T, d)` inputs and a convolution (`T` output positions of
its unfolded patches) see every example `T` times. With the per-module
option `position_sample` (see
[`ModuleOptions`][kfac.layers.options.ModuleOptions]) `A` and `G` are
formed from `k ≤ T` positions `S_n` of each example `n`, drawn uniformly
without replacement, the same `S_n` for `A` and `G`:

* `A = (1/(N k)) Σ_n Σ_{t∈S_n} ã_{n,t} ã_{n,t}ᵀ` (the rows counted are the
  `N k` drawn ones),
* `G = (1/N) Σ_n (T/k) Σ_{t∈S_n} g_{n,t} g_{n,t}ᵀ` (each `g` scaled by
  `√(T/k)`; `loss_average='batch+sequence'` divides by `N T` as without
  sampling),

so that each equals the full-position (*expand*) factor in expectation
over the draws. The cost of forming them falls from `O(N T d²)` to
`O(N k d²)` per factor (a convolution's patches are still unfolded whole).
`position_sample` is a count (an `int` `k ≥ 1`: `min(k, T)` positions) or a
fraction (a `float` `f` in `(0, 1]`: `⌈f T⌉` positions); a call with
`k ≥ T` uses every position and is today's statistic exactly. It applies
under `kfac_approx='expand'` only (under *reduce* an example's positions
are summed before the outer product, which a sample would bias), and to
Linear layers (attention projections included) and convolutions, not to
embeddings (whose `A` is token counts).

The draw is a counter-based generator, keyed so that `W` ranks draw what
one process draws: the positions of an example depend only on the seed,
the step and the example's *global index* `r N_r + i` (the `i`-th example
of rank `r`, which holds `N_r` examples of the call, the ranks' batches
concatenated in rank order). With [`mix`][kfac.layers.sampling.mix], an
integer hash on `[0, P)`, `P = 2³¹ - 1`,
an example's key is `e = mix(mix(mix(0, seed), step mod P), index mod P)`,
its position `t` gets `mix(e, t) · T + t` (distinct for distinct `t`), and
`S_n` is the `k` positions with the smallest values. The micro-batches of
one step and the several calls of a shared module draw the same positions
for the same example index. The seed (`position_sample_seed`) is saved in
the preconditioner's `state_dict()`; the step is its step count, so a
resumed run draws what the uninterrupted run draws. The draw runs on the
data's device and reads nothing back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kfac.validation import type_error
from kfac.validation import validate_float
from kfac.validation import validate_int

MODULUS = 2**31 - 1
"""`P`, the prime modulus of the keyed generator's arithmetic."""

_ROUNDS = ((48271, 13), (69621, 11), (16807, 15), (39373, 12))
"""`(multiplier, shift)` of each round of [`mix`][kfac.layers.sampling.mix]."""


def check_position_sample(value: object) -> int | float | None:
    """Return `position_sample` if allowed: None, an int `≥ 1` (a count)
    or a float in `(0, 1]` (a fraction of the positions).

    Raises:
        TypeError: neither None, an int nor a float.
        ValueError: out of range.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(
            'position_sample',
            value,
            'None, an int >= 1 (positions per example) or a float in '
            '(0, 1] (a fraction of them)',
        )
    if isinstance(value, int):
        return validate_int('position_sample', value)
    return validate_float('position_sample', value, low=0.0, high=1.0)


def check_seed(value: object) -> int:
    """Return `position_sample_seed` if it is an int in `[0, P)`.

    Raises:
        TypeError: not an int.
        ValueError: out of range.
    """
    value = validate_int('position_sample_seed', value, minimum=0)
    if value >= MODULUS:
        raise ValueError(
            f'position_sample_seed must be < 2**31 - 1; got {value}',
        )
    return value


def sample_size(option: int | float, positions: int) -> int:
    """Positions drawn per example of `positions`: `min(k, T)` for a
    count `k`, `min(⌈f T⌉, T)` for a fraction `f`.
    """
    if isinstance(option, int):
        return min(option, positions)
    return min(math.ceil(option * positions), positions)


def mix(h: torch.Tensor, v: torch.Tensor | int) -> torch.Tensor:
    """One step of the keyed generator: fold `v` into the state `h`.

    `u = h ^ v`, then four rounds `u = (u · m + 11) mod P`,
    `u = u ^ (u >> s)` with `(m, s)` = `(48271, 13)`, `(69621, 11)`,
    `(16807, 15)`, `(39373, 12)` and `P = 2³¹ - 1`. Entries of `h` and
    `v` are integers in `[0, P)` (int64); every intermediate stays below
    `2⁶³`, so the result is the same on every device and in plain Python
    integers.
    """
    u = h ^ v
    for multiplier, shift in _ROUNDS:
        u = torch.remainder(u * multiplier + 11, MODULUS)
        u = u ^ (u >> shift)
    return u


def draw_positions(
    seed: int, step: int, indices: torch.Tensor, positions: int, k: int
) -> torch.Tensor:
    """The positions drawn for examples of global indices `indices`.

    Args:
        seed: the seed, in `[0, P)`.
        step: the step count.
        indices: `(n,)` int64 global example indices.
        positions: `T`.
        k: positions per example, `1 ≤ k ≤ T`.

    Returns:
        `(n, k)` int64, each row ascending.
    """
    start = torch.zeros_like(indices)
    key = mix(mix(start, seed), step % MODULUS)
    key = mix(key, torch.remainder(indices, MODULUS))
    t = torch.arange(positions, device=indices.device)
    order = mix(key[:, None], t[None, :]) * positions + t
    drawn = torch.topk(order, k, dim=1, largest=False, sorted=False).indices
    return drawn.sort(dim=1).values


class SampleKey:
    """Where draws read their key, shared by a model's samplers.

    Args:
        source: gives `(seed, step)` when a statistic is computed.
        rank: this process's data-parallel rank (see the module docstring
            for the global example index).

    The draws of the current `(seed, step)` are kept: every layer with the
    same examples and positions (and the `A` and `G` of one call) uses the
    same positions, drawn once per step.
    """

    def __init__(
        self,
        source: Callable[[], tuple[int, int]] = lambda: (0, 0),
        rank: int = 0,
    ) -> None:
        self.source = source
        self.rank = rank
        self._drawn: dict[tuple[object, ...], torch.Tensor] = {}
        self._at: tuple[int, int] | None = None

    def positions(
        self,
        first: int,
        count: int,
        positions: int,
        k: int,
        device: torch.device,
    ) -> torch.Tensor:
        """`(count, k)` drawn positions of the examples of global indices
        `first` to `first + count` (see
        [`draw_positions`][kfac.layers.sampling.draw_positions]).
        """
        at = self.source()
        if at != self._at:
            self._drawn.clear()
            self._at = at
        key = (first, count, positions, k, device)
        drawn = self._drawn.get(key)
        if drawn is None:
            indices = torch.arange(first, first + count, device=device)
            drawn = draw_positions(*at, indices, positions, k)
            self._drawn[key] = drawn
        return drawn


class PositionSampler:
    """Draws the positions of one module's factor statistics.

    Args:
        option: `position_sample` (a count or a fraction).
        key: where the seed, step and rank are read.
    """

    def __init__(self, option: int | float, key: SampleKey) -> None:
        check_position_sample(option)
        self.option = option
        self.key = key

    def __repr__(self) -> str:
        return f'PositionSampler({self.option!r})'

    def select(
        self,
        rows: torch.Tensor,
        *,
        examples: int,
        dim: int,
        batch: int,
        first: int = 0,
    ) -> tuple[torch.Tensor, float]:
        """The drawn positions of `rows` and `T/k`.

        Args:
            rows: examples `first` to `first + n` of a call of `batch`
                examples along dimension `examples`, positions along `dim`.
            examples: the examples' dimension.
            dim: the positions' dimension.
            batch: the call's local examples `N_r`.
            first: the local index of the first example of `rows`.

        Returns:
            `rows` with the `k` drawn positions along `dim` (`rows` itself
                when `k = T`), and `T/k`.
        """
        positions = rows.shape[dim]
        k = sample_size(self.option, positions)
        if k == positions:
            return rows, 1.0
        n = rows.shape[examples]
        base = self.key.rank * batch + first
        drawn = self.key.positions(base, n, positions, k, rows.device)
        if dim == examples + 1:  # whole rows: one index_select
            flat = (
                drawn
                + torch.arange(n, device=rows.device)[:, None] * positions
            )
            merged = rows.flatten(examples, dim)
            chosen = merged.index_select(examples, flat.reshape(-1))
            return chosen.unflatten(examples, (n, k)), positions / k
        view = [1] * rows.dim()
        view[examples], view[dim] = n, k
        size = list(rows.shape)
        size[dim] = k
        index = drawn.reshape(view).expand(size)
        return rows.gather(dim, index), positions / k


def select_positions(
    sampler: PositionSampler | None,
    rows: torch.Tensor,
    *,
    examples: int,
    dim: int,
    batch: int,
    first: int = 0,
) -> tuple[torch.Tensor, float]:
    """`sampler.select(...)`, or `(rows, 1.0)` without a sampler."""
    if sampler is None:
        return rows, 1.0
    return sampler.select(
        rows, examples=examples, dim=dim, batch=batch, first=first
    )
