r"""Our Kronecker factors against curvlinops', a second implementation.

`curvlinops-for-pytorch==3.0.1` (test-only) computes K-FAC with its own
hooks, patch extraction and loss scaling (`testing/curvlinops.py` calls
it with `fisher_type='empirical'`, `separate_weight_and_bias=False` and
the same `kfac_approx` as ours). On one batch of `N` examples, in float64,
the factors agree to rounding once the options are mapped as below.

What curvlinops 3.0.1 computes (`curvlinops/kfac.py`, `KFACLinearOperator`;
`R` the positions of a layer, `P = num_per_example_loss_terms`):

* A (`_hook_accumulate_input_covariance`): Conv2d inputs are unfolded into
  patches in the weight's `(c_in, k1, k2)` order (`kfac_utils.
  extract_patches`; `extract_averaged_patches` for reduce; `groups=1`
  here, as curvlinops averages A over channel groups). Expand makes
  each position a row and divides by `N R`; reduce averages each example's
  positions and divides by `N`. The ones column is appended *last* (bias
  with the weight), after the average. As ours.
* The loss (`_compute_loss_and_backward`): outputs become
  `(N R_out, C)` rows (the class dimension is dim 1 for cross-entropy), and
  `L_c = loss_func(outputs, y)`, multiplied by `√C` for `MSELoss` with
  `reduction='mean'` (`_maybe_adjust_loss_scale`).
* G (`_accumulate_gradient_covariance`): rows `∂L_c/∂s` per position
  (expand) or summed over an example's positions (reduce),
  `G = c Σ_rows (∂L_c/∂s)(∂L_c/∂s)ᵀ` with `c = 1` for `reduction='sum'`
  and `c = (N P)² / (N P) = N P` for `'mean'`.

Ours (`kfac/math.py`, `kfac.layers.statistics`), with the same rows:
`G = k Σ_rows (∂L/∂s)(∂L/∂s)ᵀ` with `k = N` for `loss_average='batch'`,
`k = N T` for `'batch+sequence'` (`T` the positions *of the layer*) and
`k = 1` for `None` (`g = k ∂L/∂s` and `G = (1/k) Σ_rows g gᵀ`, a sum for
`None`). So, for the same loss (`L = L_c`):

| ours | curvlinops | G_curvlinops / G_ours |
| --- | --- | --- |
| `loss_average='batch'` | `reduction='mean'`, `P=1` | 1 |
| `'batch+sequence'` | `'mean'`, `P=T` (its inferred default) | 1 |
| `None` | `'sum'` | 1 |

`'batch'` multiplies by `N` whatever the loss averages: on a loss averaged
over the N·T tokens it is `P=1` too (curvlinops' inferred `P=T` would give
T times ours). This is also how earlier curvlinops releases defined their
own `loss_average` argument, which 3.0.1 no longer has (the loss's
reduction and `P` took its place). Three cases differ by a factor, asserted
as such (never divided out silently):

* `'batch+sequence'` where a layer's positions `T` are not the loss's terms
  per example `P` (an upsampling segmentation net): `P / T`. Ours counts
  the layer's positions (as curvlinops' `loss_average` did), 3.0.1 the
  loss's.
* A loss curvlinops cannot form, summed over the T tokens and averaged
  over N (`T L_c`, ours `'batch'`): `N` against `reduction='sum'`
  (curvlinops' summed G is not divided by N); `P = T²` removes it, since G
  depends on the loss only through `N P (∂L_c/∂s)²`.
* `MSELoss` averaged over the N·C outputs (`'batch'`, `P=1`): `C`.
  curvlinops scales that loss by `√C` (so that its MC Fisher equals the GGN
  of the mean over the C outputs); no integer `P` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from testing.asserts import assert_rel_close
from testing.curvlinops import Factors
from testing.curvlinops import curvlinops_factors
from testing.curvlinops import kfac_factors

F64 = torch.float64
#: Float64 rounding of sums of at most a few hundred products. Entries
#: are below ~5 in magnitude, so `ATOL` is ~10 units in the last place of
#: the largest; the two libraries differ by at most ~7e-16 here.
RTOL, ATOL = 1e-12, 1e-14
N, T, D, H, C = 5, 4, 3, 6, 3

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MLP(nn.Module):
    """`D -> H -> C` with a tanh; on `(N, D)` or `(N, T, D)` inputs."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H, bias=bias)
        self.fc2 = nn.Linear(H, C, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


class TokenNet(MLP):
    """The MLP on `(N, T, D)`, logits `(N, C, T)` (cross-entropy's layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).transpose(1, 2)


class PooledNet(nn.Module):
    """A Linear on `(N, T, D)`, then one head per example: `(N, C)`."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H, bias=bias)
        self.head = nn.Linear(T * H, C, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.fc1(x)).flatten(1))
        return out


