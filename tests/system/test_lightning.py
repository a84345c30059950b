"""`KFACOptimizer` inside a real Lightning `Trainer` (automatic
optimization, CPU, a few steps)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from kfac.config import StatisticsConfig
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data

pytest.importorskip('lightning')
import lightning as L  # after the skip: a test-only dependency
from lightning.pytorch.plugins import MixedPrecision


class Module(L.LightningModule):
    def __init__(self, **kfac_options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyMLP()
        self.kfac_options = kfac_options
        self.seen_lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss

    def configure_optimizers(self) -> Any:
        base = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)
        precon = KFACPreconditioner(
            self.net,
            damping=0.01,
            relative_clip=1.0,
            **self.kfac_options,
        )
        optimizer = KFACOptimizer(base, precon)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        return {
            'optimizer': optimizer,
            'lr_scheduler': {'scheduler': scheduler, 'interval': 'step'},
        }

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen_lrs.append(optimizer.param_groups[0]['lr'])


def loader(n: int = 12) -> DataLoader[Any]:
    x, y = classification_data(n, (6,), seed=1, dtype=torch.float32)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def trainer(root: Path, **options: Any) -> Any:
    logging.getLogger('lightning').setLevel(logging.ERROR)
    return L.Trainer(
        accelerator='cpu',
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **options,
    )


def preconditioner(module: Any) -> KFACPreconditioner:
    optimizer = module.trainer.optimizers[0]
    assert isinstance(optimizer, KFACOptimizer)
    precon = optimizer.preconditioner
    assert isinstance(precon, KFACPreconditioner)
    return precon


def manual(steps: int, clip: float | None) -> TinyMLP:
    """The same training written as a loop (the oracle)."""
    torch.manual_seed(0)
    net = TinyMLP()
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(net, damping=0.01, relative_clip=1.0)
    optimizer = KFACOptimizer(base, precon)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    batches = list(loader())
    for step in range(steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        scheduler.step()
    return net


@pytest.mark.parametrize('clip', [None, 0.5])
def test_fit_equals_the_loop(tmp_path: Path, clip: float | None) -> None:
    module = Module()
    trainer(tmp_path, max_epochs=2, gradient_clip_val=clip).fit(
        module, loader()
    )
    assert preconditioner(module).steps == 6
    assert module.seen_lrs == [0.1 * 0.5**k for k in range(6)]
    want = manual(6, clip)
    if clip is not None:  # the clip acts: the loop without it differs
        assert not torch.equal(want.fc1.weight, manual(6, None).fc1.weight)
    for got, ref in zip(
        module.net.parameters(), want.parameters(), strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_checkpoint_and_resume_equal_uninterrupted(tmp_path: Path) -> None:
    whole = Module()
    trainer(tmp_path, max_epochs=2).fit(whole, loader())
    first = Module()
    half = trainer(tmp_path, max_epochs=1)
    half.fit(first, loader())
    path = tmp_path / 'half.ckpt'
    half.save_checkpoint(path)
    resumed = Module()
    trainer(tmp_path, max_epochs=2).fit(resumed, loader(), ckpt_path=path)
    assert preconditioner(resumed).steps == 6
    for got, want in zip(
        resumed.net.parameters(), whole.net.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    untrained = copy.deepcopy(first.net)
    assert not torch.equal(untrained.fc1.weight, whole.net.fc1.weight)


def test_accumulation(tmp_path: Path) -> None:
    module = Module(accumulation_steps=2)
    trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(
        module, loader(16)
    )
    assert preconditioner(module).steps == 2
    with pytest.raises(ValueError, match='2 backward passes since the last'):
        trainer(tmp_path, max_steps=2, accumulate_grad_batches=2).fit(
            Module(), loader(16)
        )
    # Lightning steps after the last batch of an epoch (here the 3rd):
    # one micro-batch instead of two, its loss divided by 2 all the same.
    # The preconditioner must be told so.
    with pytest.raises(ValueError, match="accumulation_divisor='accumulat"):
        trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(
            Module(accumulation_steps=2), loader(12)
        )


def test_a_short_accumulation_trains_as_the_loop(tmp_path: Path) -> None:
    """Three batches an epoch, two per step: Lightning steps after the
    epoch's last batch alone, its loss divided by 2 (the configured
    accumulation), as the loop does.
    """
    options: dict[str, Any] = {
        'accumulation_steps': 2,
        'statistics': StatisticsConfig(
            accumulation_divisor='accumulation_steps'
        ),
        'factor_update_steps': 1,  # the short steps update factors
        'inv_update_steps': 1,
    }
    module = Module(**options)
    trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2).fit(
        module, loader(12)
    )
    assert preconditioner(module).steps == 4
    torch.manual_seed(0)
    net = TinyMLP()
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(
        net, damping=0.01, relative_clip=1.0, **options
    )
    optimizer = KFACOptimizer(base, precon)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    batches = list(loader(12))
    for group in [batches[:2], batches[2:]] * 2:
        optimizer.zero_grad()
        for x, y in group:
            (F.cross_entropy(net(x), y) / 2).backward()
        optimizer.step()
        scheduler.step()
    for got, ref in zip(
        module.net.parameters(), net.parameters(), strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


class Logging(Module):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        precon = optimizer.preconditioner
        metrics = precon.metrics()
        self.log('kfac/damping', metrics['damping'])
        if metrics['kl_clip_scale'] is not None:
            self.log('kfac/kl_clip_scale', metrics['kl_clip_scale'])
        self.log('kfac/fc1/trace_A', metrics['layers']['fc1']['trace_A'])


def test_metrics_reach_lightnings_logger(tmp_path: Path) -> None:
    module = Logging()
    fit = trainer(tmp_path, max_steps=3)
    fit.fit(module, loader())
    logged = fit.callback_metrics
    assert logged['kfac/damping'].item() == pytest.approx(0.01)
    # Logged inside the last step, after its backward pass has folded its
    # statistics into the factors (update_factors_in_hook=True): the
    # trace the preconditioner reports now.
    precon = preconditioner(module)
    assert logged['kfac/fc1/trace_A'].item() == pytest.approx(
        precon.metrics()['layers']['fc1']['trace_A'], rel=1e-6
    )
    assert 0.0 < logged['kfac/kl_clip_scale'].item() <= 1.0


# Mixed precision: the recipe of the trainers guide -------------------------


class Mixed(Module):
    """The guide's recipe: the precision plugin's scaler given to the
    preconditioner, and clipping after unscaling through it."""

    def configure_optimizers(self) -> Any:
        # None in full precision (its plugin has no scaler) and bf16.
        scaler = getattr(self.trainer.precision_plugin, 'scaler', None)
        base = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)
        precon = KFACPreconditioner(
            self.net,
            damping=0.01,
            relative_clip=1.0,
            grad_scaler=scaler,
            update_factors_in_hook=False,
        )
        return KFACOptimizer(base, precon)

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if not gradient_clip_val:
            return
        scaler = getattr(self.trainer.precision_plugin, 'scaler', None)
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)


def scaled_manual(steps: int, clip: float) -> tuple[TinyMLP, float]:
    """The recipe's training as a loop: autocast to float16, a scaler."""
    torch.manual_seed(0)
    net = TinyMLP()
    scaler = torch.amp.GradScaler('cpu')
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(
        net,
        damping=0.01,
        relative_clip=1.0,
        grad_scaler=scaler,
        update_factors_in_hook=False,
    )
    optimizer = KFACOptimizer(base, precon)
    batches = list(loader())
    for step in range(steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        with torch.autocast('cpu', dtype=torch.float16, cache_enabled=False):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(net.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
    return net, scaler.get_scale()


def test_mixed_precision_recipe_equals_the_scaled_loop(tmp_path: Path) -> None:
    module = Mixed()
    fit = trainer(
        tmp_path,
        max_steps=4,
        gradient_clip_val=0.5,
        plugins=[MixedPrecision('16-mixed', 'cpu')],
    )
    fit.fit(module, loader())
    precon = preconditioner(module)
    plugin = fit.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.scaler is not None
    assert precon.grad_scaler is plugin.scaler
    want, scale = scaled_manual(4, 0.5)
    assert precon.steps == 4
    assert plugin.scaler.get_scale() == scale
    for got, ref in zip(
        module.net.parameters(), want.parameters(), strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
