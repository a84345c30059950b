"""Property-based fuzzing over shapes, dtypes, damping and intervals."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn

from kfac.layers.modules import Conv2dModuleHelper
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.reference import conv_factors
from testing.reference import eigen_reference
from testing.reference import grad_matrix
from testing.reference import inverse_reference

DTYPES = {
    'float64': torch.float64,
    'float32': torch.float32,
    'bf16': torch.bfloat16,
}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclasses.dataclass
class LinearCase:
    n_in: int
    n_out: int
    bias: bool
    batch: int
    positions: tuple[int, ...]
    dtype: str
    damping: float
    method: str
    outer: bool
    factor_steps: int
    inv_steps: int
    steps: int
    seed: int


linear_cases = st.builds(
    LinearCase,
    n_in=st.integers(1, 6),
    n_out=st.integers(1, 5),
    bias=st.booleans(),
    batch=st.integers(1, 5),
    positions=st.sampled_from([(), (1,), (3,), (2, 2)]),
    dtype=st.sampled_from(list(DTYPES)),
    damping=st.floats(1e-4, 10.0),
    method=st.sampled_from(['eigen', 'inverse']),
    outer=st.booleans(),
    factor_steps=st.integers(1, 3),
    inv_steps=st.integers(1, 3),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)


@FUZZ
@given(case=linear_cases)
def test_linear_results_stay_finite_and_match_the_oracle(
    case: LinearCase,
) -> None:
    dtype = DTYPES[case.dtype]
    torch.manual_seed(case.seed)
    model = nn.Linear(case.n_in, case.n_out, bias=case.bias).to(dtype)
    precon = KFACPreconditioner(
        model,
        damping=case.damping,
        compute_method=case.method,
        compute_eigenvalue_outer_product=case.outer,
        factor_update_steps=case.factor_steps,
        inv_update_steps=case.inv_steps,
        relative_clip=None,
    )
    shape = (case.batch, *case.positions, case.n_in)
    for step in range(case.steps):
        model.zero_grad()
        x = torch.randn(shape, dtype=dtype)
        target = torch.randn((*shape[:-1], case.n_out), dtype=dtype)
        F.mse_loss(model(x).float(), target.float()).backward()
        raw = grad_matrix(model).double().clone()
        precon.step()
        layer = precon.layers['']
        for factor in layer.factors:
            assert factor.value is not None
            assert torch.isfinite(factor.value).all()
            assert factor.value.dtype in (torch.float32, torch.float64)
        for param in model.parameters():
            assert torch.isfinite(param).all()
            assert param.grad is not None
            assert torch.isfinite(param.grad).all()
        if step % case.inv_steps == 0:  # decomposed from these factors
            a, g = layer.a.value, layer.g.value
            assert a is not None and g is not None
            a, g = a.double(), g.double()
            solve = (
                eigen_reference
                if case.method == 'eigen'
                else inverse_reference
            )
            assert_rel_close(
                grad_matrix(model),
                solve(a, g, raw, case.damping),
                rtol=oracle_tolerance(dtype, a, g, case.damping),
                label=f'fuzz: preconditioned grad vs solve ({case.dtype})',
            )


def oracle_tolerance(
    dtype: torch.dtype, a: torch.Tensor, g: torch.Tensor, damping: float
) -> float:
    """Relative error allowed against the float64 solve.

    Float32 factors and decompositions: ``100 ε κ`` with ``κ`` the condition
    number of ``A ⊗ G + λI`` (measured over 400 examples: at most 11 ε κ).
    A bfloat16 model adds the rounding of its written-back ``.grad``
    (``2⁻⁸``; measured: at most 2.2e-3).
    """
    if dtype is torch.float64:
        return 1e-7
    eigenvalues = torch.linalg.eigvalsh(torch.kron(a, g))
    kappa = float((eigenvalues.max().clamp(min=0) + damping) / damping)
    tolerance = 100 * torch.finfo(torch.float32).eps * kappa
    if dtype is torch.bfloat16:
        tolerance += 2.0**-8
    return tolerance


@st.composite
def conv_cases(draw: st.DrawFn) -> tuple[dict[str, Any], int, tuple[int, int]]:
    padding = draw(
        st.sampled_from(['same', 'valid', (0, 0), (1, 0), (1, 2)]),
    )
    strides = st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)])
    kwargs = {
        'in_channels': draw(st.integers(1, 3)),
        'out_channels': draw(st.integers(1, 3)),
        'kernel_size': (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        'stride': (1, 1) if padding == 'same' else draw(strides),
        'padding': padding,
        'dilation': (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
        'bias': draw(st.booleans()),
        'padding_mode': draw(
            st.sampled_from(['zeros', 'reflect', 'replicate', 'circular']),
        ),
    }
    size = (draw(st.integers(5, 8)), draw(st.integers(5, 8)))
    return kwargs, draw(st.integers(1, 3)), size


@FUZZ
@given(case=conv_cases())
def test_conv_factors_match_definition(
    case: tuple[dict[str, Any], int, tuple[int, int]],
) -> None:
    kwargs, batch, size = case
    conv = nn.Conv2d(**kwargs).double()
    x = torch.randn(batch, kwargs['in_channels'], *size, dtype=torch.float64)
    out = conv(x)
    gout = torch.randn_like(out)
    helper = Conv2dModuleHelper(conv)
    a_sum, a_count = helper.a_statistic(x, torch.float64)
    g_sum, g_count = helper.g_statistic(
        gout,
        torch.float64,
        1.0,
        per_example=True,
    )
    a_ref, g_ref = conv_factors(conv, x, gout)
    assert_rel_close(a_sum / a_count, a_ref, label='fuzz: conv factors')
    assert_rel_close(g_sum / g_count, g_ref, label='fuzz: conv factors')
