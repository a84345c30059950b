"""Dense, independent references for the K-FAC quantities.

Nothing here imports ``kfac``: each function computes its quantity from the
definition (DESIGN.md §3) with explicit loops, slicing, ``torch.kron`` and
``torch.linalg.solve``, so the library is checked against a second,
differently written computation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    """``(R, n)`` rows with a trailing column of ones."""
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)


def linear_factors(
    x: torch.Tensor,
    grad_output: torch.Tensor,
    *,
    bias: bool,
    reduction: str = 'mean',
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` of a Linear from its input and output gradient.

    ``x`` is ``(N, *positions, in)`` and ``grad_output`` ``(N, *positions,
    out)``: expand convention, ``A`` averaged over all rows, ``G`` summed
    over positions and averaged over examples, ``g = N · grad_output`` for
    the mean reduction.
    """
    n = x.shape[0]
    a_rows = x.reshape(-1, x.shape[-1])
    if bias:
        a_rows = with_ones(a_rows)
    a = sum(torch.outer(r, r) for r in a_rows) / a_rows.shape[0]
    scale = n if reduction == 'mean' else 1
    g_rows = grad_output.reshape(-1, grad_output.shape[-1]) * scale
    g = sum(torch.outer(r, r) for r in g_rows) / n
    return a, g  # type: ignore[return-value]  # sums of tensors are tensors


def conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches of a Conv2d by explicit slicing, ``(N, L, C·kh·kw)``.

    Padding (numeric or ``'same'``/``'valid'``, any ``padding_mode``),
    stride and dilation are applied by hand; positions are in row-major
    output order.
    """
    kh, kw = conv.kernel_size
    dh, dw = conv.dilation
    sh, sw = conv.stride
    if isinstance(conv.padding, str):
        same = conv.padding == 'same'
        th, tw = dh * (kh - 1) * same, dw * (kw - 1) * same
        pad = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    else:
        ph, pw = conv.padding
        pad = (pw, pw, ph, ph)
    mode = 'constant' if conv.padding_mode == 'zeros' else conv.padding_mode
    xp = F.pad(x, pad, mode=mode)
    out_h = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    patches = []
    for i in range(out_h):
        for j in range(out_w):
            window = xp[
                :,
                :,
                i * sh : i * sh + dh * (kh - 1) + 1 : dh,
                j * sw : j * sw + dw * (kw - 1) + 1 : dw,
            ]
            patches.append(window.reshape(x.shape[0], -1))
    return torch.stack(patches, dim=1)


def conv_factors(
    conv: nn.Conv2d,
    x: torch.Tensor,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` of a Conv2d: a Linear on patches with shared positions."""
    patches = conv_patches(conv, x)
    g = grad_output.permute(0, 2, 3, 1)  # (N, H', W', out)
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    return linear_factors(patches, g, bias=conv.bias is not None)


def grad_matrix(module: nn.Module) -> torch.Tensor:
    """``[∇W, ∇b]`` of a Linear or Conv2d, ``(out, in[+1])``."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor) and weight.grad is not None
    v = weight.grad.reshape(weight.shape[0], -1)
    bias = module.bias
    if isinstance(bias, torch.Tensor):
        assert bias.grad is not None
        v = torch.cat([v, bias.grad[:, None]], 1)
    return v


def vec(v: torch.Tensor) -> torch.Tensor:
    """Column-stacking ``vec``."""
    return v.T.reshape(-1)


def unvec(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`vec`."""
    return x.reshape(shape[1], shape[0]).T


