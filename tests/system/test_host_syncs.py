"""The step reads device values on the host a fixed number of times, however
many layers there are (on a GPU each read is a stall).

The models run on the device of ``KFAC_TEST_DEVICE`` (``tests/conftest.py``;
the CPU unless told). The reads counted are the ``torch.Tensor`` methods
that copy a value to the host, called from Python; on CUDA, the
synchronisations themselves are counted too, by PyTorch's sync debug mode,
which also sees those inside PyTorch's own operators.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.layers.curvature import method_config
from kfac.preconditioner import KFACPreconditioner

#: ``torch.Tensor`` methods that copy a value to the host.
READS = ('item', 'tolist', '__bool__', '__float__', '__int__', '__index__')
#: The warning of ``torch.cuda.set_sync_debug_mode('warn')``.
SYNC_WARNING = 'called a synchronizing CUDA operation'


def deep_mlp(layers: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
    for _ in range(layers - 2):
        blocks += [nn.Linear(16, 16), nn.Tanh()]
    blocks.append(nn.Linear(16, 4))
    return nn.Sequential(*blocks).to(device)


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(12, 8).to(device), torch.randint(0, 4, (12,)).to(device)


#: Each method, and the cost options (the low-rank form keeps the 16- and
#: 17-wide factors at rank 8; relative damping).
VARIANTS: dict[str, dict[str, Any]] = {
    'eigen': {},
    'inverse': {},
    'ekfac': {},
    'eigen lowrank': {'factor_rank': 8},
    'inverse lowrank': {'factor_rank': 8},
    'eigen relative': {'damping_mode': 'relative'},
    'inverse relative': {'damping_mode': 'relative'},
    'eigen_adam': {},
    'eigen_adam gradient': {'source': 'gradient'},
    'one_sided': {},
    'one_sided gradient': {'side': 'output', 'source': 'gradient'},
}
"""Per variant, the options of its method (`method_config`)."""

EIGHS_PER_LAYER = {'one_sided': 1, 'one_sided gradient': 1}
"""`torch.linalg.eigh` calls per layer on a decomposition step, where not
two (ONE_SIDED decomposes one factor)."""

READS_PER_STEP = {
    'eigen_adam gradient': [2, 1, 1, 1],
    'one_sided gradient': [2, 1, 1, 1],
}
"""Host reads in steps 0-3 where not `[3, 1, 2, 1]`: with the gradient's
own factors no layer has statistics whose health the factor update
checks."""


def preconditioner(
    model: nn.Module, method: str, fisher_type: str = 'empirical'
) -> KFACPreconditioner:
    """Factors every 2 steps, decompositions every 4: steps 0-3 are
    factors and decompositions, nothing, factors, nothing. `method` is a
    key of `VARIANTS`.
    """
    return KFACPreconditioner(
        model,
        compute_method=method_config(method.split()[0], **VARIANTS[method]),
        factor_update_steps=2,
        inv_update_steps=4,
        fisher=FisherConfig(fisher_type=fisher_type),
    )


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
    device: torch.device,
    fisher_type: str = 'empirical',
) -> list[int]:
    """Host reads in steps 0-3: factors and decompositions, none, factors,
    none (with the Monte Carlo Fisher, sampled before each backward pass).
    """
    model = deep_mlp(layers, device)
    precon = preconditioner(model, method, fisher_type)
    x, y = batch(device)
    out = []
    with monkeypatch.context() as patch:
        counts = count_reads(patch)
        for _ in range(4):
            output = model(x)
            precon.sample_fisher(output)
            loss = F.cross_entropy(output, y)
            model.zero_grad()
            loss.backward()
            before = counts.total()
            precon.step()
            out.append(counts.total() - before)
    return out


CASES = [
    (method, fisher_type)
    for method in VARIANTS
    for fisher_type in ('empirical', 'mc')
    if not (fisher_type == 'mc' and 'gradient' in method)
]
"""Each variant with each Fisher (the gradient's own factors have no
Monte Carlo Fisher: a `ValueError`)."""


@pytest.mark.parametrize(('method', 'fisher_type'), CASES)
def test_host_reads_do_not_grow_with_the_number_of_layers(
    method: str,
    fisher_type: str,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    few = reads_per_step(3, method, monkeypatch, device, fisher_type)
    many = reads_per_step(9, method, monkeypatch, device, fisher_type)
    assert few == many
    # Every step: one read of the KL clip's finiteness flags. Factor steps:
    # one more for the health of the statistics. Decomposition steps: one
    # more for the validity of all decompositions. EKFAC's scaling adds
    # none (a non-finite batch is dropped by torch.where), nor do
    # EIGEN_ADAM's second moments (a non-finite R is dropped alike).
    assert many == READS_PER_STEP.get(method, [3, 1, 2, 1])


def test_the_counter_sees_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        counts = count_reads(patch)
        t = torch.ones(2)
        bool(t.sum())
        float(t[0])
        t.tolist()
    assert counts == Counter({'__bool__': 1, '__float__': 1, 'tolist': 1})


def count_syncs(fn: Callable[[], object]) -> int:
    """CUDA synchronisations during ``fn()``, by the sync debug mode."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def needs_cuda(device: torch.device) -> None:
    if device.type != 'cuda':
        pytest.skip(
            'counts CUDA synchronisations: KFAC_TEST_DEVICE=cuda '
            '(make gpu-check)'
        )


