"""EKFAC's scaling against per-example gradients from ``torch.func``.

After one step on one batch (float64, first factor update: no running
average yet) each layer's ``S`` must equal
``(1/Z) Σ_n (Q_Gᵀ V_n Q_A)²``, with ``V_n`` the gradient matrix of example
``n``'s loss computed by ``torch.func`` (``testing.reference``) and the
bases the layer holds; and at batch size 1 without weight sharing the
preconditioned gradient is the exact empirical Fisher block's damped
inverse applied to ``V``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.base import KFACBaseLayer
from kfac.layers.blocks import BlockHelper
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.models import AttentionNet
from testing.models import TinyCNN
from testing.models import TinyMLP
from testing.models import classification_data
from testing.reference import ekfac_scale_reference
from testing.reference import grad_matrix
from testing.reference import per_example_fisher
from testing.reference import per_example_grads
from testing.reference import unvec
from testing.reference import vec

F64 = torch.float64
RTOL = 1e-11
N, T, D, H, C, VOCAB = 4, 5, 3, 6, 3, 7

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Grads = dict[str, torch.Tensor]


class SequenceNet(nn.Module):
    """Per-token logits of a two-layer MLP on `(N, T, D)`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


class TokenNet(nn.Module):
    """An embedding and a head over the token's vector, per token; the head
    shares the embedding's weight when `tied`.
    """

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mix(self.emb(tokens))))
        return out


class Siamese(nn.Module):
    """One Linear called twice per example (its halves), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(D, H)
        self.head = nn.Linear(2 * H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.shared(x[:, :D]), self.shared(x[:, D:])
        out: torch.Tensor = self.head(torch.tanh(torch.cat([left, right], 1)))
        return out


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the examples and their tokens."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def one_step(
    model: nn.Module,
    loss: Loss,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    update_factors_in_hook: bool = True,
    **statistics: Any,
) -> KFACPreconditioner:
    """One EKFAC step with the statistics options `statistics`."""
    precon = KFACPreconditioner(
        model,
        compute_method='ekfac',
        relative_clip=None,
        update_factors_in_hook=update_factors_in_hook,
        statistics=StatisticsConfig(**statistics),
    )
    loss(model(x), y).backward()
    precon.step()
    return precon


def weight_grads(grads: Grads, module: str, bias: bool = True) -> torch.Tensor:
    """`V_n = [∇W_n, ∇b_n]`, `(N, out, in[+1])`."""
    w = grads[f'{module}.weight']
    v = w.reshape(w.shape[0], w.shape[1], -1)
    if bias and f'{module}.bias' in grads:
        v = torch.cat([v, grads[f'{module}.bias'][:, :, None]], dim=2)
    return v


def bases(layer: KFACBaseLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Q_G, Q_A)` held by the layer (`Q_A = I` for a diagonal `A`)."""
    a, g = layer.a.decomposition, layer.g.decomposition
    assert a is not None and g is not None
    qa = torch.eye(layer.a.dim, dtype=F64) if layer.a.diagonal else a[0]
    return g[0], qa


def check_scale(
    precon: KFACPreconditioner,
    name: str,
    grads: torch.Tensor,
    terms: int,
    label: str,
) -> None:
    layer = precon.layers[name]
    curvature = layer.curvature
    assert isinstance(curvature, EKFACCurvature)
    assert curvature.scale is not None
    qg, qa = bases(layer)
    expected = ekfac_scale_reference(grads, qg, qa, terms)
    assert_rel_close(curvature.scale, expected, rtol=RTOL, label=label)


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('bias', [True, False])
def test_linear(bias: bool, in_hook: bool) -> None:
    """With statistics formed in the hooks or at the step alike."""
    torch.manual_seed(0)
    model = TinyMLP(bias=bias).double()
    x, y = classification_data(N, (6,))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(
        model, F.cross_entropy, x, y, update_factors_in_hook=in_hook
    )
    for name in ('fc1', 'fc2'):
        v = weight_grads(grads, name)
        check_scale(precon, name, v, N, 'EKFAC S: linear')