class ConvNet(nn.Module):
    """Strided, padded, dilated and non-square convolutions, then a head."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias)
        self.conv2 = nn.Conv2d(
            3,
            4,
            (2, 3),
            stride=(1, 2),
            padding=(1, 0),
            dilation=(2, 1),
            bias=bias,
        )
        self.fc = nn.Linear(4 * 5 * 2, C, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        out: torch.Tensor = self.fc(h.flatten(1))
        return out


class SegNet(nn.Module):
    """A strided convolution, upsampling, and per-pixel logits `(N, C, 8, 8)`.

    `conv1` has `4 · 4` positions, `conv2` and the loss `8 · 8`.
    """

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias)
        self.up = nn.Upsample(scale_factor=2)
        self.conv2 = nn.Conv2d(3, C, 3, padding=1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv2(self.up(torch.tanh(self.conv1(x))))
        return out


def build(make: Callable[[bool], nn.Module], bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return make(bias).to(F64)


def inputs(*shape: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64)


def labels(*shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, C, shape, generator=gen)


def ce_summed_over_t(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the T tokens, averaged over the N examples."""
    return F.cross_entropy(out, y, reduction='sum') / out.shape[0]


def ce_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction='sum')


def assert_factors_match(
    ours: Factors,
    theirs: Factors,
    model: nn.Module,
    g_ratio: float | dict[str, float],
    label: str,
) -> None:
    """Every layer: A equal, `G_curvlinops = g_ratio · G_ours`."""
    assert ours.keys() == theirs.keys()
    for name, (a, g) in ours.items():
        a_c, g_c = theirs[name]
        module = model.get_submodule(name)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        has_bias = getattr(module, 'bias', None) is not None
        assert a.shape == (weight[0].numel() + has_bias,) * 2, name
        assert g.shape == (weight.shape[0],) * 2, name
        assert g.norm() > 1e-3 and a.norm() > 1e-3, name
        ratio = g_ratio[name] if isinstance(g_ratio, dict) else g_ratio
        torch.testing.assert_close(a_c, a, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(g_c, ratio * g, rtol=RTOL, atol=ATOL)
        assert_rel_close(a_c, a, rtol=RTOL, label=f'curvlinops A: {label}')
        assert_rel_close(
            g_c, ratio * g, rtol=RTOL, label=f'curvlinops G: {label}'
        )


def compare(
    make: Callable[[bool], nn.Module],
    data: tuple[torch.Tensor, torch.Tensor],
    losses: tuple[Loss, nn.MSELoss | nn.CrossEntropyLoss],
    *,
    bias: bool = True,
    kfac_approx: str = 'expand',
    loss_average: str | None = 'batch',
    p: int = 1,
    g_ratio: float | dict[str, float] = 1.0,
) -> None:
    """Our factors and curvlinops' on one batch `data` of one model.

    `losses` is our loss and curvlinops' (the same function unless a case
    says otherwise); `p` is curvlinops' `num_per_example_loss_terms`.
    """
    model = build(make, bias)
    x, y = data
    loss, their_loss = losses
    theirs = curvlinops_factors(
        model,
        their_loss,
        x,
        y,
        num_per_example_loss_terms=p,
        kfac_approx=kfac_approx,
    )
    statistics = StatisticsConfig(
        kfac_approx=kfac_approx, loss_average=loss_average
    )
    ours = kfac_factors(model, loss, x, y, statistics=statistics)
    label = f'{type(model).__name__} {kfac_approx} {loss_average}'
    assert_factors_match(ours, theirs, model, g_ratio, label)


CE = (F.cross_entropy, nn.CrossEntropyLoss())
CE_SUM = (ce_sum, nn.CrossEntropyLoss(reduction='sum'))
BIAS = pytest.mark.parametrize('bias', [True, False], ids=['bias', 'nobias'])
APPROX = pytest.mark.parametrize('kfac_approx', ['expand', 'reduce'])


@BIAS
def test_linear(bias: bool) -> None:
    """Cross-entropy averaged over N; `'batch'` is `'mean'`, `P=1`."""
    compare(MLP, (inputs(N, D), labels(N)), CE, bias=bias)


@BIAS
def test_linear_mse(bias: bool) -> None:
    """Mean squared error averaged over the N·C outputs: ratio C."""
    losses = (F.mse_loss, nn.MSELoss())
    data = (inputs(N, D), inputs(N, C, seed=3))
    compare(MLP, data, losses, bias=bias, g_ratio=C)


@BIAS
@APPROX
@pytest.mark.parametrize(
    ('loss_average', 'p'), [('batch', 1), ('batch+sequence', T)]
)
def test_linear_sequence_token_mean(
    bias: bool, kfac_approx: str, loss_average: str, p: int
) -> None:
    """Linear on `(N, T, D)`, cross-entropy averaged over the N·T tokens."""
    compare(
        TokenNet,
        (inputs(N, T, D), labels(N, T)),
        CE,
        bias=bias,
        kfac_approx=kfac_approx,
        loss_average=loss_average,
        p=p,
    )


@BIAS
@APPROX
def test_linear_sequence_example_mean(bias: bool, kfac_approx: str) -> None:
    """Linear on `(N, T, D)` under a loss averaged over the N examples."""
    compare(
        PooledNet,
        (inputs(N, T, D), labels(N)),
        CE,
        bias=bias,
        kfac_approx=kfac_approx,
    )


@APPROX
@pytest.mark.parametrize(
    ('reduction', 'p', 'g_ratio'),
    [('sum', 1, N), ('mean', T * T, 1)],
    ids=['sum', 'mean-P=T^2'],
)
def test_linear_sequence_summed_over_tokens(
    kfac_approx: str, reduction: str, p: int, g_ratio: int
) -> None:
    """Cross-entropy summed over T, averaged over N (`T` times the mean)."""
    losses = (ce_summed_over_t, nn.CrossEntropyLoss(reduction=reduction))
    compare(
        TokenNet,
        (inputs(N, T, D), labels(N, T)),
        losses,
        kfac_approx=kfac_approx,
        p=p,
        g_ratio=g_ratio,
    )


@BIAS
@APPROX
def test_conv2d(bias: bool, kfac_approx: str) -> None:
    """Stride, padding, dilation and a non-square kernel."""
    compare(
        ConvNet,
        (inputs(N, 2, 9, 10), labels(N)),
        CE,
        bias=bias,
        kfac_approx=kfac_approx,
    )


@APPROX
@pytest.mark.parametrize(
    ('make', 'shape', 'label_shape'),
    [
        (MLP, (N, D), (N,)),
        (TokenNet, (N, T, D), (N, T)),
        (ConvNet, (N, 2, 9, 10), (N,)),
    ],
    ids=['linear', 'sequence', 'conv2d'],
)
def test_summed_loss(
    kfac_approx: str,
    make: Callable[[bool], nn.Module],
    shape: tuple[int, ...],
    label_shape: tuple[int, ...],
) -> None:
    """`loss_average=None` on a summed loss is curvlinops' `'sum'`."""
    compare(
        make,
        (inputs(*shape), labels(*label_shape)),
        CE_SUM,
        kfac_approx=kfac_approx,
        loss_average=None,
    )


@APPROX
def test_batch_sequence_counts_the_layers_positions(kfac_approx: str) -> None:
    """Per-pixel cross-entropy (`P = 8 · 8` terms per example) through a
    layer with `4 · 4` positions: curvlinops' G is `P / (4 · 4)` times ours.
    """
    p = 8 * 8
    compare(
        SegNet,
        (inputs(N, 2, 8, 8), labels(N, 8, 8)),
        CE,
        kfac_approx=kfac_approx,
        loss_average='batch+sequence',
        p=p,
        g_ratio={'conv1': p / (4 * 4), 'conv2': p / (8 * 8)},
    )
