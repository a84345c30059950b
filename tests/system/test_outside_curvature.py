"""A curvature defined outside `kfac` plugs in through the public interface.

`DiagonalConfig` below is written as a user would write one: it imports
only public names of `kfac` and patches nothing. Its curvature keeps the
diagonals of `A` and `G` and preconditions with the damped diagonal of
`A ⊗ G`: `V'_ij = V_ij / (G_ii A_jj + λ)`. Trained under DDP at W = 2
(COMM-OPT and MEM-OPT, the preconditioner checkpointed and resumed
mid-run), the parameters equal a dense float64 reference written from the
definitions of DESIGN.md §3 with plain tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac
from testing import oracle
from testing.models import classification_data

F64 = torch.float64
GLOBAL_BATCH = 8
STEPS = 5
RESUME_AT = 3  # odd: the restored decomposition (from step 2) is used
LR = 0.1
DAMPING = 0.01
DECAY = 0.9
INV_STEPS = 2


@dataclasses.dataclass(frozen=True)
class DiagonalConfig(kfac.CurvatureConfig):
    """The damped diagonal of `A ⊗ G` (a method written outside kfac)."""

    name: ClassVar[str] = 'diagonal'

    def make(self, layer: Any) -> DiagonalCurvature:
        return DiagonalCurvature(layer)


class DiagonalCurvature(kfac.Curvature):
    """Keeps `diag A` and `diag G`; `V' = V / (diag G diag Aᵀ + λ)`."""

    format = 'diagonal'

    def layout(self, name: str) -> tuple[tuple[tuple[int, ...], bool], ...]:
        return (((self.layer.factor(name).dim,), False),)

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> kfac.Decomposed:
        diagonal = matrix if matrix.dim() == 1 else torch.diagonal(matrix)
        return kfac.Decomposed((diagonal.clamp(min=0.0).clone(),), None)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        assert a is not None and g is not None  # the layer checks
        return grad / (torch.outer(g[0], a[0]) + damping)


def model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = classification_data(GLOBAL_BATCH, (6,), seed=100 + step)
    return x.to(F64), y


def options(case: dict[str, Any]) -> dict[str, Any]:
    return {
        'compute_method': DiagonalConfig(),
        'factor_update_steps': 1,
        'inv_update_steps': INV_STEPS,
        'damping': DAMPING,
        'factor_decay': DECAY,
        'relative_clip': None,
        **case,
    }


def train(case: dict[str, Any], part: oracle.Part) -> torch.Tensor:
    """The model trained with K-FAC and the outside curvature on rows
    `part` of each global batch; the preconditioner is rebuilt from its
    `state_dict()` after step `RESUME_AT`.
    """
    net = model()
    wrapped = oracle.wrap(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    precon = kfac.KFACPreconditioner(wrapped, **options(case))
    for layer in precon.layers.values():
        assert isinstance(layer.curvature, DiagonalCurvature)
    steps = functools.partial(
        oracle.train_steps,
        wrapped,
        optimizer=optimizer,
        batch=batch,
        part=part,
    )
    steps(precon, steps=range(RESUME_AT))
    state = precon.state_dict()
    precon.remove()
    precon = kfac.KFACPreconditioner(wrapped, **options(case))
    precon.load_state_dict(state)
    steps(precon, steps=range(RESUME_AT, STEPS))
    return oracle.flat_params(net)


def dense_reference(case: dict[str, Any]) -> torch.Tensor:
    """The same training from the definitions, with plain tensors: `A`,
    `G` per DESIGN.md §3 (`g = N ∂L/∂s`, bias as a column of ones), their
    running average (the first update sets it), diagonals taken every
    `INV_STEPS` steps, `V' = V / (d_G d_Aᵀ + λ)`.
    """
    net = model()
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    factors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    diagonals: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(STEPS):
        x, y = batch(step)
        inputs, outputs = [], []
        h = x
        for index, linear in enumerate(linears):
            inputs.append(h)
            s = h @ linear.weight.T + linear.bias
            outputs.append(s)
            h = torch.tanh(s) if index == 0 else s
        loss = F.cross_entropy(h, y)
        optimizer.zero_grad()
        grads = torch.autograd.grad(loss, outputs, retain_graph=True)
        loss.backward()
        n = x.shape[0]
        for index, (a_in, g_out) in enumerate(zip(inputs, grads)):
            a = torch.cat([a_in, torch.ones(n, 1, dtype=F64)], dim=1)
            g = n * g_out
            batch_a, batch_g = a.T @ a / n, g.T @ g / n
            old = factors[index]
            factors[index] = (
                (batch_a, batch_g)
                if old is None
                else (
                    DECAY * old[0] + (1 - DECAY) * batch_a,
                    DECAY * old[1] + (1 - DECAY) * batch_g,
                )
            )
        if step % INV_STEPS == 0:
            diagonals = [
                (torch.diagonal(a).clone(), torch.diagonal(g).clone())
                for a, g in (f for f in factors if f is not None)
            ]
        for linear, (da, dg) in zip(linears, diagonals):
            w, b = linear.weight.grad, linear.bias.grad
            assert w is not None and b is not None
            v = torch.cat([w, b[:, None]], 1)
            v = v / (torch.outer(dg, da) + DAMPING)
            w.copy_(v[:, :-1])
            b.copy_(v[:, -1])
        optimizer.step()
    return oracle.flat_params(net)


def test_one_process_equals_the_dense_reference() -> None:
    got = train({}, oracle.ONE_PROCESS)
    want = dense_reference({})
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
    assert not torch.equal(got, oracle.flat_params(model()))  # it trained


@pytest.mark.timeout(240)
def test_ddp_with_checkpoint_equals_the_dense_reference(
    tmp_path: pathlib.Path,
) -> None:
    cases = [
        {'grad_worker_fraction': 'comm_opt'},
        {'grad_worker_fraction': 'mem_opt'},
    ]
    outcomes = oracle.run_oracle(
        train,
        cases,
        2,
        tmp_path=tmp_path,
        timeout=220,
        reference=dense_reference,
    )
    oracle.check_outcomes(
        outcomes,
        ['outside curvature, DDP W=2 vs dense reference'] * len(cases),
        rtol=1e-12,
        split=False,
        across_label='DDP ranks vs each other',
    )
