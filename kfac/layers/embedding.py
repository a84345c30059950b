r"""Embeddings: a Linear on one-hot inputs, with a diagonal `A`.

An `nn.Embedding` with weight `W` of shape `(V, d)` maps token `k` to row
`k` of `W`: `s = Wᵀ e_k`, a Linear layer without bias whose `V` inputs are
one-hot. In the conventions of [`kfac.math`][kfac.math] its `out` is `d`
and its `in` is `V`, so

* the gradient matrix is `V = ∇(Wᵀ) = (∇W)ᵀ`, of shape `(d, V)`: the
  transpose of `weight.grad`;
* `G = (1/N) Σ_n Σ_t g_{n,t} g_{n,t}ᵀ` is a full `(d, d)` matrix, formed
  from the output gradients exactly as a Linear's;
* `A = (1/(N T)) Σ_{n,t} e_{k_{n,t}} e_{k_{n,t}}ᵀ = (1/(N T)) diag(c)` is
  diagonal: `c_k` counts the occurrences of token `k` among the `N T`
  positions of the batch (expand convention: `T` positions per example,
  `N` read from the layout of the input, see `batch_first`).

`A` is a *diagonal factor*
([`KroneckerFactor.diagonal`][kfac.layers.statistics.KroneckerFactor.diagonal]):
its running average, allreduce, decomposition and saved state are vectors
of length `V`; no `(V, V)` matrix is ever formed. Its eigenvectors are the
identity, so EIGEN keeps only its eigenvalues `d_A = a` and applies
`V' = Q_G [(Q_Gᵀ V) / (d_G d_Aᵀ + λ)]`, and INVERSE keeps
`1 / (a + π √λ)` and applies `V' = (G + (√λ/π) I)⁻¹ V diag(1 / (a + π √λ))`
with `tr A / dim A` the mean of `a`. Both are the dense formulas with
`Q_A = I`: the Embedding preconditions exactly as the equivalent Linear
on one-hot inputs would.

`padding_idx`: PyTorch gives the padding row of `W` no gradient, so the
column of `V` for the padding token is zero. Its positions still count
(in `c` and in `N T`), and their output gradients enter `G`: the layer is
the equivalent Linear with the padding token's column frozen. Because `A`
is diagonal the preconditioned gradient's column for that token is zero
as well, so the padding row is never updated.

Not supported (registration leaves the module to the optimizer and says
why, see
[`unsupported_reason`][kfac.layers.embedding.unsupported_reason]):
`max_norm` (the forward pass renormalises rows of `W` in place),
`sparse=True` (sparse gradients) and `scale_grad_by_freq=True` (the
gradient is divided by in-batch token counts, so it is no longer the
gradient the factors describe).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.helper import read_grad

__all__ = [
    'EmbeddingModuleHelper',
    'damped_diagonal_inverse',
    'diagonal_eigen_precondition',
    'diagonal_inverse_precondition',
    'unsupported_reason',
]


def unsupported_reason(module: nn.Embedding) -> str | None:
    """Why K-FAC cannot precondition `module` (None: it can).

    Examples:
        >>> unsupported_reason(nn.Embedding(10, 4, padding_idx=0)) is None
        True
        >>> unsupported_reason(nn.Embedding(10, 4, max_norm=1.0))
        'embedding with max_norm=1.0 (rows renormalised in the forward pass)'
    """
    if module.max_norm is not None:
        return (
            f'embedding with max_norm={module.max_norm} (rows renormalised '
            'in the forward pass)'
        )
    if module.sparse:
        return 'embedding with sparse=True (sparse gradients)'
    if module.scale_grad_by_freq:
        return (
            'embedding with scale_grad_by_freq=True (gradient divided by '
            'in-batch token counts)'
        )
    return None


class EmbeddingModuleHelper(ModuleHelper):
    """Helper for `torch.nn.Embedding`: a Linear on one-hot inputs.

    The factor `A` is diagonal (token counts) and kept as a vector of
    length `V`; `G` is `(d, d)`; the gradient matrix is `(∇W)ᵀ`, shape
    `(d, V)` (see the module docstring). Indices of shape `(N, *positions)`
    hold `N` examples of `prod(positions)` positions each; with
    `batch_first` False indices of two or more dimensions are
    `(T, N, *positions)`. One-dimensional indices are `N` examples of one
    token, a 0-d index one example.

    Args:
        module: the embedding.

    Raises:
        TypeError: `module` is not an `nn.Embedding`.
        ValueError: an option K-FAC does not support is set (see
            [`unsupported_reason`][kfac.layers.embedding.unsupported_reason]).
    """

    module: nn.Embedding

    a_diagonal = True

    def __init__(self, module: nn.Embedding) -> None:
        if not isinstance(module, nn.Embedding):
            raise TypeError(
                f'EmbeddingModuleHelper needs an nn.Embedding; got {module!r}',
            )
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f'K-FAC cannot precondition an {reason}')
        super().__init__(module)

    @property
    def kfac_approx(self) -> str:
        """`'expand'`, the only weight-sharing approximation of an
        embedding.

        *reduce* would average each example's one-hot inputs into token
        frequencies, whose `A` is a dense `(V, V)` matrix.

        Raises:
            ValueError: set to anything else (at registration).
        """
        return 'expand'

    @kfac_approx.setter
    def kfac_approx(self, value: str) -> None:
        if value != 'expand':
            raise ValueError(
                f'kfac_approx={value!r} selects the nn.Embedding '
                f"{self.module}, which supports 'expand' only (its A, "
                'token counts, is diagonal; reduce would make it V x V): '
                "override it with module_options={'Embedding': "
                "{'kfac_approx': 'expand'}}",
            )

    @property
    def in_features(self) -> int:
        """The vocabulary size `V` (the one-hot inputs' length)."""
        return self.module.num_embeddings

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """Shape of `G`: `(d, d)`."""
        dim = self.module.embedding_dim
        return (dim, dim)

    def get_grad(self, grads: Grads | None = None) -> torch.Tensor | None:
        """Return `V = (∇W)ᵀ` of shape `(d, V)` (a view of `weight.grad`).

        None when the weight has no gradient in this step.
        """
        wgrad = read_grad(self.weight, grads)
        return None if wgrad is None else wgrad.T

    def set_grad(
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        """Write `V` of shape `(d, V)` (times `scale`) into `weight.grad`,
        transposed.
        """
        super().set_grad(grad.T, scale, grads)

    def a_statistic(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, int]:
        """Return `(c, number of positions)`: the token counts `c` of shape
        `(V,)`, the diagonal of `Σ e eᵀ` over every index of the input.

        Args:
            layer_input: the indices (any integer shape).
            dtype: dtype of the counts (at least float32).
        """
        indices = layer_input.detach().reshape(-1)
        # Not torch.bincount: on CUDA it reads the largest index on the
        # host. Sums of ones are exact in any order (below 2**24 in float32).
        counts = torch.zeros(
            self.in_features, dtype=dtype, device=indices.device
        )
        ones = torch.ones(indices.shape, dtype=dtype, device=indices.device)
        return counts.index_add_(0, indices, ones), indices.numel()

    def a_columns(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        """Not available: the one-hot columns are never formed (`A` is
        diagonal, see
        [`a_statistic`][kfac.layers.embedding.EmbeddingModuleHelper.a_statistic]).
        """
        raise NotImplementedError('an embedding forms A from token counts')

    def g_columns(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(dtype)
        return (rows * scale if scale != 1.0 else rows).T

    def _examples_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """The indices `(N, T)` or output gradient `(N, T, d)` of a
        tensor in the module's layout.
        """
        n = self.batch_size(tensor)
        if self._index_dims(tensor) > 1 and not self.batch_first:
            tensor = tensor.transpose(0, 1)
        if tensor.is_floating_point():
            return tensor.reshape(n, -1, tensor.shape[-1])
        return tensor.reshape(n, -1)

    def a_example_rows(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The tokens of each example and position, `(N, T)`: the
        inputs are one-hot.
        """
        return self._examples_first(layer_input.detach())

    def g_example_rows(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        rows = self._examples_first(grad_output.detach()).to(dtype)
        return rows * scale if scale != 1.0 else rows

    def _index_dims(self, tensor: torch.Tensor) -> int:
        """Dimensions that index tokens: all of the (integer) indices',
        all but the last (`d`) of an output gradient's.
        """
        return tensor.dim() - int(tensor.is_floating_point())

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        dims = self._index_dims(tensor)
        if dims > 1 and not self.batch_first:
            return tensor.shape[1]
        return tensor.shape[0] if dims > 0 else 1

    def positions(self, tensor: torch.Tensor) -> int:
        """Weight-sharing positions `T` per example of the indices or of an
        output gradient.
        """
        tokens = math.prod(tensor.shape[: self._index_dims(tensor)])
        return tokens // self.batch_size(tensor)


# Diagonal factors: pure tensor functions ---------------------------------


def diagonal_eigen_precondition(
    grad: torch.Tensor,
    qg: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Return `Q_G [(Q_Gᵀ V) ⊙ scale]`.

    [`eigen_precondition`][kfac.math.eigen_precondition] with `Q_A = I`
    (a diagonal `A`): with `scale = 1 / (d_G d_Aᵀ + λ)` this is
    `(A ⊗ G + λ I)⁻¹ vec(V)` reshaped to `V`'s shape.

    Args:
        grad: `V`, shape `(out, in)`.
        qg: `Q_G`, shape `(out, out)`.
        scale: shape `(out, in)`.
    """
    v = qg.T @ grad
    v.mul_(scale)
    return qg @ v


def damped_diagonal_inverse(
    diagonal: torch.Tensor,
    shift: float | torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(1 / (a + shift), ok)`: the inverse of the damped diagonal
    factor `diag(a) + shift · I`, as a vector, computed in `dtype`.

    Args:
        diagonal: `a`, shape `(n,)`, non-negative.
        shift: positive shift (a float or a 0-d tensor).
        dtype: the dtype to compute in.

    Returns:
        The inverse's diagonal `(n,)`, and a 0-d bool tensor (no host
            synchronisation): whether the damped factor was positive
            definite and finite.
    """
    damped = diagonal.to(dtype) + shift
    ok = ((damped > 0) & torch.isfinite(damped)).all()
    return damped.reciprocal_(), ok


def diagonal_inverse_precondition(
    grad: torch.Tensor,
    a_inv: torch.Tensor,
    g_inv: torch.Tensor,
) -> torch.Tensor:
    """Return `G⁻¹ V diag(a_inv)`.

    [`inverse_precondition`][kfac.math.inverse_precondition] with a
    diagonal `A⁻¹`, given as its diagonal.

    Args:
        grad: `V`, shape `(out, in)`.
        a_inv: the diagonal of `A⁻¹`, shape `(in,)`.
        g_inv: `G⁻¹`, shape `(out, out)`.
    """
    return (g_inv @ grad).mul_(a_inv)
