"""kfac.capture: which passes are captured, the loss scale, the hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.capture import Capture
from kfac.capture import check_grad_scaler
from kfac.capture import read_loss_scale
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data

F64 = torch.float64


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.reads = 0

    def get_scale(self) -> float:
        self.reads += 1
        return self.scale


def test_grad_scaler_checks() -> None:
    check_grad_scaler(None)
    check_grad_scaler(lambda: 2.0)
    check_grad_scaler(_Scaler(2.0))
    with pytest.raises(TypeError, match='grad_scaler must be None, a Grad'):
        check_grad_scaler(3.0)


def test_read_loss_scale_prefers_get_scale() -> None:
    assert read_loss_scale(_Scaler(8.0)) == 8.0
    assert read_loss_scale(lambda: 4) == 4.0


def _capture(
    model: nn.Module, active: list[bool], **kwargs: object
) -> tuple[KFACPreconditioner, Capture]:
    precon = KFACPreconditioner(model, **kwargs)  # type: ignore[arg-type]
    capture = Capture(
        precon.layers,
        active=lambda: active[0],
        grad_scaler=kwargs.get('grad_scaler'),  # type: ignore[arg-type]
        accumulation_steps=1,
        in_hook=False,
        on_complete=lambda name: None,
        phase=lambda name: torch.no_grad(),
    )
    precon.remove()  # only the capture under test keeps hooks
    return precon, capture


@pytest.mark.parametrize('mode', ['eval', 'no_grad', 'inactive'])
def test_passes_outside_factor_steps_are_not_captured(mode: str) -> None:
    model = TinyMLP().double()
    active = [mode != 'inactive']
    precon, capture = _capture(model, active)
    x, _ = classification_data(4, (6,))
    if mode == 'eval':
        model.eval()
    with torch.no_grad() if mode == 'no_grad' else torch.enable_grad():
        out = model(x)
    if out.requires_grad:
        out.sum().backward()
    assert [layer.captures for layer in precon.layers.values()] == [
        (0, 0),
        (0, 0),
    ]
    active[0] = True
    model.train()
    model(x).sum().backward()
    assert [layer.captures for layer in precon.layers.values()] == [
        (1, 1),
        (1, 1),
    ]
    capture.remove()
    assert not capture.attached
    model(x).sum().backward()
    assert precon.layers['fc1'].captures == (1, 1)


def test_loss_scale_is_read_once_per_step() -> None:
    scaler = _Scaler(16.0)
    _, capture = _capture(TinyMLP().double(), [True], grad_scaler=scaler)
    assert capture.loss_scale() == 16.0
    scaler.scale = 32.0
    assert capture.loss_scale() == 16.0  # cached for the step
    capture.next_step()
    assert capture.loss_scale() == 32.0
    assert scaler.reads == 2


def test_loss_scale_is_divided_out_of_g() -> None:
    x, y = classification_data(8, (6,))
    factors = []
    for scale in (1.0, 2.0**10):
        torch.manual_seed(0)
        model = TinyMLP().double()
        precon = KFACPreconditioner(model, grad_scaler=lambda s=scale: s)
        (F.cross_entropy(model(x), y) * scale).backward()
        precon.step()
        factors.append(precon.layers['fc2'].g.value)
    unscaled, scaled = factors
    assert unscaled is not None and scaled is not None
    torch.testing.assert_close(scaled, unscaled, rtol=1e-12, atol=0)
    assert precon.grad_scaler is not None


def test_in_hook_capture_starts_reduction_after_last_micro_batch() -> None:
    model = TinyMLP().double()
    done: list[str] = []
    precon = KFACPreconditioner(model)
    capture = Capture(
        precon.layers,
        active=lambda: True,
        grad_scaler=None,
        accumulation_steps=2,
        in_hook=True,
        on_complete=done.append,
        phase=lambda name: torch.no_grad(),
    )
    precon.remove()
    x, _ = classification_data(4, (6,))
    model(x).sum().backward()
    assert done == []
    model(x).sum().backward()
    assert done == ['fc2', 'fc1']  # in backward order
    capture.remove()
