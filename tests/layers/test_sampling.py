"""Factor statistics on sampled positions (`position_sample`), float64.

The positions are drawn here by a plain-Python rendering of the keyed rule
documented in `kfac.layers.sampling`, and the factors are compared with
the dense references of `testing.reference` on those positions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers import conv as conv_module
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.sampling import MODULUS
from kfac.layers.sampling import PositionSampler
from kfac.layers.sampling import SampleKey
from kfac.layers.sampling import check_position_sample
from kfac.layers.sampling import check_seed
from kfac.layers.sampling import draw_positions
from kfac.layers.sampling import sample_size
from kfac.preconditioner import KFACPreconditioner
from kfac.state import SEED_LIMIT
from testing.reference import conv_patches
from testing.reference import linear_factors

DT = torch.float64
ROUNDS = ((48271, 13), (69621, 11), (16807, 15), (39373, 12))


def mix(h: int, v: int) -> int:
    """The documented hash, in Python integers."""
    u = h ^ v
    for multiplier, shift in ROUNDS:
        u = (u * multiplier + 11) % (2**31 - 1)
        u ^= u >> shift
    return u


def drawn(seed: int, step: int, index: int, t: int, k: int) -> list[int]:
    """The documented draw: the k positions of smallest `mix(e, t) T + t`."""
    p = 2**31 - 1
    e = mix(mix(mix(0, seed), step % p), index % p)
    return sorted(sorted(range(t), key=lambda s: mix(e, s) * t + s)[:k])


class SeqNet(nn.Module):
    """A convolution on images and a Linear on `(N, T, d)` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.lin = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(torch.tanh(self.conv(x)).flatten(2))
        return out