@pytest.mark.parametrize('approx', ['expand', 'reduce'])
@pytest.mark.parametrize('average', ['batch', 'batch+sequence'])
def test_linear_on_sequences(approx: str, average: str) -> None:
    """`V_n` sums the positions (under reduce too); with
    `'batch+sequence'`, `g = N T ∂L/∂s` and `Z = N T`.
    """
    torch.manual_seed(1)
    model = SequenceNet().double()
    x = torch.randn(N, T, D, dtype=F64)
    y = torch.randint(0, C, (N, T))
    grads = per_example_grads(model, token_loss, x, y)
    precon = one_step(
        model, token_loss, x, y, kfac_approx=approx, loss_average=average
    )
    sequence = average == 'batch+sequence'
    for name in ('fc1', 'fc2'):
        v = weight_grads(grads, name) * (T if sequence else 1)
        terms = N * T if sequence else N
        check_scale(precon, name, v, terms, 'EKFAC S: sequences')


@pytest.mark.parametrize('approx', ['expand', 'reduce'])
def test_conv2d(approx: str) -> None:
    torch.manual_seed(2)
    model = TinyCNN().double()
    x, y = classification_data(N, (2, 8, 8))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(model, F.cross_entropy, x, y, kfac_approx=approx)
    for name in ('conv1', 'conv2', 'fc'):
        v = weight_grads(grads, name)
        check_scale(precon, name, v, N, 'EKFAC S: conv2d')


def test_conv_gradient_first_form() -> None:
    """A convolution over many positions with few channels forms each
    example's gradient first, then rotates it (the other exact form).
    """
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 2, 2), nn.Flatten(), nn.Linear(98, C))
    model.double()
    x, y = classification_data(N, (1, 8, 8))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(model, F.cross_entropy, x, y)
    check_scale(precon, '0', weight_grads(grads, '0'), N, 'EKFAC S: conv2d')


@pytest.mark.parametrize('tied', [False, True])
@pytest.mark.parametrize('max_factor_dim', [None, 4])
def test_embedding_and_tied_head(
    tied: bool, max_factor_dim: int | None
) -> None:
    """Repeated tokens in an example add before squaring; the tied weight's
    `V_n` sums both uses; with `max_factor_dim=4` each tile's `S` is the
    tile of the whole `V_n`'s.
    """
    torch.manual_seed(4)
    model = TokenNet(tied).double()
    x = torch.randint(0, VOCAB, (N, T))
    x[0, :3] = 2  # a token repeated in one example
    y = torch.randint(0, VOCAB, (N, T))
    grads = per_example_grads(model, token_loss, x, y)
    precon = one_step(model, token_loss, x, y, max_factor_dim=max_factor_dim)
    wholes = {
        'emb': grads['emb.weight'].transpose(1, 2),
        'mix': weight_grads(grads, 'mix'),
    }
    if not tied:
        wholes['head'] = weight_grads(grads, 'head')
    seen = set()
    for name, helper in precon.registration.helpers.items():
        module = precon.registration.blocks.get(name, name)
        v = wholes[module]
        if isinstance(helper, BlockHelper) or hasattr(helper, 'embedding'):
            tile = getattr(helper, 'embedding', helper)
            if isinstance(tile, BlockHelper):
                v = v[:, tile.rows, tile.cols]
        check_scale(precon, name, v, N, 'EKFAC S: embedding')
        seen.add(module)
    assert seen == set(wholes)
    if max_factor_dim is not None:
        assert len(precon.registration.blocks) > 1
    usage = precon.memory_usage()  # S and the kept 1 / (S + λ), float64
    assert usage['scale'] == sum(16 * v[0].numel() for v in wholes.values())


def test_grouped_convolution() -> None:
    """Each group is a layer of its own: its rows of `V_n`."""
    torch.manual_seed(9)
    model = nn.Sequential(
        nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(16, C)
    ).double()
    x, y = classification_data(N, (4, 4, 4))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(model, F.cross_entropy, x, y)
    v = weight_grads(grads, '0')
    for group in (0, 1):
        rows = slice(2 * group, 2 * group + 2)
        check_scale(
            precon, f'0.group{group}', v[:, rows], N, 'EKFAC S: groups'
        )


