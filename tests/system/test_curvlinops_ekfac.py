"""Our EKFAC against curvlinops' `EKFACLinearOperator` (3.0.1).

curvlinops computes the same scaling, `(1/Z) Σ_n (Q_Gᵀ ∇W_n Q_A)²` with
`∇W_n` summed over an example's positions under expand and reduce alike
(its `compute_eigenvalue_correction_linear_weight_sharing`, `'mean'`
reduction with `N P` loss terms, `Z = N P`), in the eigenbases of factors
that equal ours (`test_curvlinops.py` maps the options). It covers Linear
and Conv2d layers with a 2-D or per-token cross-entropy output. The two
EKFAC matrices `Q diag(vec S) Qᵀ` are compared on random vectors: they are
independent of the basis chosen inside a repeated eigenvalue only where
the gradients have no component, so the shapes keep every factor of full
rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.math import eigen_precondition
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.curvlinops import curvlinops_ekfac_products

F64 = torch.float64
RTOL = 1e-10
N, T, D, H, C = 12, 3, 3, 4, 3


class Net(nn.Module):
    """`D -> H` on `(N, D)` or on each position of `(N, T, D)`, then `C`
    logits per example.
    """

    def __init__(self, positions: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(positions * H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)).flatten(1))
        return out


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 2, stride=2)
        self.fc = nn.Linear(2 * 2 * 2, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.tanh(self.conv(x)).flatten(1))
        return out


def ours(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: Any
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`(Q_A, Q_G, S)` of every layer after one step on `(x, y)`."""
    precon = KFACPreconditioner(
        model,
        compute_method='ekfac',
        relative_clip=None,
        statistics=StatisticsConfig(**kw),
    )
    F.cross_entropy(model(x), y).backward()
    precon.step()
    out = {}
    for name, layer in precon.layers.items():
        curvature = layer.curvature
        assert isinstance(curvature, EKFACCurvature)
        a, g = layer.a.decomposition, layer.g.decomposition
        assert a is not None and g is not None and curvature.scale is not None
        out[name] = (a[0], g[0], curvature.scale)
    return out


def compare(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    p: int,
    label: str,
    **kw: str,
) -> None:
    gen = torch.Generator().manual_seed(5)
    vectors = [
        torch.randn(q.shape, generator=gen, dtype=F64)
        for q in model.parameters()
    ]
    theirs = curvlinops_ekfac_products(
        model,
        nn.CrossEntropyLoss(),
        x,
        y,
        vectors,
        num_per_example_loss_terms=p,
        kfac_approx=kw.get('kfac_approx', 'expand'),
    )
    mine = ours(model, x, y, **kw)
    names = [n for n, _ in model.named_parameters()]
    by_name = dict(zip(names, zip(vectors, theirs)))
    for layer, (qa, qg, scale) in mine.items():
        (w, w_out), (b, b_out) = (
            by_name[f'{layer}.weight'],
            by_name[f'{layer}.bias'],
        )
        v = torch.cat([w.reshape(w.shape[0], -1), b[:, None]], dim=1)
        expected = torch.cat(
            [w_out.reshape(w.shape[0], -1), b_out[:, None]], 1
        )
        got = eigen_precondition(v, qa, qg, scale)
        assert_rel_close(
            got, expected, rtol=RTOL, label=f'curvlinops EKFAC: {label}'
        )


def test_linear() -> None:
    torch.manual_seed(0)
    x = torch.randn(N, D, dtype=F64)
    y = torch.randint(0, C, (N,))
    compare(Net().double(), x, y, 1, 'linear')


@pytest.mark.parametrize('kfac_approx', ['expand', 'reduce'])
def test_linear_on_positions(kfac_approx: str) -> None:
    """`fc1` shares its weight over T positions; the loss is a mean over
    the N examples (`P = 1`).
    """
    torch.manual_seed(1)
    x = torch.randn(N, T, D, dtype=F64)
    y = torch.randint(0, C, (N,))
    compare(
        Net(T).double(),
        x,
        y,
        1,
        f'positions {kfac_approx}',
        kfac_approx=kfac_approx,
    )


@pytest.mark.parametrize('kfac_approx', ['expand', 'reduce'])
def test_conv2d(kfac_approx: str) -> None:
    torch.manual_seed(2)
    x = torch.randn(N, 1, 4, 4, dtype=F64)
    y = torch.randint(0, C, (N,))
    compare(
        ConvNet().double(),
        x,
        y,
        1,
        f'conv {kfac_approx}',
        kfac_approx=kfac_approx,
    )
