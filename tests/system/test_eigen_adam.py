"""EIGEN_ADAM and ONE_SIDED trained end to end against dense references.

The references are written from the definitions (DESIGN.md §3 and
`kfac.math.eigenbasis`) with plain float64 tensors and explicit Kronecker
products: the factors (K-FAC's, or the gradient's own `V Vᵀ` and `Vᵀ V`),
their running average, `eigh` every `INV_STEPS` steps, and

* EIGEN_ADAM on `vec V` (column-major) in the basis `Q = Q_A ⊗ Q_G`:
  `r = Qᵀ vec V`, `E ← β₂ E + (1 - β₂) r²` (carried into a refreshed basis
  as the diagonal of `Pᵀ diag(E) P`, `P = Q_oldᵀ Q_new`, or restarted),
  `vec V' = Q (r / (√(E / (1 - β₂ᵗ)) + ε))`;
* ONE_SIDED by `torch.linalg.solve` on the explicit damped factor.

Each run is checkpointed and resumed mid-run (a fresh preconditioner, the
model and optimizer reloaded), so it is also the exact-resume oracle; the
model's factors have full rank (`Linear(5, 6)`, `Linear(6, 7)`: every
`V` is square), so the eigenbases are unique and W ranks choose the ones a
single process chooses. Under DDP at W = 2 and 3 the parameters equal the
dense reference, and a checkpoint written at W = 2 under MEM-OPT (the
second moments gathered from the gradient workers) resumes at W = 1 and
W = 3.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kfac
from testing import oracle
from testing.asserts import assert_rel_close
from testing.models import classification_data

F64 = torch.float64
GLOBAL_BATCH = 12
CLASSES = 7
STEPS = 6
RESUME_AT = 3  # odd: the bases of step 2 are in force (restored or not)
LR = 0.01
DAMPING = 0.1
DECAY = 0.9
INV_STEPS = 2
BETA2 = 0.8
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: the method and its options, the placement, and
    where the run saves or loads its checkpoint (None: it saves none, and
    trains from step 0).
    """

    method: str = 'eigen_adam'
    source: str = 'gradient'
    on_refresh: str = 'carry'
    side: str = 'input'
    strategy: str = 'comm_opt'
    save: str | None = None
    load: str | None = None

    def curvature(self) -> kfac.CurvatureConfig:
        if self.method == 'one_sided':
            return kfac.OneSidedConfig(side=self.side, source=self.source)
        return kfac.EigenAdamConfig(
            beta2=BETA2,
            eps=EPS,
            on_refresh=self.on_refresh,
            source=self.source,
        )

    def label(self) -> str:
        what = self.side if self.method == 'one_sided' else self.on_refresh
        loaded = ' resumed' if self.load else ''
        return f'{self.method} {self.source} {what} {self.strategy}{loaded}'


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 7)).to(F64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(GLOBAL_BATCH, (5,), CLASSES, seed=50 + step)


def preconditioner(net: nn.Module, case: Case) -> kfac.KFACPreconditioner:
    return kfac.KFACPreconditioner(
        net,
        compute_method=case.curvature(),
        factor_update_steps=1,
        inv_update_steps=INV_STEPS,
        damping=DAMPING,
        factor_decay=DECAY,
        relative_clip=None,
        grad_worker_fraction=case.strategy,
    )


def train(case: Case, part: oracle.Part) -> torch.Tensor:
    """The model trained on rows `part` of each batch; the preconditioner
    rebuilt from its `state_dict()` after step `RESUME_AT` (every rank
    calls it; rank 0 writes it, with the model's and the optimizer's, to
    `case.save`), or the run started from `case.load` at that step.
    """
    net = model()
    wrapped = oracle.wrap(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    precon = preconditioner(wrapped, case)
    start = 0
    if case.load is not None:
        saved = torch.load(case.load, weights_only=True)
        net.load_state_dict(saved['model'])
        optimizer.load_state_dict(saved['optimizer'])
        precon.load_state_dict(saved['kfac'])
        start = RESUME_AT
    steps = range(start, RESUME_AT)
    oracle.train_steps(wrapped, precon, optimizer, batch, steps, part)
    if case.load is None:
        state = precon.state_dict()
        if case.save is not None and part[0] == 0:
            torch.save(
                {
                    'model': net.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'kfac': state,
                },
                case.save,
            )
        precon.remove()
        precon = preconditioner(wrapped, case)
        precon.load_state_dict(state)
    steps = range(RESUME_AT, STEPS)
    oracle.train_steps(wrapped, precon, optimizer, batch, steps, part)
    return oracle.flat_params(net)


# -- the dense reference -----------------------------------------------------


def vec(matrix: torch.Tensor) -> torch.Tensor:
    """Column-major `vec`."""
    return matrix.T.reshape(-1)


def unvec(vector: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return vector.reshape(shape[1], shape[0]).T


class DenseLayer:
    """One layer's method from its definitions, with explicit matrices."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.factors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.basis: torch.Tensor | None = None  # Q_A ⊗ Q_G
        self.inverse_factor: torch.Tensor | None = None  # ONE_SIDED's
        self.moment: torch.Tensor | None = None
        self.count = 0

    def update(self, a: torch.Tensor, g: torch.Tensor) -> None:
        old = self.factors
        self.factors = (
            (a, g)
            if old is None
            else (
                DECAY * old[0] + (1 - DECAY) * a,
                DECAY * old[1] + (1 - DECAY) * g,
            )
        )

    def decompose(self) -> None:
        assert self.factors is not None
        a, g = self.factors
        if self.case.method == 'one_sided':
            f = a if self.case.side == 'input' else g
            self.inverse_factor = f
            return
        basis = torch.kron(torch.linalg.eigh(a)[1], torch.linalg.eigh(g)[1])
        old, self.basis = self.basis, basis
        if old is None or self.moment is None:
            return
        if self.case.on_refresh == 'restart':
            self.moment = torch.zeros_like(self.moment)
            self.count = 0
            return
        seen = basis.T @ old @ torch.diag(self.moment) @ old.T @ basis
        self.moment = torch.diagonal(seen).clone()

    def precondition(self, v: torch.Tensor) -> torch.Tensor:
        if self.case.method == 'one_sided':
            f = self.inverse_factor
            assert f is not None
            n = f.shape[0]
            damped = f + DAMPING * torch.trace(f) / n * torch.eye(n, dtype=F64)
            solved: torch.Tensor
            if self.case.side == 'input':
                solved = torch.linalg.solve(damped, v.T).T
            else:
                solved = torch.linalg.solve(damped, v)
            return solved
        q = self.basis
        assert q is not None
        r = q.T @ vec(v)
        if self.moment is None:
            self.moment = torch.zeros_like(r)
        self.moment = BETA2 * self.moment + (1 - BETA2) * r * r
        self.count += 1
        correction = 1 - BETA2**self.count
        step = r / (torch.sqrt(self.moment / correction) + EPS)
        return unvec(q @ step, v.shape)


def dense_reference(case: Case) -> torch.Tensor:
    """The training of `train` from the definitions (one process, no
    checkpoint: a resumed run must continue exactly).
    """
    net = model()
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    layers = [DenseLayer(case) for _ in linears]
    for step in range(STEPS):
        x, y = batch(step)
        inputs, outputs, h = [], [], x
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
        for linear, layer, a_in, g_out in zip(linears, layers, inputs, grads):
            w, b = linear.weight.grad, linear.bias.grad
            assert w is not None and b is not None
            v = torch.cat([w, b[:, None]], 1)
            if case.source == 'gradient':
                layer.update(v.T @ v, v @ v.T)
            else:
                a = torch.cat([a_in, torch.ones(n, 1, dtype=F64)], 1)
                g = n * g_out
                layer.update(a.T @ a / n, g.T @ g / n)
            if step % INV_STEPS == 0:
                layer.decompose()
            v = layer.precondition(v)
            w.copy_(v[:, :-1])
            b.copy_(v[:, -1])
        optimizer.step()
    return oracle.flat_params(net)


# -- the tests ---------------------------------------------------------------

ONE_PROCESS_CASES = [
    Case(),
    Case(on_refresh='restart'),
    Case(source='kfac'),
    Case(method='one_sided'),
    Case(method='one_sided', side='output', source='kfac'),
]


@pytest.mark.parametrize('case', ONE_PROCESS_CASES, ids=Case.label)
def test_one_process_equals_the_dense_reference(case: Case) -> None:
    got = train(case, oracle.ONE_PROCESS)
    want = dense_reference(case)
    assert_rel_close(got, want, rtol=1e-10, label=case.label())
    assert not torch.equal(got, oracle.flat_params(model()))  # it trained


def _ddp_cases(world_size: int, checkpoint: pathlib.Path) -> list[Case]:
    """The gradient's own factors (K-FAC's, and ONE_SIDED, are in
    tests/system/test_ddp_oracle.py at W = 1 to 4).
    """
    if world_size == 2:  # the checkpoint, resumed at W = 1 and W = 3
        return [
            Case(strategy='comm_opt'),
            Case(strategy='mem_opt', save=str(checkpoint)),
        ]
    return [
        Case(strategy='mem_opt', on_refresh='restart'),
        Case(strategy='mem_opt', load=str(checkpoint)),
    ]


@pytest.mark.timeout(280)
def test_ddp_equals_the_dense_reference(tmp_path: pathlib.Path) -> None:
    checkpoint = tmp_path / 'checkpoint.pt'
    for world_size in (2, 3):
        cases = _ddp_cases(world_size, checkpoint)
        outcomes = oracle.run_oracle(
            train,
            cases,
            world_size,
            tmp_path=tmp_path,
            timeout=130,
            reference=dense_reference,
        )
        oracle.check_outcomes(outcomes, [c.label() for c in cases], rtol=1e-9)
        if world_size == 2:  # the W = 2 checkpoint, resumed in one process
            assert checkpoint.exists()
            assert not dist.is_initialized()
            resumed = Case(strategy='comm_opt', load=str(checkpoint))
            got = train(resumed, oracle.ONE_PROCESS)
            assert_rel_close(
                got, dense_reference(resumed), rtol=1e-9, label=resumed.label()
            )


def test_a_layer_without_a_gradient_keeps_its_factors() -> None:
    """The gradient's own factors of a module without a gradient in a step
    stay as they were; no hook was registered for any module.
    """
    net = model()
    precon = preconditioner(net, Case())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    oracle.train_steps(net, precon, optimizer, batch, range(1))
    assert not any(m._forward_hooks for m in net.modules())
    kept = precon.layers['2'].factor('A').value
    assert kept is not None
    kept = kept.clone()
    for param in net.get_submodule('2').parameters():
        param.grad = None
    precon.step()  # layer 0 keeps its gradient, layer 2 has none
    after = precon.layers['2'].factor('A').value
    assert after is not None
    assert torch.equal(after, kept)
    assert precon.steps == 2
