"""The step reads device values on the host a fixed number of times, however
many layers there are (on a GPU each read is a stall).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner

#: ``torch.Tensor`` methods that copy a value to the host.
READS = ('item', 'tolist', '__bool__', '__float__', '__int__', '__index__')


def deep_mlp(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
    for _ in range(layers - 2):
        blocks += [nn.Linear(16, 16), nn.Tanh()]
    blocks.append(nn.Linear(16, 4))
    return nn.Sequential(*blocks)


def count_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> Counter[str]:
    counts: Counter[str] = Counter()

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in READS:
        monkeypatch.setattr(
            torch.Tensor, name, counted(name, getattr(torch.Tensor, name))
        )
    return counts


def reads_per_step(
    layers: int,
    method: str,
    monkeypatch: pytest.MonkeyPatch,
) -> list[int]:
    """Host reads in steps 0-3: factors and decompositions, none, factors,
    none.
    """
    model = deep_mlp(layers)
    precon = KFACPreconditioner(
        model,
        compute_method=method,
        factor_update_steps=2,
        inv_update_steps=4,
    )
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
    out = []
    with monkeypatch.context() as patch:
        counts = count_reads(patch)
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            before = counts.total()
            precon.step()
            out.append(counts.total() - before)
    return out


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_host_reads_do_not_grow_with_the_number_of_layers(
    method: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    few = reads_per_step(3, method, monkeypatch)
    many = reads_per_step(9, method, monkeypatch)
    assert few == many
    # Every step: one read of the KL clip's finiteness flags. Factor steps:
    # one more for the health of the statistics. Decomposition steps: one
    # more for the validity of all decompositions.
    assert many == [3, 1, 2, 1]


def test_the_counter_sees_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        counts = count_reads(patch)
        t = torch.ones(2)
        bool(t.sum())
        float(t[0])
        t.tolist()
    assert counts == Counter({'__bool__': 1, '__float__': 1, 'tolist': 1})
