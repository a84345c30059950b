"""nn.Embedding through the whole preconditioner, against oracles.

* Twin: an embedding preconditions exactly as `nn.Linear(V, d,
  bias=False)` on one-hot inputs with the transposed weight, step after
  step (running averages, reused decompositions, KL clip, optimizer
  updates), in every input layout, for EIGEN with and without the
  eigenvalue outer product and for INVERSE.
* At batch size 1 without sharing, `A ⊗ G` is the per-example Fisher.
* A vocabulary of 50 000: no tensor of `V²` elements is ever allocated.
* Saved and resumed, a run continues bit for bit.
* On CUDA, forming `A` from indices adds no host synchronisation.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kfac._engine.report import format_report
from kfac.assignment import KAISAAssignment
from kfac.config import StatisticsConfig
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from tests.system.test_host_syncs import count_syncs
from tests.system.test_host_syncs import needs_cuda
from tests.system.test_host_syncs import preconditioner

F64 = torch.float64
VOCAB, DIM, CLASSES = 7, 4, 3

METHODS = [
    pytest.param({'compute_method': 'eigen'}, id='eigen-outer'),
    pytest.param(
        {'compute_method': 'eigen', 'compute_eigenvalue_outer_product': False},
        id='eigen',
    ),
    pytest.param({'compute_method': 'inverse'}, id='inverse'),
]


class Tokens(nn.Module):
    """Embedding, tanh, Linear head on every position."""

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = DIM,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.embed(x)))
        return out


class OneHot(nn.Module):
    """The twin of a `Tokens`: a Linear on one-hot inputs, same numbers."""

    def __init__(self, source: Tokens) -> None:
        super().__init__()
        vocab, dim = source.embed.weight.shape
        self.embed = nn.Linear(vocab, dim, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(source.embed.weight.T)
        self.head = copy.deepcopy(source.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = F.one_hot(x, self.embed.in_features).to(F64)
        out: torch.Tensor = self.head(torch.tanh(self.embed(inputs)))
        return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    return F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1))


def batch(shape: tuple[int, ...], step: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(step)
    # Token VOCAB - 1 never occurs: a zero entry of A.
    x = torch.randint(0, VOCAB - 1, shape, generator=generator)
    y = torch.randint(0, CLASSES, shape, generator=generator)
    return x, y


LAYOUTS = [
    pytest.param((5, 6), True, id='NT'),
    pytest.param((6, 5), False, id='TN'),
    pytest.param((5,), True, id='N'),
]


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize(('shape', 'batch_first'), LAYOUTS)
@pytest.mark.parametrize('padding_idx', [None, 0])
def test_embedding_preconditions_like_a_linear_on_one_hot_inputs(
    method: dict[str, Any],
    shape: tuple[int, ...],
    batch_first: bool,
    padding_idx: int | None,
) -> None:
    """With `padding_idx` the twin's padding column gets no gradient
    either (PyTorch gives the embedding's padding row none).
    """
    statistics = StatisticsConfig(batch_first=batch_first)
    check_twin(padding_idx, shape, statistics=statistics, **method)


@pytest.mark.parametrize(('shape', 'batch_first'), LAYOUTS[:2])
def test_token_averaged_loss_counts_positions_like_the_twin(
    shape: tuple[int, ...], batch_first: bool
) -> None:
    """`loss_average='batch+sequence'`: `G` averages over the `N T`
    positions the embedding reads from its output gradient's layout.
    """
    statistics = StatisticsConfig(
        batch_first=batch_first, loss_average='batch+sequence'
    )
    check_twin(None, shape, statistics=statistics)


def test_model_wide_reduce_leaves_embeddings_at_expand() -> None:
    """A model-wide `kfac_approx='reduce'` applies where it can; asking
    for it on an embedding by name is refused, with the override.
    """
    precon = KFACPreconditioner(
        Tokens(), statistics=StatisticsConfig(kfac_approx='reduce')
    )
    options = {
        e['name']: e['options'] for e in precon.describe()['preconditioned']
    }
    assert options['embed']['kfac_approx'] == {
        'value': 'expand',
        'source': 'model (embeddings: expand only)',
    }
    assert options['head']['kfac_approx']['value'] == 'reduce'
    with pytest.raises(ValueError, match="supports 'expand' only") as error:
        KFACPreconditioner(
            Tokens(), module_options={'embed': {'kfac_approx': 'reduce'}}
        )
    assert "module_options={'Embedding': {'kfac_approx': 'expand'}}" in str(
        error.value
    )


def check_twin(
    padding_idx: int | None, shape: tuple[int, ...], **kwargs: Any
) -> None:
    """Train an embedding model and its one-hot twin side by side; their
    factors, preconditioned gradients and weights agree at every step.
    """
    torch.manual_seed(0)
    model = Tokens(padding_idx=padding_idx).double()
    twin = OneHot(model).double()
    options = dict(
        factor_update_steps=1,
        inv_update_steps=2,
        factor_decay=0.8,
        damping=0.01,
        lr=0.1,
        **kwargs,
    )
    precons = [KFACPreconditioner(m, **options) for m in (model, twin)]
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for m in (model, twin)
    ]
    for step in range(4):
        x, y = batch(shape, step)
        for m, precon in zip((model, twin), precons):
            m.zero_grad()
            loss_of(m, x, y).backward()
            if padding_idx is not None and m is twin:
                assert twin.embed.weight.grad is not None
                twin.embed.weight.grad[:, padding_idx] = 0.0
            precon.step()
        ours, theirs = (p.layers['embed'] for p in precons)
        assert ours.a.value is not None and theirs.a.value is not None
        assert ours.a.value.shape == (VOCAB,)
        assert_rel_close(
            torch.diag(ours.a.value),
            theirs.a.value,
            rtol=1e-14,
            label='embedding A vs one-hot Linear',
        )
        assert_rel_close(
            ours.g.value,  # type: ignore[arg-type]  # a step above formed the factors
            theirs.g.value,  # type: ignore[arg-type]  # a step above formed the factors
            rtol=1e-12,
            label='embedding G vs one-hot Linear',
        )
        grad, twin_grad = model.embed.weight.grad, twin.embed.weight.grad
        assert grad is not None and twin_grad is not None
        assert_rel_close(
            grad.T,
            twin_grad,
            rtol=1e-12,
            label='embedding preconditioned grad vs one-hot Linear',
        )
        if padding_idx is not None:
            assert not grad[padding_idx].any()
        for optimizer in optimizers:
            optimizer.step()
    assert_rel_close(
        model.embed.weight.T,
        twin.embed.weight,
        rtol=1e-12,
        label='embedding weights after training vs one-hot Linear',
    )
    if padding_idx is not None:
        assert not model.embed.weight[padding_idx].any()


def test_batch_size_one_factors_equal_the_empirical_fisher() -> None:
    """`vec` stacks the columns of `V = (∇W)ᵀ`: the rows of `∇W`."""
    torch.manual_seed(0)
    model = Tokens().double()
    x, y = torch.tensor([3]), torch.tensor([1])
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (x,))
        return F.cross_entropy(out, y)

    grad = torch.func.grad(loss)(params)['embed.weight'].reshape(-1)
    precon = KFACPreconditioner(model, relative_clip=None)
    loss_of(model, x, y).backward()
    precon.step()
    layer = precon.layers['embed']
    assert layer.a.value is not None and layer.g.value is not None
    assert_rel_close(
        torch.kron(torch.diag(layer.a.value), layer.g.value),
        torch.outer(grad, grad),
        rtol=1e-12,
        label='embedding A⊗G vs per-example Fisher',
    )


class LargestStorage(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch does not annotate it
    """Records the largest storage any operation returns."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # as above
        self.largest = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                nbytes = t.untyped_storage().nbytes()
                self.largest = max(self.largest, nbytes)
        return out


@pytest.mark.parametrize('method', METHODS)
def test_large_vocabulary_never_forms_a_vocabulary_squared_tensor(
    method: dict[str, Any],
) -> None:
    """`V = 50 000`, `d = 8`: the largest tensor is gradient-sized."""
    vocab, dim = 50_000, 8
    torch.manual_seed(0)
    model = Tokens(vocab, dim)
    precon = KFACPreconditioner(model, **method)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (4, 16), generator=generator)
    y = torch.randint(0, CLASSES, (4, 16), generator=generator)
    mode = LargestStorage()
    with mode:
        for _ in range(2):
            model.zero_grad()
            loss_of(model, x, y).backward()
            precon.step()
    gradient_bytes = vocab * dim * 4
    # the gradient and the library's (d, V) tensors are seen, nothing larger
    assert mode.largest == gradient_bytes
    layer = precon.layers['embed']
    assert layer.a.shape == (vocab,)
    assert layer.a.value is not None and layer.a.value.shape == (vocab,)
    usage = layer.memory_usage()
    assert usage['a_factors'] == vocab * 4
    assert precon.memory_usage()['total'] < 4 * gradient_bytes
    report = precon.describe()['preconditioned']
    assert report[0]['A'] == (vocab,)
    assert report[0]['factor_bytes'] == (vocab + dim * dim) * 4
    text = format_report(precon.describe())
    assert '  embed (Embedding): A diag(50000), G 8x8;' in text


