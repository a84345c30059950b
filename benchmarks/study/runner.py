"""One training run of the study: a task, an optimizer, a learning rate,
K-FAC's settings (or none) and a seed.

Two clocks cover the training step only (zeroing, forward, backward,
K-FAC, clipping, the optimizer); evaluation is excluded. Wall seconds are
what a user waits; CPU seconds (`time.process_time`) are what the run
computed, and on a machine shared with other work (ours) they are the
steadier measure: with one thread (the study's default) a run's CPU
seconds equal its wall seconds on an idle machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from typing import Any

import numpy
import torch
from torch import nn

from benchmarks.study import variants
from benchmarks.study.tasks import Batch
from benchmarks.study.tasks import Task
from kfac.preconditioner import KFACPreconditioner

OPTIMIZERS = ('sgd', 'adamw', 'muon', 'soap', 'kron')

PACKAGED = ('soap', 'kron')
"""The optimizers taken from `pytorch-optimizer` (a benchmark-only
dependency, pinned in `requirements-dev.txt`)."""

SCHEDULES = ('cosine',)
"""The learning-rate schedules a run may take besides a constant rate."""

WARMUP_FRACTION = 0.05
"""The share of the steps that the `cosine` schedule warms up over."""


@dataclasses.dataclass(frozen=True)
class Config:
    """What one run trains with (everything but the seed)."""

    optimizer: str
    lr: float
    kfac: str | None = None
    """The name of a K-FAC variant (`kfac_settings`), None for the
    optimizer alone."""
    kfac_kwargs: str = '{}'
    """K-FAC's keyword arguments as sorted JSON (hashable)."""
    schedule: str | None = None
    """The learning-rate schedule (one of `SCHEDULES`), None for a
    constant rate."""

    @property
    def label(self) -> str:
        """`optimizer lr=...` or `optimizer+variant lr=...`, followed by
        the schedule's name if there is one (`adamw lr=0.001 cosine`).
        """
        head = (
            self.optimizer
            if self.kfac is None
            else f'{self.optimizer}+{self.kfac}'
        )
        tail = '' if self.schedule is None else f' {self.schedule}'
        return f'{head} lr={self.lr:g}{tail}'

    def settings(self) -> dict[str, Any]:
        """K-FAC's keyword arguments."""
        settings: dict[str, Any] = json.loads(self.kfac_kwargs)
        return settings


def kfac_config(
    optimizer: str,
    lr: float,
    name: str,
    settings: dict[str, Any],
    schedule: str | None = None,
) -> Config:
    """A K-FAC configuration over `optimizer` at `lr`."""
    return Config(
        optimizer, lr, name, json.dumps(settings, sort_keys=True), schedule
    )