def test_sequence_first_embedding_and_linear() -> None:
    """`batch_first=False`: examples are the second dimension."""
    torch.manual_seed(10)
    model = TokenNet(tied=False).double()
    x = torch.randint(0, VOCAB, (N, T))
    y = torch.randint(0, VOCAB, (N, T))
    grads = per_example_grads(model, token_loss, x, y)
    precon = KFACPreconditioner(
        model,
        compute_method='ekfac',
        relative_clip=None,
        statistics=StatisticsConfig(batch_first=False),
    )
    token_loss(model(x.T), y.T).backward()
    precon.step()
    wholes = {
        'emb': grads['emb.weight'].transpose(1, 2),
        'mix': weight_grads(grads, 'mix'),
        'head': weight_grads(grads, 'head'),
    }
    for name, v in wholes.items():
        check_scale(precon, name, v, N, 'EKFAC S: sequence first')
    usage = precon.memory_usage()  # S and the kept 1 / (S + λ), float64
    assert usage['scale'] == sum(16 * v[0].numel() for v in wholes.values())
    assert usage['example_rows'] == 0  # handed over in the step


def test_attention_projections() -> None:
    torch.manual_seed(5)
    model = AttentionNet().double()
    x, y = classification_data(N, (T, 8))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(model, F.cross_entropy, x, y)
    e = model.attn.embed_dim
    for index, name in enumerate(('q_proj', 'k_proj', 'v_proj')):
        rows = slice(index * e, (index + 1) * e)
        w = grads['attn.in_proj_weight'][:, rows]
        b = grads['attn.in_proj_bias'][:, rows, None]
        v = torch.cat([w, b], dim=2)
        check_scale(precon, f'attn.{name}', v, N, 'EKFAC S: attention')
    for name in ('embed', 'attn.out_proj', 'head'):
        v = weight_grads(grads, name)
        check_scale(precon, name, v, N, 'EKFAC S: attention')


def test_module_called_twice_sums_both_calls() -> None:
    torch.manual_seed(6)
    model = Siamese().double()
    x, y = classification_data(N, (2 * D,))
    grads = per_example_grads(model, F.cross_entropy, x, y)
    precon = one_step(model, F.cross_entropy, x, y)
    v = weight_grads(grads, 'shared')
    check_scale(precon, 'shared', v, N, 'EKFAC S: two calls')


def test_calls_of_different_sizes_are_refused() -> None:
    model = Siamese().double()
    precon = KFACPreconditioner(model, compute_method='ekfac')
    x = torch.randn(3, 2 * D, dtype=F64)
    left = model.shared(x[:, :D])
    right = model.shared(x[:2, D:])
    (left.sum() + right.sum()).backward()
    with pytest.raises(ValueError, match='different numbers of examples'):
        precon.step()


def test_summed_loss_is_not_averaged() -> None:
    torch.manual_seed(7)
    model = TinyMLP().double()
    x, y = classification_data(N, (6,))

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, reduction='sum')

    grads = per_example_grads(model, summed, x, y)
    precon = one_step(model, summed, x, y, loss_average=None)
    check_scale(precon, 'fc1', weight_grads(grads, 'fc1'), 1, 'EKFAC S: sum')


def test_batch_of_one_is_the_exact_fisher_block() -> None:
    """At batch size 1 without weight sharing, `V' = (F + λ I)⁻¹ vec V`
    with `F = vec(∇ℓ) vec(∇ℓ)ᵀ`, the layer's empirical Fisher block.
    """
    torch.manual_seed(8)
    damping = 0.1
    model = TinyMLP().double()
    x, y = classification_data(1, (6,))
    fishers = {
        name: per_example_fisher(model, name, F.cross_entropy, x, y)
        for name in ('fc1', 'fc2')
    }
    precon = KFACPreconditioner(
        model, compute_method='ekfac', relative_clip=None, damping=damping
    )
    F.cross_entropy(model(x), y).backward()
    raw = {name: grad_matrix(model.get_submodule(name)) for name in fishers}
    raw = {name: v.clone() for name, v in raw.items()}
    precon.step()
    for name, fisher in fishers.items():
        damped = fisher + damping * torch.eye(fisher.shape[0], dtype=F64)
        v = raw[name]
        expected = unvec(torch.linalg.solve(damped, vec(v)), tuple(v.shape))  # type: ignore[arg-type]
        got = grad_matrix(model.get_submodule(name))
        assert_rel_close(got, expected, rtol=1e-9, label='EKFAC: exact Fisher')
