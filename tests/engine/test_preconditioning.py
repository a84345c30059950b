"""The learning rate and the clips of the step (`optimizer=`, `kl_clip`,
`relative_clip`), the clip's metrics and the warning when K-FAC holds
training back.

Oracles: the parameter change of one plain-SGD step is proportional to the
optimizer's learning rate under `relative_clip` (clip active and
inactive); with `kl_clip` alone (the original's spelling) the written
gradient is bitwise `ν V'` with `ν` from the original formula, and with
both the smaller scale applies; `kl_clip_scale` and `grad_norm_ratio`
equal their definitions computed from the unclipped preconditioned
gradients.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import base_preconditioner
from kfac._engine import preconditioning
from kfac.hyperparams import OptimizerLR
from kfac.math import kl_clip_scale
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data
from testing.torch_release import MUON


def _data(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(16, (6,), seed=step)


def _model() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP().double()


def _step(
    model: nn.Module,
    precon: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    step: int = 0,
) -> None:
    x, y = _data(step)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precon.step()
    optimizer.step()


def _change(lr: float, **options: Any) -> list[torch.Tensor]:
    """The parameter change of one plain-SGD step with K-FAC reading the
    learning rate from the optimizer.
    """
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    precon = KFACPreconditioner(
        model, damping=0.01, optimizer=optimizer, **options
    )
    _step(model, precon, optimizer)
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


@pytest.mark.parametrize('relative_clip', [0.3, 100.0, None])
def test_relative_clip_step_is_proportional_to_the_lr(
    relative_clip: float | None,
) -> None:
    full = _change(0.2, relative_clip=relative_clip)
    half = _change(0.1, relative_clip=relative_clip)
    for a, b in zip(full, half):
        torch.testing.assert_close(a, 2 * b, rtol=1e-12, atol=0.0)


def test_relative_clip_clips_at_the_given_length_ratio() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precon = KFACPreconditioner(
        model, damping=0.01, optimizer=optimizer, relative_clip=0.3
    )
    _step(model, precon, optimizer)
    metrics = precon.metrics()
    assert metrics['kl_clip_scale'] < 1.0  # the clip was active
    assert metrics['grad_norm_ratio'] == pytest.approx(0.3, rel=1e-12)


def test_kl_clip_ignores_the_lr_once_active() -> None:
    """The original clip: once active it makes the step independent of the
    learning rate (what the relative clip fixes).
    """
    full = _change(0.2, kl_clip=1e-6)
    half = _change(0.1, kl_clip=1e-6)
    for a, b in zip(full, half):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0.0)


def _preconditioned(
    **options: Any,
) -> tuple[KFACPreconditioner, dict[str, torch.Tensor], dict[str, Any]]:
    """One step without an optimizer step: the written gradients and the
    preconditioner's raw and preconditioned matrices.
    """
    model = _model()
    precon = KFACPreconditioner(model, damping=0.01, **options)
    x, y = _data()
    F.cross_entropy(model(x), y).backward()
    raw = {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]  # every parameter has a gradient
    precon.step()
    written = {
        n: p.grad.detach().clone()  # type: ignore[union-attr]  # as above
        for n, p in model.named_parameters()
    }
    return precon, written, raw


def _kl_scale(
    unclipped: dict[str, torch.Tensor], raw: dict[str, torch.Tensor]
) -> torch.Tensor:
    """`ν_KL` at lr 0.1 and `κ` 0.001 from the unclipped gradients."""
    vg = torch.stack(
        [torch.vdot(unclipped[n].reshape(-1), raw[n].reshape(-1)) for n in raw]
    )
    # Σ V' ⊙ V per layer as the engine sums it: weight and bias together.
    per_layer = vg.reshape(-1, 2).sum(dim=1)
    return kl_clip_scale(per_layer.sum(), 0.1, 0.001)


def test_kl_clip_alone_is_the_original_formula_bitwise() -> None:
    """`kl_clip=0.001` and nothing else (a script written for the original)
    clips as the original did: `ν_KL` alone, no relative cap.
    """
    _, unclipped, raw = _preconditioned(relative_clip=None)
    precon, clipped, _ = _preconditioned(kl_clip=0.001, lr=0.1)
    assert precon.relative_clip is None and precon.kl_clip == 0.001
    nu = _kl_scale(unclipped, raw)
    assert float(nu) < 1.0
    for name in raw:
        torch.testing.assert_close(
            clipped[name], unclipped[name] * nu, rtol=1e-14, atol=0.0
        )


@pytest.mark.parametrize('relative_clip', [1.0, 1e-4])
def test_both_clips_apply_the_smaller_scale(relative_clip: float) -> None:
    _, unclipped, raw = _preconditioned(relative_clip=None)
    _, clipped, _ = _preconditioned(
        kl_clip=0.001, lr=0.1, relative_clip=relative_clip
    )
    pre = torch.stack([g.square().sum() for g in unclipped.values()])
    norm = torch.stack([g.square().sum() for g in raw.values()])
    pre, norm = pre.sum().sqrt(), norm.sum().sqrt()
    nu_rel = torch.clamp(relative_clip * norm / pre, max=1.0)
    nu = torch.minimum(_kl_scale(unclipped, raw), nu_rel)
    for name in raw:
        torch.testing.assert_close(
            clipped[name], unclipped[name] * nu, rtol=1e-12, atol=0.0
        )


def test_relative_clip_auto_follows_kl_clip() -> None:
    """`'auto'` (the default): the relative cap at 1 without a KL clip,
    none with one; explicit values stand.
    """
    model = _model()
    defaults = KFACPreconditioner(model)
    assert (defaults.kl_clip, defaults.relative_clip) == (None, 1.0)
    defaults.remove()
    original = KFACPreconditioner(model, kl_clip=0.001)
    assert (original.kl_clip, original.relative_clip) == (0.001, None)
    original.remove()
    both = KFACPreconditioner(model, kl_clip=0.001, relative_clip=2.0)
    assert (both.kl_clip, both.relative_clip) == (0.001, 2.0)


def test_metrics_equal_their_definitions() -> None:
    precon, unclipped, raw = _preconditioned(relative_clip=None)
    assert precon.metrics()['kl_clip_scale'] == 1.0
    pre = math.sqrt(sum(float(g.square().sum()) for g in unclipped.values()))
    norm = math.sqrt(sum(float(g.square().sum()) for g in raw.values()))
    assert precon.metrics()['grad_norm_ratio'] == pytest.approx(
        pre / norm, rel=1e-12
    )
    clipped, written, _ = _preconditioned(relative_clip=1.0)
    ratio = (
        math.sqrt(sum(float(g.square().sum()) for g in written.values()))
        / norm
    )
    metrics = clipped.metrics()
    assert metrics['grad_norm_ratio'] == pytest.approx(ratio, rel=1e-12)
    assert metrics['kl_clip_scale'] == pytest.approx(norm / pre, rel=1e-12)


def test_metrics_are_none_before_a_step() -> None:
    precon = KFACPreconditioner(_model())
    assert precon.metrics()['kl_clip_scale'] is None
    assert precon.metrics()['grad_norm_ratio'] is None


def test_an_lr_schedule_on_the_optimizer_reaches_the_clip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The clip of each step uses the learning rate the optimizer has at
    that step, whatever was read in between.
    """
    used = []
    real = preconditioning.precondition

    def spy(*args: Any, **kwargs: Any) -> None:
        used.append(args[2].lr)
        real(*args, **kwargs)

    monkeypatch.setattr(base_preconditioner, 'precondition', spy)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    precon = KFACPreconditioner(model, optimizer=optimizer, kl_clip=1e-3)
    for step in range(3):
        _step(model, precon, optimizer, step)
        assert precon.lr == optimizer.param_groups[0]['lr']
        precon.hyperparameter_values()  # cached for the coming step
        schedule.step()
        assert precon.lr == optimizer.param_groups[0]['lr']  # read now
    assert used == [0.4, 0.2, 0.1]