def test_kaisa_cost_of_a_diagonal_factor_is_its_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, dict[str, float]] = {}
    real = KAISAAssignment

    def spy(work: dict[str, dict[str, float]], **kwargs: Any) -> Any:
        seen.update(work)
        return real(work, **kwargs)

    monkeypatch.setattr('kfac.preconditioner.KAISAAssignment', spy)
    KFACPreconditioner(Tokens(50, 6))
    assert seen['embed'] == {'A': 50.0, 'G': 6.0**3}
    KFACPreconditioner(Tokens(50, 6), assignment_strategy='memory')
    assert seen['embed'] == {'A': 50.0, 'G': 6.0**2}


def roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run(
    model: nn.Module,
    precon: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    steps: range,
) -> None:
    for step in steps:
        x, y = batch((4, 5), step)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        precon.step()
        optimizer.step()


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('decompositions', [True, False])
def test_resume_with_an_embedding_is_bit_identical(
    method: dict[str, Any], decompositions: bool
) -> None:
    options = dict(factor_update_steps=2, inv_update_steps=3, **method)
    torch.manual_seed(0)
    model = Tokens(padding_idx=1)
    resumed = copy.deepcopy(model)
    precon = KFACPreconditioner(model, **options)

    def make(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    optimizer = make(model)
    run(model, precon, optimizer, range(4))
    checkpoint = roundtrip(
        {
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
            'kfac': precon.state_dict(include_decompositions=decompositions),
        }
    )
    assert checkpoint['kfac']['layers']['embed']['A'].shape == (VOCAB,)
    if decompositions:
        saved = checkpoint['kfac']['decompositions']['embed']['A']
        layout = precon.layers['embed'].decomposition_layout('A')
        assert [tuple(t.shape) for t in saved] == [s for s, _ in layout]
    run(model, precon, optimizer, range(4, 8))
    precon2 = KFACPreconditioner(resumed, **options)
    optimizer2 = make(resumed)
    resumed.load_state_dict(checkpoint['model'])
    optimizer2.load_state_dict(checkpoint['optimizer'])
    precon2.load_state_dict(checkpoint['kfac'])
    run(resumed, precon2, optimizer2, range(4, 8))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_statistics_kept_until_the_update_give_the_same_factors() -> None:
    """`update_factors_in_hook=False` keeps the indices until the update."""
    layers = []
    for in_hook in (True, False):
        torch.manual_seed(0)
        model = Tokens().double()
        precon = KFACPreconditioner(model, update_factors_in_hook=in_hook)
        for step in range(2):
            x, y = batch((5, 6), step)
            model.zero_grad()
            loss_of(model, x, y).backward()
            precon.step()
        layers.append(precon.layers['embed'])
    hooked, kept = layers
    for name in ('A', 'G'):
        value, other = hooked.factor(name).value, kept.factor(name).value
        assert value is not None and other is not None
        assert_rel_close(other, value, rtol=1e-15, label='embedding in hook')


class ManyEmbeddings(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeds = nn.ModuleList(nn.Embedding(50, 8) for _ in range(count))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.stack([torch.tanh(e(x)) for e in self.embeds]).sum(0)
        out: torch.Tensor = self.head(hidden.mean(dim=1))
        return out


def test_embeddings_add_no_device_synchronisation(
    device: torch.device,
) -> None:
    """Forming `A` from indices never reads a device value on the host
    (`torch.bincount` would, on CUDA): steps 1-3 (a factor update, no
    decomposition) synchronise as often with one embedding as with three.
    """
    needs_cuda(device)

    def syncs(count: int) -> int:
        model = ManyEmbeddings(count).to(device)
        precon = preconditioner(model, 'inverse')
        generator = torch.Generator().manual_seed(0)
        x = torch.randint(0, 50, (4, 6), generator=generator).to(device)
        y = torch.randint(0, CLASSES, (4,), generator=generator).to(device)
        total = 0
        for step in range(4):
            loss = F.cross_entropy(model(x), y)
            model.zero_grad()

            def backward_and_step(loss: torch.Tensor = loss) -> None:
                loss.backward()
                precon.step()

            found = count_syncs(backward_and_step)
            total += found if step else 0
        return total

    syncs(1)  # warm-up: lazy CUDA initialisation
    assert syncs(1) == syncs(3)
