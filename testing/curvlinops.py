"""Kronecker factors from curvlinops, a second and independent oracle.

`curvlinops-for-pytorch` (pinned in `requirements-dev.txt`, a test-only
dependency) computes K-FAC's factors with its own hooks, patch extraction
and loss scaling. :func:`curvlinops_factors` returns them in our layout
(`tests/system/test_curvlinops.py` documents how the two libraries' options
map); :func:`kfac_factors` returns ours after one step on the same batch.

curvlinops ships no type information (no `py.typed` marker): its names are
`Any`, and only in this module.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kfac.preconditioner import KFACPreconditioner

with warnings.catch_warnings():
    # curvlinops imports linear_operator, which calls torch.jit.script at
    # import time: deprecated in torch 2.13, and not ours to fix.
    warnings.filterwarnings(
        'ignore', '`torch.jit.script` is deprecated', DeprecationWarning
    )
    # No py.typed marker in curvlinops: mypy cannot analyse the import.
    from curvlinops import EKFACLinearOperator  # type: ignore[import-untyped]  # curvlinops has no py.typed
    from curvlinops import KFACLinearOperator

#: `{module name: (A, G)}`.
Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]


def curvlinops_factors(
    model: nn.Module,
    loss_func: nn.MSELoss | nn.CrossEntropyLoss,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    num_per_example_loss_terms: int,
    kfac_approx: str = 'expand',
    fisher_type: str = 'empirical',
) -> Factors:
    """A and G of every Linear and Conv2d of `model`, from curvlinops.

    By default the empirical Fisher (`fisher_type='empirical'`: the
    gradients of `loss_func` at the labels `y`; `'type-2'` is the exact
    Fisher, from the loss's Hessian) on the one batch `(x, y)`, with the
    bias as the last row and column of A (`separate_weight_and_bias=False`,
    as ours). The model is copied: curvlinops' hooks never see ours.

    Args:
        model: the model (its outputs are what `loss_func` takes; for
            cross-entropy on sequences, `(N, C, T)`).
        loss_func: the loss; its `reduction` is curvlinops' only notion of
            how the loss is normalised.
        fisher_type: curvlinops' `fisher_type`.
        x: the inputs, `(N, ...)`.
        y: the labels.
        num_per_example_loss_terms: curvlinops' `P`: with
            `reduction='mean'` it multiplies G by `N P` times the outer
            products of the gradients of the mean loss (ignored for
            `'sum'`). Passed explicitly: inferring it costs a pass over the
            data and picks the number of loss terms per example.
        kfac_approx: `'expand'` or `'reduce'`.

    Returns:
        `{module name: (A, G)}`.

    """
    clone = copy.deepcopy(model)
    params = [p for p in clone.parameters() if p.requires_grad]
    operator: Any = KFACLinearOperator(
        clone,
        loss_func,
        params,
        [(x, y)],
        check_deterministic=False,
        fisher_type=fisher_type,
        kfac_approx=kfac_approx,
        num_per_example_loss_terms=num_per_example_loss_terms,
        separate_weight_and_bias=False,
        num_data=x.shape[0],
    )
    operator.compute_kronecker_factors()
    # The state dict is curvlinops' public view of its factors, keyed by
    # module name like ours.
    state: dict[str, Any] = operator.state_dict()
    a: dict[str, torch.Tensor] = state['input_covariances']
    g: dict[str, torch.Tensor] = state['gradient_covariances']
    assert a.keys() == g.keys(), (sorted(a), sorted(g))
    return {name: (a[name], g[name]) for name in a}


def kfac_factors(
    model: nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    **options: Any,
) -> Factors:
    """Our A and G of every registered layer after one step on `(x, y)`.

    The first factor update is the batch's factors (no running average
    yet). The preconditioner is detached afterwards (`remove()`).

    Args:
        model: the model.
        loss: `loss(model(x), y)` is the scalar that is backpropagated.
        x: the inputs.
        y: the labels.
        **options: keyword arguments of `KFACPreconditioner`
            (`loss_reduction`, ...); `kl_clip` is None.

    Returns:
        `{module name: (A, G)}`.

    """
    precon = KFACPreconditioner(model, relative_clip=None, **options)
    loss(model(x), y).backward()
    precon.step()
    precon.remove()
    out: Factors = {}
    for name, layer in precon.layers.items():
        a, g = layer.a.value, layer.g.value
        assert a is not None and g is not None, name
        out[name] = (a, g)
    return out


def curvlinops_ekfac_products(
    model: nn.Module,
    loss_func: nn.CrossEntropyLoss,
    x: torch.Tensor,
    y: torch.Tensor,
    vectors: list[torch.Tensor],
    *,
    num_per_example_loss_terms: int,
    kfac_approx: str = 'expand',
) -> list[torch.Tensor]:
    """The EKFAC matrix of curvlinops (empirical Fisher, weight and bias
    together) applied to `vectors`, one per trained parameter of `model`
    in `parameters()` order and of its shape.
    """
    clone = copy.deepcopy(model)
    params = [p for p in clone.parameters() if p.requires_grad]
    operator: Any = EKFACLinearOperator(
        clone,
        loss_func,
        params,
        [(x, y)],
        check_deterministic=False,
        fisher_type='empirical',
        kfac_approx=kfac_approx,
        num_per_example_loss_terms=num_per_example_loss_terms,
        separate_weight_and_bias=False,
        num_data=x.shape[0],
    )
    out: list[torch.Tensor] = operator @ vectors
    return out