def syncs_per_step(
    layers: int, method: str, device: torch.device, fisher_type: str
) -> list[int]:
    """Synchronisations of sampling, backward and step in steps 0-3 (the
    backward counts too: with ``update_factors_in_hook`` the factors are
    formed in the gradient hooks).
    """
    model = deep_mlp(layers, device)
    precon = preconditioner(model, method, fisher_type)
    x, y = batch(device)
    out = []
    for _ in range(4):
        output = model(x)
        loss = F.cross_entropy(output, y)
        model.zero_grad()

        def backward_and_step(
            loss: torch.Tensor = loss, output: torch.Tensor = output
        ) -> None:
            precon.sample_fisher(output)
            loss.backward()
            precon.step()

        out.append(count_syncs(backward_and_step))
    return out


@pytest.mark.parametrize(('method', 'fisher_type'), CASES)
def test_device_syncs_do_not_grow_with_the_number_of_layers(
    method: str, fisher_type: str, device: torch.device
) -> None:
    needs_cuda(device)
    syncs_per_step(3, method, device, fisher_type)  # warm-up: lazy CUDA
    few = syncs_per_step(3, method, device, fisher_type)
    many = syncs_per_step(9, method, device, fisher_type)
    if method.startswith(('eigen', 'ekfac', 'one_sided')) or (
        'lowrank' in method
    ):
        # torch.linalg.eigh synchronises with the host on CUDA to check
        # for errors (its documentation says so), once per factor: two per
        # layer on the decomposition step, which no library code controls
        # (the low-rank form's INVERSE decomposes with eigh too).
        eighs = EIGHS_PER_LAYER.get(method, 2)
        assert many[0] - few[0] == eighs * (9 - 3), (few, many)
        few, many = few[1:], many[1:]
    assert few == many


def test_the_sync_counter_sees_device_syncs(device: torch.device) -> None:
    needs_cuda(device)
    t = torch.ones(2, device=device)

    def two_reads() -> None:
        float(t.sum())
        t.tolist()

    assert count_syncs(two_reads) == 2
    assert count_syncs(lambda: t * 2) == 0

    # and in a gradient hook, which runs on autograd's CUDA thread
    w = torch.ones(2, device=device, requires_grad=True)

    def read(grad: torch.Tensor) -> None:
        float(grad.sum())

    def backward_with_a_read() -> None:
        out = w * 2
        out.register_hook(read)
        out.sum().backward()

    assert count_syncs(backward_with_a_read) == 1


class TokenMLP(nn.Module):
    """Linear layers on `(N, T, d)` rows and a Conv1d: positions to sample."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.transpose(1, 2))).transpose(1, 2)
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(h)))
        return out.mean(dim=1)


def reads_with_sampling(
    sample: float | None,
    in_hook: bool,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> tuple[list[int], list[int]]:
    """Host reads of forward plus backward, and of `step()`, in steps 0-3."""
    torch.manual_seed(0)
    model = TokenMLP().to(device)
    precon = KFACPreconditioner(
        model,
        factor_update_steps=2,
        inv_update_steps=4,
        update_factors_in_hook=in_hook,
        statistics=StatisticsConfig(position_sample=sample),
    )
    x = torch.randn(12, 10, 8, device=device)
    y = torch.randint(0, 4, (12,), device=device)
    passes, steps = [], []
    with monkeypatch.context() as patch:
        counts = count_reads(patch)
        for _ in range(4):
            before = counts.total()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            passes.append(counts.total() - before)
            before = counts.total()
            precon.step()
            steps.append(counts.total() - before)
    return passes, steps


@pytest.mark.parametrize('in_hook', [True, False])
def test_sampled_positions_add_no_host_reads(
    in_hook: bool, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    plain = reads_with_sampling(None, in_hook, monkeypatch, device)
    sampled = reads_with_sampling(0.3, in_hook, monkeypatch, device)
    assert sampled == plain
    assert plain[1] == [3, 1, 2, 1]  # as for the MLP above


def test_sampled_positions_add_no_device_syncs(device: torch.device) -> None:
    needs_cuda(device)
    torch.manual_seed(0)
    x = torch.randn(12, 10, 8, device=device)
    y = torch.randint(0, 4, (12,), device=device)
    counts = []
    for sample in (None, 0.3, None, 0.3):  # the first: warm-up
        model = TokenMLP().to(device)
        precon = KFACPreconditioner(
            model, statistics=StatisticsConfig(position_sample=sample)
        )

        def one_step(
            model: nn.Module = model, precon: KFACPreconditioner = precon
        ) -> None:
            F.cross_entropy(model(x), y).backward()
            precon.step()

        counts.append(count_syncs(one_step))
    assert counts[2] == counts[3]
