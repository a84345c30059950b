"""Twin models: a weight shared by several modules, and one module called
as often.

K-FAC gives a weight used by several modules one layer whose calls are
all those modules' calls (see `kfac.layers.register`). Its oracle is a
twin: the same model in which one module makes every call. The two
models compute the same function with the same parameters, so their raw
gradients, their factors and their preconditioned gradients must agree.

[`make_twins`][testing.twins.make_twins] builds the pair for a kind of
sharer: Linear and Conv2d sharers run one after another, Embedding
sharers each read their own slice of the tokens and their outputs are
summed. [`check_twins`][testing.twins.check_twins] trains both in
lockstep and compares them after every backward pass and every step.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.options import EVERY_STEP
from testing.oracle import ONE_PROCESS
from testing.oracle import Part
from testing.oracle import rows
from testing.oracle import wrap

__all__ = ['KINDS', 'Case', 'Users', 'check_twins', 'make_twins']

KINDS = ('linear', 'conv', 'grouped conv', 'embedding')
"""The kinds of sharer (a grouped convolution is one layer per group)."""
BATCH = 12  # divisible by 1, 2, 3 and 4
CLASSES = 3
VOCAB, TOKENS = 7, 5
FACTOR_RTOL = 1e-12
GRAD_RTOL = 1e-10


@dataclass(frozen=True)
class Case:
    """One twin comparison.

    Attributes:
        kind: one of [`KINDS`][testing.twins.KINDS].
        sharers: modules sharing the weight.
        runs: per step, the sharers that run (by index, 0 owning the
            layer); the twin makes as many calls with its one module.
        options: keyword arguments of both preconditioners.
    """

    kind: str = 'linear'
    sharers: int = 2
    runs: tuple[tuple[int, ...], ...] = ((0, 1), (0, 1), (0, 1))
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per step."""
        return int(self.options.get('accumulation_steps', 1))


def _sharer(kind: str) -> nn.Module:
    if kind == 'linear':
        return nn.Linear(4, 4)
    if kind == 'conv':
        return nn.Conv2d(2, 2, 3, padding=1)
    if kind == 'grouped conv':
        return nn.Conv2d(2, 2, 3, padding=1, groups=2)
    if kind == 'embedding':
        return nn.Embedding(VOCAB, 4)
    raise ValueError(f'kind must be one of {KINDS}; got {kind!r}')


class Users(nn.Module):
    """A head on the sharers of `users` that run (`run`, by index).

    Linear (inputs `(N, 4)`) and Conv2d (inputs `(N, 2, 4, 4)`, grouped
    or not) sharers
    run one after another with a tanh between; Embedding sharer `i` reads
    tokens `x[:, i]` of `(N, sharers, T)` and the outputs are summed and
    averaged over the `T` positions.
    """

    def __init__(self, kind: str, users: Sequence[nn.Module]) -> None:
        super().__init__()
        self.kind = kind
        self.users = nn.ModuleList(users)
        self.head = nn.Linear(32 if 'conv' in kind else 4, CLASSES)
        self.run: tuple[int, ...] = tuple(range(len(users)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == 'embedding':
            h = sum(self.users[i](x[:, i]) for i in self.run)
            assert isinstance(h, torch.Tensor)
            h = h.mean(dim=1)
        else:
            h = x
            for i in self.run:
                h = torch.tanh(self.users[i](h))
        out: torch.Tensor = self.head(torch.tanh(h.flatten(1)))
        return out


def make_twins(kind: str, sharers: int) -> tuple[Users, Users]:
    """`(shared, twin)` in float64 with equal parameters: in `shared`,
    `sharers` modules share the first one's weight (and bias); in `twin`,
    every entry of `users` is one module.
    """
    torch.manual_seed(0)
    first = _sharer(kind)
    others = [_sharer(kind) for _ in range(sharers - 1)]
    for other in others:
        for name in ('weight', 'bias'):
            if hasattr(first, name):
                setattr(other, name, getattr(first, name))
    shared = Users(kind, [first, *others]).double()
    twin = Users(kind, [copy.deepcopy(first)] * sharers).double()
    twin.head = copy.deepcopy(shared.head)
    return shared, twin


def _batch(
    case: Case, step: int, micro: int, part: Part
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `part` (index, parts) of micro-batch `micro` of step `step`."""
    generator = torch.Generator().manual_seed(100 * step + micro)
    if case.kind == 'embedding':
        shape: tuple[int, ...] = (BATCH, case.sharers, TOKENS)
        x = torch.randint(0, VOCAB, shape, generator=generator)
    else:
        shape = (BATCH, 2, 4, 4) if 'conv' in case.kind else (BATCH, 4)
        x = torch.randn(shape, dtype=torch.float64, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return rows(x, part), rows(y, part)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grads[name] = param.grad.detach().clone()
    return grads


def _assert_grads_agree(
    mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str
) -> None:
    assert mine.keys() == theirs.keys(), (sorted(mine), sorted(theirs))
    for name in mine:
        assert_rel_close(
            mine[name], theirs[name], rtol=GRAD_RTOL, label=f'twins {what}'
        )


def _assert_factors_agree(
    precon: KFACPreconditioner, reference: KFACPreconditioner
) -> None:
    assert list(precon.layers) == list(reference.layers)
    for name, layer in precon.layers.items():
        theirs = reference.layers[name].factors
        assert len(layer.factors) == len(theirs) == 2, name
        for mine, other in zip(layer.factors, theirs):
            assert mine.value is not None and other.value is not None, name
            assert_rel_close(
                mine.value, other.value, rtol=FACTOR_RTOL, label='twins A, G'
            )


def check_twins(case: Case, part: Part = ONE_PROCESS) -> int:
    """Train the twins of `case` in lockstep on rows `part` of each batch
    (wrapped in DDP when `torch.distributed` is initialised) and assert,
    at every step: equal raw gradients, then equal factors and equal
    preconditioned gradients.

    Returns:
        The number of steps compared.
    """
    shared, twin = make_twins(case.kind, case.sharers)
    models = [wrap(shared), wrap(twin)]
    options = {
        'relative_clip': None,
        'damping': 0.01,
        **EVERY_STEP,
        **case.options,
    }
    precons = [KFACPreconditioner(m, **options) for m in models]
    others = [f'users.{i}' for i in range(1, case.sharers)]
    entries = precons[0].describe()['preconditioned']
    owned = [e for e in entries if e['name'].startswith('users.')]
    assert [e['name'] for e in owned] == (
        ['users.0.group0', 'users.0.group1']
        if case.kind == 'grouped conv'
        else ['users.0']
    )
    assert all(e['shares_weight_with'] == others for e in owned), owned
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step, run in enumerate(case.runs):
        shared.run, twin.run = run, run
        grads = []
        for model in models:
            model.zero_grad()
            for micro in range(case.accumulation_steps):
                x, y = _batch(case, step, micro, part)
                loss = F.cross_entropy(model(x), y)
                (loss / case.accumulation_steps).backward()
            grads.append(_grads(model))
        _assert_grads_agree(grads[0], grads[1], 'raw gradients')
        for precon in precons:
            precon.step()
        _assert_factors_agree(precons[0], precons[1])
        after = [_grads(model) for model in models]
        _assert_grads_agree(after[0], after[1], 'preconditioned gradients')
        for name in after[0]:  # K-FAC did change them
            assert not torch.equal(after[0][name], grads[0][name]), name
        for optimizer in optimizers:
            optimizer.step()
    return len(case.runs)