def git_commit() -> str:
    """The checkout's short commit, recorded beside results ('unknown'
    outside a git checkout).
    """
    try:
        done = subprocess.run(
            ['git', 'rev-parse', '--short', 'HEAD'],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return 'unknown'
    return done.stdout.strip() or 'unknown'


MUON_RELEASE = '2.9'
"""The first torch release with `torch.optim.Muon`."""


def require_optimizer(name: str) -> None:
    """Refuse an optimizer this torch does not have.

    Raises:
        RuntimeError: `name` is 'muon' and this torch has no
            `torch.optim.Muon`.
    """
    if name == 'muon' and not hasattr(torch.optim, 'Muon'):
        raise RuntimeError(
            f"the optimizer 'muon' needs torch>={MUON_RELEASE} "
            f'(torch.optim.Muon); this is torch {torch.__version__}'
        )


def make_optimizers(
    name: str, model: nn.Module, lr: float, task: Task
) -> list[torch.optim.Optimizer]:
    """SGD (momentum 0.9), AdamW (torch's defaults), Muon on the task's
    2-D hidden weights (`adjust_lr_fn='match_rms_adamw'`, so that it shares
    AdamW's learning rate) with AdamW on the rest, or SOAP or PSGD Kron
    from `pytorch-optimizer` on every parameter, as their authors
    recommend (`packaged`); no schedule (`schedulers` adds one).

    Raises:
        RuntimeError: Muon on a torch without it (`require_optimizer`).
        ValueError: an unknown optimizer.
    """
    params = list(model.parameters())
    if name == 'sgd':
        return [torch.optim.SGD(params, lr=lr, momentum=0.9)]
    if name == 'adamw':
        return [torch.optim.AdamW(params, lr=lr)]
    if name == 'muon':
        require_optimizer(name)
        matrices = task.matrices(model)
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        return [
            torch.optim.Muon(
                matrices,
                lr=lr,
                weight_decay=0.01,
                adjust_lr_fn='match_rms_adamw',
            ),
            torch.optim.AdamW(rest, lr=lr),
        ]
    if name in PACKAGED:
        return [packaged(name, params, lr)]
    raise ValueError(f'optimizer must be one of {OPTIMIZERS}; got {name!r}')


def packaged(
    name: str, params: list[nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """SOAP or PSGD Kron of `pytorch-optimizer` over `params` at `lr`, as
    their authors recommend.

    SOAP (Vyas et al., 2025; the README of the authors' code): betas
    (0.95, 0.95), weight decay 0.01, the eigenbases refreshed every 10
    steps; the rest at the package's defaults, which are the authors'
    (Shampoo's factors averaged with beta2, no preconditioner over 10,000
    wide, 1-D parameters left to Adam in their own coordinates, Adam's
    bias correction, epsilon 1e-8). PSGD Kron (Li; the README of Evan
    Walters' `kron_torch`, which the package follows): momentum 0.9,
    the preconditioner updated with probability 1 for 500 steps, then
    decaying to 0.03 (the package's default schedule, kept as the authors
    advise), triangular factors up to 8,192 wide, preconditioner step
    0.1; weight decay as AdamW's (0.01, decoupled; "weight decay acts
    similarly to adam's"). Neither README asks for a warm-up. The
    package is imported here, not at the top of the module, so that the
    other optimizers run without it (`make gpu-study` installs nothing).
    """
    import pytorch_optimizer

    if name == 'soap':
        return pytorch_optimizer.SOAP(
            params,
            lr=lr,
            betas=(0.95, 0.95),
            weight_decay=0.01,
            precondition_frequency=10,
        )
    return pytorch_optimizer.Kron(
        params, lr=lr, momentum=0.9, weight_decay=0.01
    )


def warmup_cosine(
    step: int, steps: int, warmup: float = WARMUP_FRACTION
) -> float:
    r"""The learning rate's multiplier at step `step` (0-based) of `steps`.

    Linear warm-up over the first \(w = \max(1, \lceil \text{warmup}
    \cdot \text{steps} \rceil)\) steps, then cosine decay to zero at the
    end of the budget:

    \[
        f(k) = \begin{cases} (k + 1) / w & k < w \\
        \tfrac12 \left(1 + \cos \frac{\pi (k - w)}{\text{steps} - w}
        \right) & k \ge w \end{cases}
    \]

    (so the last step, \(k = \text{steps} - 1\), still moves, and
    \(f(\text{steps}) = 0\)).

    >>> [round(warmup_cosine(k, 100), 3) for k in (0, 4, 5, 52, 99)]
    [0.2, 1.0, 1.0, 0.508, 0.0]
    """
    width = max(1, math.ceil(warmup * steps))
    if step < width:
        return (step + 1) / width
    return 0.5 * (1.0 + math.cos(math.pi * (step - width) / (steps - width)))


def schedulers(
    schedule: str | None,
    optimizers: list[torch.optim.Optimizer],
    steps: int,
) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """The schedulers that give `optimizers` the learning-rate `schedule`
    over `steps` steps (none for a constant rate); K-FAC reads the rate
    from the optimizers, so its clip follows.

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule is None:
        return []
    if schedule not in SCHEDULES:
        raise ValueError(
            f'schedule must be one of {SCHEDULES} or None; got {schedule!r}'
        )

    def factor(k: int) -> float:
        return warmup_cosine(k, steps)

    return [
        torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        for optimizer in optimizers
    ]


def train_step(
    task: Task,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    precon: KFACPreconditioner | None,
    batch: Batch,
) -> float:
    """One training step (zeroing, forward, the MC Fisher's sampled pass if
    asked, backward, the clip of the raw gradient, K-FAC, the optimizers);
    the loss, read on the host as every training loop does.

    The clip comes before `preconditioner.step()`, in the order the
    getting-started guide gives (K-FAC's own clip bounds the preconditioned
    step). Until commit `72271ec` it came after, clipping the preconditioned
    gradient: the runs of that loop are labelled so in the results.
    """
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    output = model(batch[0])
    loss = task.criterion(output, batch)
    if precon is not None:
        precon.sample_fisher(output, task.fisher)
    loss.backward()
    if task.clip_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), task.clip_norm)
    if precon is not None:
        precon.step()
    for optimizer in optimizers:
        optimizer.step()
    return float(loss.detach())


Clip = tuple[int, float | None, float | None]
"""`(step, ν, ‖ν V'‖ / ‖V‖)`: K-FAC's clip scale and the length of what it
handed the optimizer over the raw gradient's, at its last step (None
before one), from `KFACPreconditioner.metrics()`."""


def _clip(step: int, precon: KFACPreconditioner) -> Clip:
    metrics = precon.metrics()
    return step, metrics['kl_clip_scale'], metrics['grad_norm_ratio']


def _sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (a clock read after it is true)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def run(
    task: Task, config: Config, seed: int, device: str = 'cpu'
) -> dict[str, Any]:
    """Train `task` with `config` from `seed` on `device`; the record of
    the run.

    `evals` holds `(step, training wall seconds so far, metric, training
    CPU seconds so far)` from step 0, and `kfac_clip` what K-FAC's clip
    did at each evaluation after step 0 (`Clip`; empty for the optimizer
    alone); a loss that is not finite ends the run (`diverged`). On a GPU
    the model is drawn on the CPU (the same weights as there) and moved;
    each batch is moved before its step's clocks start, and the device is
    synchronised before they stop. NumPy's global generator is seeded too
    (PSGD Kron draws from it when to rebalance its factors). A schedule
    (`config.schedule`) steps after each optimizer step, inside the clocks.
    """
    where = torch.device(device)
    model = task.build(seed).to(where)
    numpy.random.seed(seed)
    optimizers = make_optimizers(config.optimizer, model, config.lr, task)
    scheduled = schedulers(config.schedule, optimizers, task.steps)
    precon = None
    if config.kfac is not None:
        precon = KFACPreconditioner(
            model,
            optimizer=optimizers,
            **variants.keywords(config.settings()),
        )
    batches = task.batches(seed)
    evals = [(0, 0.0, task.evaluate(model), 0.0)]
    clips: list[Clip] = []
    seconds = cpu = 0.0
    diverged = False
    for step in range(1, task.steps + 1):
        batch = next(batches)
        batch = (batch[0].to(where), batch[1].to(where))
        _sync(where)
        start, start_cpu = time.perf_counter(), time.process_time()
        value = train_step(task, model, optimizers, precon, batch)
        for scheduler in scheduled:
            scheduler.step()
        _sync(where)
        seconds += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        if not math.isfinite(value):
            diverged = True
            break
        if step % task.eval_every == 0 or step == task.steps:
            evals.append((step, seconds, task.evaluate(model), cpu))
            if precon is not None:
                clips.append(_clip(step, precon))
    return {
        'label': config.label,
        'optimizer': config.optimizer,
        'lr': config.lr,
        'kfac': config.kfac,
        'kfac_kwargs': config.settings(),
        'schedule': config.schedule,
        'seed': seed,
        'device': str(next(model.parameters()).device),
        'steps': step,
        'seconds': seconds,
        'seconds_per_step': seconds / step,
        'cpu_seconds': cpu,
        'cpu_seconds_per_step': cpu / step,
        'diverged': diverged,
        'final': math.nan if diverged else evals[-1][2],
        'evals': evals,
        'kfac_clip': clips,
    }