def test_each_layer_takes_its_groups_lr() -> None:
    """Two param groups: the KL clip weighs each layer by its own lr."""
    model = _model()
    fc1, fc2 = model.fc1, model.fc2
    optimizer = torch.optim.SGD(
        [
            {'params': fc1.parameters(), 'lr': 0.3},
            {'params': fc2.parameters(), 'lr': 0.1},
        ]
    )
    precon = KFACPreconditioner(model, optimizer=optimizer, kl_clip=1e-4)
    values = precon.hyperparameter_values()
    assert values.lrs == {'fc1': 0.3, 'fc2': 0.1}
    assert values.lr == 0.3
    x, y = _data()
    F.cross_entropy(model(x), y).backward()
    raw = {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]  # every parameter has a gradient
    reference = _model()
    unclipped = KFACPreconditioner(reference, relative_clip=None)
    F.cross_entropy(reference(x), y).backward()
    unclipped.step()
    precon.step()
    total = torch.zeros((), dtype=torch.float64)
    for name, lr in (('fc1', 0.3), ('fc2', 0.1)):
        for suffix in ('weight', 'bias'):
            key = f'{name}.{suffix}'
            v_pre = dict(reference.named_parameters())[key].grad
            assert v_pre is not None
            total = total + lr**2 * torch.vdot(
                v_pre.reshape(-1), raw[key].reshape(-1)
            )
    nu = kl_clip_scale(total, 1.0, 1e-4)
    assert precon.metrics()['kl_clip_scale'] == pytest.approx(
        float(nu), rel=1e-12
    )


