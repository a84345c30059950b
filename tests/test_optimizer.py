"""`KFACOptimizer`: the preconditioner as a `torch.optim.Optimizer`."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data
from testing.torch_release import MUON

F32 = torch.float32


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(8, (6,), seed=seed, dtype=F32)


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    return F.cross_entropy(model(x), y)


def build(
    model: TinyMLP | None = None,
    *,
    base: Callable[[Any], torch.optim.Optimizer] | None = None,
    **options: Any,
) -> tuple[TinyMLP, KFACOptimizer]:
    torch.manual_seed(0)
    model = model or TinyMLP()
    make = base or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    precon = KFACPreconditioner(model, damping=0.01, **options)
    return model, KFACOptimizer(make(model.parameters()), precon)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_front_door() -> None:
    assert kfac.KFACOptimizer is KFACOptimizer
    assert 'KFACOptimizer' in kfac.__all__


def test_step_is_precondition_then_base_step() -> None:
    model, opt = build()
    ref = copy.deepcopy(model)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_pre = KFACPreconditioner(ref, damping=0.01, optimizer=ref_sgd)
    for seed in range(3):
        opt.zero_grad()
        loss_of(model, seed).backward()
        opt.step()
        ref_sgd.zero_grad()
        loss_of(ref, seed).backward()
        ref_pre.step()
        ref_sgd.step()
    assert opt.preconditioner.steps == 3
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = copy.deepcopy(ref)
    ref_pre.remove()
    # K-FAC changed the step: a plain SGD step differs.
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss_of(plain, 5).backward()
    plain_sgd.step()
    assert not torch.equal(plain.fc1.weight, ref.fc1.weight)


def test_closure_runs_with_grad_and_returns_the_loss() -> None:
    model, opt = build()
    ref, ref_opt = build(copy.deepcopy(model))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    ref_opt.zero_grad()
    want = loss_of(ref, 0)
    want.backward()
    assert ref_opt.step() is None
    assert loss.item() == want.item()
    torch.testing.assert_close(model.fc1.weight, ref.fc1.weight)
    assert opt.preconditioner.steps == 1


def test_param_groups_state_and_defaults_are_the_base_optimizers() -> None:
    model, opt = build()
    base = opt.base_optimizer
    assert opt.param_groups is base.param_groups
    assert opt.defaults is base.defaults
    loss_of(model, 0).backward()
    opt.step()
    assert opt.state is base.state and len(base.state) == 4
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.param_groups = [dict(g) for g in base.param_groups]
    opt.state = copy.copy(base.state)
    opt.defaults = dict(base.defaults)
    assert opt.param_groups is base.param_groups
    assert opt.state is base.state and opt.defaults is base.defaults
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({'params': [extra]})
    assert base.param_groups[-1]['params'] == [extra]
    assert repr(opt).startswith('KFACOptimizer(SGD, KFACPreconditioner(')


def test_lr_scheduler_reaches_the_preconditioner() -> None:
    model, opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for seed in range(3):
        opt.zero_grad()
        loss_of(model, seed).backward()
        opt.step()
        lrs.append(opt.preconditioner.lr)
        sched.step()
    assert lrs == [0.1, 0.05, 0.025]
    assert opt.base_optimizer.param_groups[0]['lr'] == 0.0125


def train(model: nn.Module, opt: KFACOptimizer, seeds: range) -> None:
    for seed in seeds:
        opt.zero_grad()
        loss_of(model, seed).backward()
        opt.step()


def test_state_dict_resume_equals_uninterrupted() -> None:
    model, opt = build(factor_update_steps=2, inv_update_steps=3)
    train(model, opt, range(4))
    buffer = io.BytesIO()
    torch.save(
        {'model': model.state_dict(), 'optimizer': opt.state_dict()}, buffer
    )
    train(model, opt, range(4, 8))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = build(factor_update_steps=2, inv_update_steps=3)
    resumed.load_state_dict(saved['model'])
    resumed_opt.load_state_dict(saved['optimizer'])
    assert resumed_opt.preconditioner.steps == 4
    train(resumed, resumed_opt, range(4, 8))
    for got, want in zip(
        resumed.parameters(), model.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_load_state_dict_keeps_the_lr_following_the_base_optimizer() -> None:
    model, opt = build()
    state = opt.state_dict()
    state['base_optimizer']['param_groups'][0]['lr'] = 0.3
    opt.load_state_dict(state)
    # The base's groups are new dicts now; the preconditioner reads them.
    opt.param_groups[0]['lr'] = 0.02
    loss_of(model, 0).backward()
    opt.step()
    assert opt.preconditioner.lr == 0.02


@pytest.mark.parametrize(
    'state', [{'state': {}, 'param_groups': []}, [], {'base_optimizer': {}}]
)
def test_load_state_dict_refuses_another_format(state: Any) -> None:
    _, opt = build()
    with pytest.raises(ValueError, match="'base_optimizer' and"):
        opt.load_state_dict(state)


def test_arguments_are_checked() -> None:
    model, opt = build()
    with pytest.raises(TypeError, match='base_optimizer must be'):
        KFACOptimizer(model, opt.preconditioner)  # type: ignore[arg-type]  # the error tested
    with pytest.raises(TypeError, match='preconditioner must be'):
        KFACOptimizer(opt.base_optimizer, model)  # type: ignore[arg-type]  # the error tested
    with pytest.raises(TypeError, match='already a KFACOptimizer'):
        KFACOptimizer(opt, opt.preconditioner)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match='fc1, fc2 are in no param group'):
        KFACOptimizer(other, opt.preconditioner)


def test_stepping_the_base_optimizer_directly_is_refused() -> None:
    model, opt = build()
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match='stepped directly, without K-FAC'):
        opt.base_optimizer.step()
    opt.remove()
    opt.base_optimizer.step()  # hooks removed: the base steps alone
    loss_of(model, 1).backward()
    opt.step()  # no accumulation check without the hooks
    assert opt.preconditioner.steps == 1


def test_accumulation_must_agree() -> None:
    model, opt = build(accumulation_steps=2)
    loss_of(model, 0).backward()
    # fewer passes: a short step, which needs the trainer's divisor (see
    # tests/engine/test_short_accumulation.py)
    with pytest.raises(ValueError, match='after 1 backward passes, fewer'):
        opt.step()
    for _ in range(2):
        loss_of(model, 0).backward()
    with pytest.raises(ValueError, match='3 backward passes since the last'):
        opt.step()
    model, opt = build(accumulation_steps=2)
    for _ in range(2):
        loss_of(model, 0).backward()
        loss_of(model, 1).backward()
        opt.step()
        opt.zero_grad()
    assert opt.preconditioner.steps == 2


def test_frozen_layers_need_no_count() -> None:
    model = TinyMLP()
    precon = KFACPreconditioner(model, damping=0.01)
    model.fc1.weight.requires_grad_(False)
    model.fc2.weight.requires_grad_(False)
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), precon)
    loss_of(model, 0).backward()
    loss_of(model, 1).backward()  # not counted: no registered weight trains
    opt.step()
    assert precon.steps == 1


@MUON
def test_composes_with_muon() -> None:
    model, opt = build(
        TinyMLP(bias=False),
        base=lambda p: torch.optim.Muon(p, lr=0.02, weight_decay=0.0),
    )
    before = params(model)
    train(model, opt, range(2))
    assert opt.preconditioner.steps == 2
    assert opt.preconditioner.lr == 0.02
    assert all(
        not torch.equal(a, b)
        for a, b in zip(before, model.parameters(), strict=True)
    )


# Loss scaling ----------------------------------------------------------------


def scaled(**options: Any) -> tuple[TinyMLP, KFACOptimizer, Any]:
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0**10)
    model, opt = build(
        grad_scaler=scaler, update_factors_in_hook=False, **options
    )
    return model, opt, scaler


def scaled_step(
    model: TinyMLP,
    opt: KFACOptimizer,
    scaler: Any,
    seed: int,
    *,
    unscale: bool = False,
    poison: bool = False,
) -> None:
    opt.zero_grad()
    scaler.scale(loss_of(model, seed)).backward()
    if poison:
        assert model.fc1.bias.grad is not None
        model.fc1.bias.grad[0] = float('inf')
    if unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize('unscale', [False, True])
def test_grad_scaler_equals_unscaled_training(unscale: bool) -> None:
    model, opt, scaler = scaled()
    ref, ref_opt = build(copy.deepcopy(model))
    for seed in range(3):
        scaled_step(model, opt, scaler, seed, unscale=unscale)
    train(ref, ref_opt, range(3))
    assert opt.preconditioner.steps == 3
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_skipped_step_leaves_no_statistics_and_no_count() -> None:
    model, opt, scaler = scaled(factor_decay=0.5)
    ref, ref_opt, ref_scaler = scaled(factor_decay=0.5)
    scaled_step(model, opt, scaler, 0)
    scaled_step(model, opt, scaler, 1, poison=True)
    assert opt.preconditioner.steps == 1
    assert scaler.get_scale() == 2.0**9  # the scaler did skip
    scaled_step(model, opt, scaler, 2)
    for seed in (0, 2):
        scaled_step(ref, ref_opt, ref_scaler, seed)
    assert opt.preconditioner.steps == ref_opt.preconditioner.steps == 2
    got = opt.preconditioner.state_dict()['layers']
    want = ref_opt.preconditioner.state_dict()['layers']
    for name in ('fc1', 'fc2'):
        for key in ('A', 'G'):
            torch.testing.assert_close(
                got[name][key], want[name][key], rtol=1e-6, atol=0
            )
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_scaled_gradients_cannot_be_preconditioned() -> None:
    model, opt, scaler = scaled()
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(RuntimeError, match='scaled by the grad_scaler'):
        opt.step()
    with pytest.raises(RuntimeError, match='stepped directly'):
        scaler.step(opt.base_optimizer)
    assert opt.preconditioner.steps == 0


def test_a_scaler_the_preconditioner_does_not_know_is_refused() -> None:
    model, opt = build()
    scaler = torch.amp.GradScaler('cpu')
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(RuntimeError, match='has no grad_scaler'):
        scaler.step(opt)


def test_scaler_needs_factors_outside_the_hooks() -> None:
    scaler = torch.amp.GradScaler('cpu')
    with pytest.raises(ValueError, match='update_factors_in_hook=False'):
        build(grad_scaler=scaler)


def test_disabled_or_callable_scalers_step_as_usual() -> None:
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    model, opt = build(grad_scaler=scaler, update_factors_in_hook=False)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)
    model, opt = build(grad_scaler=lambda: 1.0, update_factors_in_hook=False)
    loss_of(model, 0).backward()
    opt.step()
    assert opt.preconditioner.steps == 1


# Several base optimizers -----------------------------------------------------


def split(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SGD on the weight matrices, Adam on the rest (Muon and AdamW's
    split, with optimizers of every torch release)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [
        torch.optim.SGD(matrices, lr=0.1, momentum=0.9),
        torch.optim.Adam(rest, lr=0.01),
    ]


def build_split(
    model: TinyMLP | None = None,
    make: Callable[[nn.Module], list[torch.optim.Optimizer]] = split,
    **options: Any,
) -> tuple[TinyMLP, KFACOptimizer]:
    torch.manual_seed(0)
    model = model or TinyMLP()
    precon = KFACPreconditioner(model, damping=0.01, **options)
    return model, KFACOptimizer(make(model), precon)


def by_hand(
    model: nn.Module,
    make: Callable[[nn.Module], list[torch.optim.Optimizer]],
    seeds: range,
) -> None:
    """The loop the wrapper stands for: precondition, step each."""
    optimizers = make(model)
    precon = KFACPreconditioner(model, damping=0.01, optimizer=optimizers)
    for seed in seeds:
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss_of(model, seed).backward()
        precon.step()
        for optimizer in optimizers:
            optimizer.step()


def assert_same(got: nn.Module, want: nn.Module) -> None:
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_several_base_optimizers_equal_the_loop_by_hand() -> None:
    model, opt = build_split()
    ref = copy.deepcopy(model)
    train(model, opt, range(3))
    by_hand(ref, split, range(3))
    assert opt.preconditioner.steps == 3
    assert_same(model, ref)


@MUON
def test_muon_on_the_matrices_and_adamw_on_the_rest() -> None:
    def muon_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return [
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=0.003),
        ]

    model, opt = build_split(make=muon_adamw)
    ref = copy.deepcopy(model)
    before = params(model)
    train(model, opt, range(3))
    by_hand(ref, muon_adamw, range(3))
    assert_same(model, ref)
    muon = opt.base_optimizers[0]
    assert opt.preconditioner.lr == muon.param_groups[0]['lr']
    assert all(
        not torch.equal(a, b)
        for a, b in zip(before, model.parameters(), strict=True)
    )


def test_several_param_groups_state_and_defaults() -> None:
    model, opt = build_split()
    sgd, adam = opt.base_optimizers
    groups = opt.param_groups
    assert [id(g) for g in groups] == [
        id(g) for g in (*sgd.param_groups, *adam.param_groups)
    ]
    assert opt.defaults is sgd.defaults
    train(model, opt, range(1))
    state = opt.state
    assert set(state) == set(sgd.state) | set(adam.state)
    assert len(state) == len(list(model.parameters()))
    assert all(state[p] is adam.state[p] for p in adam.state)
    # Written back, each optimizer gets the state of its own parameters.
    opt.state = {p: dict(s) for p, s in state.items()}
    assert set(sgd.state) == {p for g in sgd.param_groups for p in g['params']}
    assert set(adam.state) == {
        p for g in adam.param_groups for p in g['params']
    }
    opt.param_groups = [dict(g) for g in groups]
    assert opt.param_groups[0] is sgd.param_groups[0] is not groups[0]
    with pytest.raises(ValueError, match='param_groups: 1 groups'):
        opt.param_groups = groups[:1]
    opt.defaults = {'lr': 0.5}
    assert sgd.defaults == {'lr': 0.5}
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert repr(opt).startswith('KFACOptimizer(SGD, Adam, KFACPreconditioner(')


def test_a_schedule_on_the_wrapper_reaches_every_base_optimizer() -> None:
    model, opt = build_split()
    sgd, adam = opt.base_optimizers
    initial = [g['lr'] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for seed in range(3):
        train(model, opt, range(seed, seed + 1))
        sched.step()
        factor = 0.5 ** (seed + 1)
        assert sgd.param_groups[0]['lr'] == initial[0] * factor
        assert adam.param_groups[0]['lr'] == initial[1] * factor
    # The preconditioner reads each layer's rate from its weight's group.
    assert opt.preconditioner.lr == sgd.param_groups[0]['lr']


def test_several_state_dict_resume_equals_uninterrupted() -> None:
    model, opt = build_split(factor_update_steps=2, inv_update_steps=3)
    train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save(
        {'model': model.state_dict(), 'optimizer': opt.state_dict()}, buffer
    )
    train(model, opt, range(3, 6))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert len(saved['optimizer']['base_optimizers']) == 2
    resumed, resumed_opt = build_split(
        factor_update_steps=2, inv_update_steps=3
    )
    resumed.load_state_dict(saved['model'])
    resumed_opt.load_state_dict(saved['optimizer'])
    train(resumed, resumed_opt, range(3, 6))
    assert_same(resumed, model)


def test_a_single_optimizer_state_of_before_still_loads() -> None:
    # The format KFACOptimizer wrote for one base optimizer before it took
    # several (and Lightning checkpoints hold), spelled out: a plain loop's
    # optimizer and preconditioner states under these two keys.
    torch.manual_seed(0)
    model = TinyMLP()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(model, damping=0.01, optimizer=sgd)
    wrapper = KFACOptimizer(sgd, precon)
    train(model, wrapper, range(2))
    saved = {
        'model': copy.deepcopy(model.state_dict()),
        'optimizer': {
            'base_optimizer': copy.deepcopy(sgd.state_dict()),
            'preconditioner': copy.deepcopy(precon.state_dict()),
        },
    }
    train(model, wrapper, range(2, 4))
    for wrap in (lambda o: o, lambda o: [o]):
        resumed, built = build()
        built.remove()
        opt = KFACOptimizer(wrap(built.base_optimizer), built.preconditioner)
        resumed.load_state_dict(saved['model'])
        # A copy each time: loading shares the tensors, which train on.
        opt.load_state_dict(copy.deepcopy(saved['optimizer']))
        train(resumed, opt, range(2, 4))
        assert_same(resumed, model)
        assert set(opt.state_dict()) == set(saved['optimizer'])


def test_several_base_optimizers_are_checked() -> None:
    model, opt = build_split()
    sgd, adam = opt.base_optimizers
    with pytest.raises(TypeError, match='base_optimizer must be'):
        KFACOptimizer([], opt.preconditioner)
    with pytest.raises(TypeError, match='base_optimizer must be'):
        KFACOptimizer([sgd, model], opt.preconditioner)  # type: ignore[list-item]  # the error tested
    with pytest.raises(TypeError, match='already a KFACOptimizer'):
        KFACOptimizer([opt, adam], opt.preconditioner)
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match='is in base optimizers 0 and 1'):
        KFACOptimizer([sgd, both], opt.preconditioner)
    with pytest.raises(ValueError, match='fc1, fc2 are in no param group'):
        KFACOptimizer([adam], opt.preconditioner)
    with pytest.raises(AttributeError, match='2 base optimizers'):
        _ = opt.base_optimizer
    with pytest.raises(ValueError, match='add_param_group: this'):
        opt.add_param_group({'params': [nn.Parameter(torch.zeros(2))]})
    _, single = build()
    with pytest.raises(ValueError, match='holds 1 base optimizer states'):
        opt.load_state_dict(single.state_dict())
    with pytest.raises(ValueError, match="'base_optimizer' and"):
        opt.load_state_dict({'base_optimizers': {}, 'preconditioner': {}})
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match='Adam, a base optimizer'):
        adam.step()


@pytest.mark.parametrize('unscale', [False, True])
def test_several_base_optimizers_under_a_grad_scaler(unscale: bool) -> None:
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0**10)
    model, opt = build_split(grad_scaler=scaler, update_factors_in_hook=False)
    ref, ref_opt = build_split(copy.deepcopy(model))
    for seed in range(3):
        scaled_step(model, opt, scaler, seed, unscale=unscale)
    scaled_step(model, opt, scaler, 3, poison=True)  # skipped
    train(ref, ref_opt, range(3))
    assert opt.preconditioner.steps == 3
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