def captured(
    model: SeqNet, x: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{name: (input, grad_output)}` of one forward and backward."""
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> object:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor):  # type: ignore[type-arg,no-untyped-def]  # a torch hook
            seen[name] = [inputs[0].detach()]
            output.register_hook(lambda g: seen[name].append(g.detach()))

        return hook

    handles = [
        m.register_forward_hook(keep(n))  # type: ignore[arg-type]  # a hook
        for n, m in model.named_children()
    ]
    model(x).pow(2).mean().backward()
    for handle in handles:
        handle.remove()
    return {n: (v[0], v[1]) for n, v in seen.items()}


def factors(
    option: object, seed: int = 0, **kwargs: object
) -> dict[str, torch.Tensor]:
    """The factors after one step of `SeqNet` on a fixed batch."""
    torch.manual_seed(0)
    model = SeqNet().to(DT)
    statistics = StatisticsConfig(
        position_sample=option,  # type: ignore[arg-type]  # options under test
        position_sample_seed=seed,
    )
    precon = KFACPreconditioner(model, statistics=statistics, **kwargs)  # type: ignore[arg-type]  # options under test
    x = torch.randn(6, 2, 4, 4, dtype=DT)
    model(x).pow(2).mean().backward()
    precon.step()
    layers = precon.state_dict()['layers']
    return {f'{n}.{f}': layers[n][f] for n in layers for f in 'AG'}


@pytest.mark.parametrize('option', [1.0, 16, 1000])
def test_every_position_drawn_is_todays_factors_exactly(
    option: object,
) -> None:
    plain = factors(None)
    sampled = factors(option)
    assert all(torch.equal(sampled[k], plain[k]) for k in plain)


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('option', [0.25, 2])
def test_sampled_factors_equal_dense_ones_on_the_drawn_positions(
    option: float, in_hook: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Patches a few examples at a time: the examples' indices must run on.
    monkeypatch.setattr(conv_module, 'PATCH_BLOCK_ELEMENTS', 18 * 16 * 2)
    seed = 12345
    got = factors(option, seed=seed, update_factors_in_hook=in_hook)
    torch.manual_seed(0)
    model = SeqNet().to(DT)
    x = torch.randn(6, 2, 4, 4, dtype=DT)
    data = captured(model, x)
    conv_in, conv_grad = data['conv']
    patches = conv_patches(model.conv, conv_in)  # (N, 16, 18)
    conv_g = conv_grad.flatten(2).transpose(1, 2)  # (N, 16, 3)
    lin_in, lin_grad = data['lin']  # (N, 3, 16), (N, 3, 5)
    for name, rows, grads in (
        ('conv', patches, conv_g),
        ('lin', lin_in, lin_grad),
    ):
        t = rows.shape[1]
        k = sample_size(option, t)
        assert k < t
        index = torch.tensor([drawn(seed, 0, i, t, k) for i in range(6)])
        pick = index[:, :, None]
        a, g = linear_factors(
            rows.gather(1, pick.expand(-1, -1, rows.shape[2])),
            grads.gather(1, pick.expand(-1, -1, grads.shape[2])),
            bias=True,
        )
        torch.testing.assert_close(got[f'{name}.A'], a, rtol=1e-13, atol=0)
        torch.testing.assert_close(
            got[f'{name}.G'], g * (t / k), rtol=1e-12, atol=0
        )


def test_sampled_factors_average_to_the_full_ones() -> None:
    """Over `M` draws (steps), the mean of the sampled batch factors is
    within 6 standard deviations of the full ones, entry by entry, the
    deviation computed from the count: without replacement, an example's
    mean over `k` of `T` values has variance `σ² (T - k) / (k (T - 1))`.
    """
    torch.manual_seed(3)
    n, t, k, draws = 4, 12, 3, 400
    x = torch.randn(n, t, 5, dtype=DT)
    go = torch.randn(n, t, 2, dtype=DT)
    helper = LinearModuleHelper(nn.Linear(5, 2).to(DT))
    step = [0]
    helper.sampler = PositionSampler(k, SampleKey(lambda: (7, step[0])))
    mean_a = torch.zeros(6, 6, dtype=DT)
    mean_g = torch.zeros(2, 2, dtype=DT)
    for step[0] in range(draws):
        total_a, rows = helper.a_statistic(x, DT)
        total_g, examples = helper.g_statistic(go, DT, 1.0, per_example=True)
        mean_a += total_a / rows / draws
        mean_g += total_g / examples / draws
    full_a, full_g = linear_factors(x, go, bias=True)
    # Per example and entry: the population of T products y_t.
    ones = torch.ones(n, t, 1, dtype=DT)
    xa = torch.cat([x, ones], 2)
    ya = xa[..., :, None] * xa[..., None, :]  # (n, t, 6, 6)
    g = go * n
    yg = t * g[..., :, None] * g[..., None, :]  # T y_t: G's per-example sum
    for y, full, mean in ((ya, full_a, mean_a), (yg, full_g, mean_g)):
        sigma2 = y.var(dim=1, unbiased=False)
        per_example = sigma2 * (t - k) / (k * (t - 1))
        std = (per_example.sum(0) / n**2 / draws).sqrt()
        assert torch.all((mean - full).abs() <= 6 * std + 1e-12)
        # and the sample is not the full factor itself
        assert not torch.allclose(mean, full, rtol=1e-6, atol=0)


def test_draw_is_the_documented_rule_on_any_device(
    device: torch.device,
) -> None:
    indices = torch.arange(5, 40, device=device)
    got = draw_positions(99, 2**40 + 3, indices, 20, 7)
    expected = [drawn(99, 2**40 + 3, i, 20, 7) for i in range(5, 40)]
    assert got.cpu().tolist() == expected


def test_the_state_limit_is_the_modulus() -> None:
    assert SEED_LIMIT == MODULUS


def test_sample_size() -> None:
    assert [sample_size(3, t) for t in (1, 3, 10)] == [1, 3, 3]
    assert [sample_size(0.25, t) for t in (1, 4, 10)] == [1, 1, 3]
    assert sample_size(1.0, 7) == 7
    assert math.ceil(0.25 * 10) == 3


@pytest.mark.parametrize(
    ('value', 'error'),
    [
        (True, TypeError),
        ('1', TypeError),
        (0, ValueError),
        (0.0, ValueError),
        (1.5, ValueError),
        (float('nan'), ValueError),
    ],
)
def test_bad_position_sample(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match='position_sample'):
        check_position_sample(value)
    with pytest.raises(error, match='position_sample'):
        StatisticsConfig(position_sample=value)  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(error, match='position_sample'):
        KFACPreconditioner(
            SeqNet(), module_options={'lin': {'position_sample': value}}
        )


@pytest.mark.parametrize(
    ('value', 'error'),
    [(-1, ValueError), (2**31 - 1, ValueError), (1.0, TypeError)],
)
def test_bad_seed(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match='position_sample_seed'):
        check_seed(value)
    with pytest.raises(error, match='position_sample_seed'):
        StatisticsConfig(position_sample_seed=value)  # type: ignore[arg-type]  # wrong on purpose


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.red = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.red(self.lin(self.emb(x)))
        return out


def test_model_wide_value_leaves_what_cannot_sample_unsampled() -> None:
    precon = KFACPreconditioner(
        EmbedNet(),
        module_options={'red': {'kfac_approx': 'reduce'}},
        statistics=StatisticsConfig(position_sample=0.5),
    )
    helpers = precon.registration.helpers
    assert helpers['emb'].sampler is None
    assert helpers['red'].sampler is None
    sampler = helpers['lin'].sampler
    assert sampler is not None and sampler.option == 0.5
    assert repr(sampler) == 'PositionSampler(0.5)'
    sources = precon.registration.sources
    assert sources['emb']['position_sample'].startswith('model (not sampled')
    assert 'expand' in sources['red']['position_sample']
    assert precon.registration.options['red'].position_sample is None


@pytest.mark.parametrize(
    ('options', 'match'),
    [
        ({'emb': {'position_sample': 2}}, 'EmbeddingModuleHelper'),
        (
            {'red': {'position_sample': 2, 'kfac_approx': 'reduce'}},
            'expand',
        ),
    ],
)
def test_module_options_on_what_cannot_sample_is_refused(
    options: dict[str, dict[str, object]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(EmbedNet(), module_options=options)


def test_a_sampled_step_trains(device: torch.device) -> None:
    torch.manual_seed(0)
    model = SeqNet().to(device)
    precon = KFACPreconditioner(
        model, statistics=StatisticsConfig(position_sample=0.5)
    )
    x = torch.randn(6, 2, 4, 4, device=device)
    F.mse_loss(model(x), torch.zeros(6, 3, 5, device=device)).backward()
    precon.step()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