@MUON
def test_a_sequence_of_optimizers_muon_and_adamw() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 3)
    )
    first = model[0]
    assert isinstance(first, nn.Linear)
    matrices = [first.weight]
    rest = [p for p in model.parameters() if p is not first.weight]
    muon = torch.optim.Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW(rest, lr=0.003)
    precon = KFACPreconditioner(model, optimizer=[muon, adamw])
    assert precon.hyperparameter_values().lrs == {'0': 0.02, '2': 0.003}
    x = torch.randn(6, 4)
    F.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    precon.step()
    muon.step()  # type: ignore[no-untyped-call]  # Muon.step has no annotations
    adamw.step()
    assert precon.steps == 1


def test_optimizer_errors() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match='pass optimizer or lr, not both'):
        KFACPreconditioner(model, optimizer=optimizer, lr=0.1)
    with pytest.raises(TypeError, match='optimizer must be a torch.optim'):
        KFACPreconditioner(model, optimizer='sgd')  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(TypeError, match='non-empty sequence'):
        KFACPreconditioner(model, optimizer=[])
    partial = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    with pytest.raises(ValueError, match='weights of fc2 are in no param'):
        KFACPreconditioner(model, optimizer=partial)
    with pytest.raises(ValueError, match='relative_clip must be'):
        KFACPreconditioner(model, relative_clip=-1.0)


def test_optimizer_lr_without_layers_reads_the_first_group() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.7)
    source = OptimizerLR(optimizer, {})
    assert source(0) == 0.7
    assert source.by_layer() == {}
    assert repr(source) == 'OptimizerLR(SGD)'


HELD_BACK = 'K-FAC: the KL clip scaled the preconditioned gradients'
SHORT = 'K-FAC: the gradients handed to the optimizer were less'


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def _train(steps: int, **options: Any) -> KFACPreconditioner:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    precon = KFACPreconditioner(
        model,
        optimizer=optimizer,
        factor_update_steps=10,
        inv_update_steps=50,
        **options,
    )
    for step in range(steps):
        _step(model, precon, optimizer, step % 4)
    return precon


def test_an_over_clipped_run_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger='kfac'):
        precon = _train(99, kl_clip=1e-9, damping=0.01)
        assert _warnings(caplog, HELD_BACK) == 0  # 99 steps: not yet
        for step in range(30):
            x, y = _data(step % 4)
            F.cross_entropy(precon.model(x), y).backward()
            precon.step()
    assert _warnings(caplog, HELD_BACK) == 1
    assert 'clip with relative_clip instead' in caplog.text


def test_a_run_with_tiny_updates_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger='kfac'):
        _train(130, relative_clip=1e-9, damping=0.01)
    assert _warnings(caplog, SHORT) == 1
    assert _warnings(caplog, HELD_BACK) == 0  # relative: the lr keeps its role
    assert 'lower damping' in caplog.text


def test_a_healthy_run_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger='kfac'):
        precon = _train(130, relative_clip=1.0, damping=0.01)
    assert _warnings(caplog, HELD_BACK) == 0
    assert _warnings(caplog, SHORT) == 0
    # The clip holds the step at the raw gradient's length: active, yet
    # the learning rate keeps its meaning, so no warning.
    assert precon.metrics()['grad_norm_ratio'] == pytest.approx(1.0)