def eigen_reference(
    a: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """``(A ⊗ G + λ I)⁻¹ vec(V)`` by a dense solve."""
    k = torch.kron(a, g)
    k = k + damping * torch.eye(k.shape[0], dtype=k.dtype)
    return unvec(torch.linalg.solve(k, vec(v)), (v.shape[0], v.shape[1]))


def inverse_reference(
    a: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """``((A + π√λ I) ⊗ (G + √λ/π I))⁻¹ vec(V)`` by a dense solve."""
    pi = ((a.trace() / a.shape[0]) / (g.trace() / g.shape[0])).sqrt()
    root = damping**0.5
    ad = a + pi * root * torch.eye(a.shape[0], dtype=a.dtype)
    gd = g + root / pi * torch.eye(g.shape[0], dtype=g.dtype)
    k = torch.kron(ad, gd)
    return unvec(torch.linalg.solve(k, vec(v)), (v.shape[0], v.shape[1]))


def per_example_fisher(
    model: nn.Module,
    module_name: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """Exact ``E_n[vec(∇ℓ_n) vec(∇ℓ_n)ᵀ]`` of one module, with ``torch.func``.

    ``vec`` stacks the columns of ``[∇W, ∇b]``.
    """
    params = {k: p.detach() for k, p in model.named_parameters()}
    wkey, bkey = f'{module_name}.weight', f'{module_name}.bias'

    def loss(
        p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor
    ) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (xi[None],))
        return loss_fn(out, yi[None])

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
        params,
        x,
        y,
    )
    w = grads[wkey].reshape(x.shape[0], grads[wkey].shape[1], -1)
    if bkey in grads:
        w = torch.cat([w, grads[bkey][:, :, None]], dim=2)
    vecs = w.transpose(1, 2).reshape(x.shape[0], -1)
    fisher: torch.Tensor = vecs.T @ vecs / x.shape[0]
    return fisher


def layer_factors(
    x: torch.Tensor,
    grad_output: torch.Tensor,
    *,
    bias: bool,
    loss_average: str | None = 'batch',
    approx: str = 'expand',
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` from the definitions of ``kfac.math``, by explicit loops.

    ``x`` is ``(N, T, in)`` and ``grad_output`` ``(N, T, out)``: example
    ``n``'s ``T`` weight-sharing positions. ``approx='expand'``: one row per
    position; ``'reduce'``: one row per example, inputs averaged and output
    gradients summed over its positions. ``loss_average``: ``'batch'``
    (``g = N grad``, ``G`` averaged over ``N``), ``'batch+sequence'``
    (``g = N T grad``, averaged over ``N T``) or ``None`` (``g = grad``,
    ``G`` summed).
    """
    n, t = x.shape[0], x.shape[1]
    if approx == 'expand':
        a_rows = [x[i, j] for i in range(n) for j in range(t)]
    else:
        a_rows = [x[i].mean(0) for i in range(n)]
    if bias:
        a_rows = [torch.cat([r, r.new_ones(1)]) for r in a_rows]
    a = torch.stack([torch.outer(r, r) for r in a_rows]).sum(0) / len(a_rows)
    terms = {None: 1, 'batch': n, 'batch+sequence': n * t}[loss_average]
    if approx == 'expand':
        g_rows = [
            terms * grad_output[i, j] for i in range(n) for j in range(t)
        ]
    else:
        g_rows = [terms * grad_output[i].sum(0) for i in range(n)]
    g = torch.stack([torch.outer(r, r) for r in g_rows]).sum(0) / terms
    return a, g


def conv_patches_nd(
    conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: torch.Tensor
) -> torch.Tensor:
    """Input patches of a 1-, 2- or 3-D convolution by explicit slicing,
    ``(N, positions, C·Π k)``, positions in row-major output order.
    """
    kernel = conv.kernel_size
    dilation, stride = conv.dilation, conv.stride
    dims = len(kernel)
    pad: list[int] = []
    for d in reversed(range(dims)):
        if isinstance(conv.padding, str):
            total = dilation[d] * (kernel[d] - 1) * (conv.padding == 'same')
            pad += [total // 2, total - total // 2]
        else:
            pad += [conv.padding[d], conv.padding[d]]
    mode = 'constant' if conv.padding_mode == 'zeros' else conv.padding_mode
    xp = F.pad(x, pad, mode=mode)
    out = [
        (xp.shape[2 + d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1
        for d in range(dims)
    ]
    patches = []
    for position in itertools.product(*(range(o) for o in out)):
        window = tuple(
            slice(
                p * stride[d],
                p * stride[d] + dilation[d] * (kernel[d] - 1) + 1,
                dilation[d],
            )
            for d, p in enumerate(position)
        )
        patches.append(
            xp[(slice(None), slice(None), *window)].reshape(len(x), -1)
        )
    return torch.stack(patches, dim=1)


def per_example_grads(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``∇ℓ_n`` of every parameter, ``(N, *shape)``, with ``torch.func``.

    ``ℓ_n = loss_fn(model(x[n:n+1]), y[n:n+1])``: the loss of example ``n``
    alone (examples along dimension 0 of ``x`` and ``y``).
    """
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(
        p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor
    ) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (xi[None],))
        return loss_fn(out, yi[None])

    grads: dict[str, torch.Tensor] = torch.func.vmap(
        torch.func.grad(loss), in_dims=(None, 0, 0)
    )(params, x, y)
    return grads


def ekfac_scale_reference(
    grads: torch.Tensor,
    qg: torch.Tensor,
    qa: torch.Tensor,
    terms: int,
) -> torch.Tensor:
    """``(1/terms) Σ_n (Q_Gᵀ V_n Q_A)²`` by a loop over the examples.

    ``grads`` is ``(N, out, in)``: each example's gradient matrix ``V_n``;
    ``terms`` is 1 for a summed loss.
    """
    total = torch.zeros(grads.shape[1:], dtype=grads.dtype)
    for v in grads:
        rotated = qg.T @ v @ qa
        total += rotated * rotated
    return total / terms


# The Monte Carlo Fisher's sampling rule (kfac.math.fisher), in plain Python.

MASK64 = (1 << 64) - 1


def py_splitmix64(z: int) -> int:
    """splitmix64 on Python integers (unsigned)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def py_uniform(seed: int, step: int, index: int, counter: int) -> float:
    """The uniform of draw `counter` of example `index`: the top 53 bits
    of the hash chain seed, step, index, counter, over 2**53.
    """
    key = py_splitmix64((py_splitmix64(seed) + step) & MASK64)
    key = py_splitmix64((key + index) & MASK64)
    return (py_splitmix64((key + counter) & MASK64) >> 11) / 2.0**53


def py_class(row: list[float], u: float) -> int:
    """The first class whose cumulative probability exceeds `u` (the last
    if none does).
    """
    total = 0.0
    for c, p in enumerate(row):
        total += p
        if total > u:
            return c
    return len(row) - 1


def py_classes(
    probs: torch.Tensor, seed: int, step: int, indices: list[int], sample: int
) -> list[int]:
    """One class per row of `probs` `(N, C)` (one position per example)."""
    return [
        py_class(row, py_uniform(seed, step, index, sample))
        for row, index in zip(probs.tolist(), indices)
    ]


def lowrank_plus_constant(f: torch.Tensor, rank: int) -> torch.Tensor:
    """``Q_k diag(d_k) Q_kᵀ + c (I - Q_k Q_kᵀ)`` as a dense matrix: the
    ``rank`` largest eigenpairs of ``f`` (from ``torch.linalg.eigh``) and
    ``c = (tr F - Σ d_k) / (n - k)``; ``f`` itself when ``rank >= n``.
    """
    n = f.shape[0]
    if rank >= n:
        return f
    d, q = torch.linalg.eigh(f)
    qk, dk = q[:, n - rank :], d[n - rank :]
    c = max(float((f.trace() - dk.sum()) / (n - rank)), 0.0)
    eye = torch.eye(n, dtype=f.dtype)
    dense: torch.Tensor = qk @ torch.diag(dk) @ qk.T + c * (eye - qk @ qk.T)
    return dense


def mean_eigenvalue(f: torch.Tensor) -> float:
    """``tr F / dim F``."""
    return float(f.trace()) / f.shape[0]
