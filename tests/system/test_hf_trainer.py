"""`KFACOptimizer` inside the Hugging Face `Trainer` (its defaults:
`max_grad_norm=1.0`, a linear learning-rate schedule; CPU, a few steps)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from kfac.config import StatisticsConfig
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data

if sys.version_info < (3, 11):  # pragma: no cover - transformers 5 needs 3.11
    pytest.skip('transformers 5 needs Python 3.11', allow_module_level=True)
pytest.importorskip('transformers')
import transformers  # after the skips: a test-only dependency


class Examples(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.x, self.y = classification_data(
            n, (6,), seed=1, dtype=torch.float32
        )

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {'x': self.x[i], 'labels': self.y[i]}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyMLP()

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        # Scaled so that the Trainer's default clip (1.0) acts.
        return {'loss': 20 * F.cross_entropy(self.net(x), labels)}


def make(
    model: Classifier, **kfac_options: Any
) -> tuple[KFACOptimizer, KFACPreconditioner]:
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(
        model.net,
        damping=0.01,
        relative_clip=1.0,
        **kfac_options,
    )
    return KFACOptimizer(base, precon), precon


def args(root: Path, batch: int = 4, **options: Any) -> Any:
    options.setdefault('save_strategy', 'no')
    return transformers.TrainingArguments(
        output_dir=str(root),
        per_device_train_batch_size=batch,
        learning_rate=0.1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        **options,
    )


def loop(steps: int) -> Classifier:
    """The Trainer's step written as a loop: clip to 1.0, step, linear
    schedule to 0 over `steps` (the oracle). Each step takes the whole
    data set (the Trainer shuffles it; the loss and K-FAC's factors do not
    depend on the order of the examples)."""
    model = Classifier()
    optimizer, _ = make(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (steps - s) / steps
    )
    data = Examples(12)
    for _ in range(steps):
        optimizer.zero_grad()
        model(data.x, data.y)['loss'].backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model


def test_trainer_with_its_defaults_equals_the_loop(tmp_path: Path) -> None:
    model = Classifier()
    optimizer, precon = make(model)
    trainer = transformers.Trainer(
        model=model,
        args=args(tmp_path, batch=12, max_steps=3),
        train_dataset=Examples(12),
        optimizers=(optimizer, None),
    )
    assert trainer.args.max_grad_norm == 1.0
    trainer.train()
    assert precon.steps == 3
    # Read from the base optimizer: the linear schedule has reached 0.
    assert precon.lr == 0.0
    want = loop(3)
    for got, ref in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_must_agree(tmp_path: Path) -> None:
    model = Classifier()
    optimizer, precon = make(model, accumulation_steps=2)
    options = {'max_steps': 1, 'gradient_accumulation_steps': 2}
    transformers.Trainer(
        model=model,
        args=args(tmp_path, **options),
        train_dataset=Examples(8),
        optimizers=(optimizer, None),
    ).train()
    assert precon.steps == 1
    model = Classifier()
    optimizer, _ = make(model)
    trainer = transformers.Trainer(
        model=model,
        args=args(tmp_path, **options),
        train_dataset=Examples(8),
        optimizers=(optimizer, None),
    )
    with pytest.raises(ValueError, match='accumulation_steps=1'):
        trainer.train()


def test_checkpoint_and_resume_equal_uninterrupted(tmp_path: Path) -> None:
    def run(
        steps: int, root: Path, resume: str | None = None
    ) -> tuple[Classifier, KFACPreconditioner]:
        model = Classifier()
        optimizer, precon = make(model)
        trainer = transformers.Trainer(
            model=model,
            args=args(
                root,
                batch=12,
                max_steps=4,
                save_strategy='steps',
                save_steps=2,
                save_only_model=False,
            ),
            train_dataset=Examples(12),
            optimizers=(optimizer, None),
        )
        if steps < 4:  # stop after the checkpoint of step 2
            trainer.add_callback(Stop(steps))
        trainer.train(resume_from_checkpoint=resume)
        return model, precon

    whole, _ = run(4, tmp_path / 'whole')
    run(2, tmp_path / 'half')
    checkpoint = tmp_path / 'half' / 'checkpoint-2'
    assert (checkpoint / 'optimizer.pt').exists()
    resumed, precon = run(4, tmp_path / 'half', resume=str(checkpoint))
    assert precon.steps == 4  # 2 loaded from optimizer.pt, 2 more
    for got, want in zip(
        resumed.parameters(), whole.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class Stop(transformers.TrainerCallback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(
        self, args: Any, state: Any, control: Any, **kwargs: Any
    ) -> Any:
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


class Recording(Classifier):
    """The classifier, keeping the batches it trained on in order."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        self.batches.append((x.clone(), labels.clone()))
        return super().forward(x, labels)


def test_a_short_accumulation_trains_as_the_loop(tmp_path: Path) -> None:
    """Three batches an epoch, two per step: the Trainer takes a step
    after the epoch's last batch alone, its loss divided by 1 (the passes
    the step had); the preconditioner is told so.
    """
    options: dict[str, Any] = {
        'accumulation_steps': 2,
        'statistics': StatisticsConfig(accumulation_divisor='passes'),
        'factor_update_steps': 1,  # the short steps update factors
        'inv_update_steps': 1,
    }
    model = Recording()
    optimizer, precon = make(model, **options)
    transformers.Trainer(
        model=model,
        args=args(tmp_path, num_train_epochs=2, gradient_accumulation_steps=2),
        train_dataset=Examples(12),
        optimizers=(optimizer, None),
    ).train()
    assert precon.steps == 4
    # The loop: the same batches, grouped (2, 1) per epoch, each loss
    # divided by its group's size; the clip and the linear schedule.
    want = Classifier()
    loop_optimizer, _ = make(want, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        loop_optimizer, lambda s: (4 - s) / 4
    )
    assert len(model.batches) == 6
    batches = model.batches
    groups = [batches[0:2], batches[2:3], batches[3:5], batches[5:6]]
    for group in groups:
        loop_optimizer.zero_grad()
        for x, y in group:
            (want(x, y)['loss'] / len(group)).backward()
        nn.utils.clip_grad_norm_(want.parameters(), 1.0)
        loop_optimizer.step()
        scheduler.step()
    for got, ref in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
