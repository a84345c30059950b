"""The Monte Carlo Fisher's sampled backward passes (`fisher_type='mc'`).

On a step that updates factors, `FisherSampler.sample` runs, for each of
`mc_samples` samples, a backward pass of the loss at targets drawn from
the model's predictive distribution (see
[`kfac.math.fisher`][kfac.math.fisher]) with `torch.autograd.grad`
towards the registered weights: the captured module calls receive their
output gradients from it, and no `.grad` is written, no gradient hook of
DDP or of the optimizer runs. The capture's *sink* (this object's
`receive`) keeps the gradients of the first `mc_samples − 1` passes and
hands the call all of them at the last, joined along the batch dimension
(so `G` averages over `mc_samples` times the examples). A call that has
received its gradients is done: the real backward pass that follows
finds nothing to add. A gradient reaching a captured call outside a
sampled pass on such a step (no `sample_fisher` before
`loss.backward()`) raises, rather than form `G` from the training loss
silently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kfac._engine.capture import Capture
from kfac.distributed import get_rank
from kfac.distributed import get_world_size
from kfac.distributed._sharding import is_sharded
from kfac.enums import MCLoss
from kfac.enums import parse_enum
from kfac.layers.helper import ModuleHelper
from kfac.math.fisher import FisherState
from kfac.math.fisher import mc_loss
from kfac.math.fisher import uniforms
from kfac.validation import check_instance

__all__ = ['FisherSampler']


class FisherSampler:
    """Sampled backward passes feeding the capture's `G` statistics.

    Args:
        capture: the engine's capture; with `'mc'` its sink is set to
            `receive`.
        fisher_type: `'empirical'` (then `sample` does nothing) or `'mc'`.
        samples: `mc_samples`, backward passes per forward pass.
        seed: the generator's seed.
        steps: the preconditioner's step count (a key of the generator).
        accumulation_steps: micro-batches per step.
        loss_average: how the loss averages (see [`kfac.math`][kfac.math]).

    Raises:
        ValueError: a registered weight is sharded by FSDP2.
    """

    def __init__(
        self,
        capture: Capture,
        *,
        fisher_type: str,
        samples: int,
        seed: int,
        steps: Callable[[], int],
        accumulation_steps: int,
        loss_average: str | None,
    ) -> None:
        self._capture = capture
        self.fisher_type = str(fisher_type)  # a plain str in the state
        self._weights = capture.weights()
        sharded = any(is_sharded(weight) for weight in self._weights)
        if fisher_type == 'mc' and sharded:
            raise ValueError(
                "fisher_type='mc' does not support models sharded with "
                'fully_shard (FSDP2): its sampled backward pass would run '
                "FSDP2's gradient reduce-scatter; use "
                "fisher_type='empirical'",
            )
        self.samples = samples
        self.seed = seed
        self._steps = steps
        self._accumulation = accumulation_steps
        self._loss_average = loss_average
        self._pass: int | None = None
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._micro = (-1, 0)
        if fisher_type == 'mc':
            capture.sink = self.receive

    def state(self) -> FisherState:
        """The settings a resumed run needs (its step is the engine's)."""
        return {
            'fisher_type': self.fisher_type,
            'mc_samples': self.samples,
            'mc_seed': self.seed,
        }

    def sample(
        self,
        output: torch.Tensor,
        loss: str = 'cross_entropy',
        *,
        mask: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> None:
        """Run the sampled backward passes of one forward pass; nothing
        with `'empirical'` or on a step that does not update factors.

        The arguments and errors are those of the public
        `KFACPreconditioner.sample_fisher`, which calls this.
        """
        check_instance('output', output, torch.Tensor, 'a torch.Tensor')
        loss = parse_enum(MCLoss, loss, 'loss')
        if self.fisher_type != 'mc' or not self._capture.capturing:
            return
        least = 2 if loss == 'cross_entropy' else 1
        if not output.requires_grad or output.dim() < least:
            raise ValueError(
                'output must be the model output, (N, ...) or (N, ..., C) '
                'for cross-entropy, and require grad; got shape '
                f'{tuple(output.shape)}, requires_grad={output.requires_grad}',
            )
        _check_mask(mask, output, loss)
        micro = self._next_micro()
        indices = self._indices(output, indices, micro)
        weights = [w for w in self._weights if w.requires_grad]
        positions = output[0].numel()
        draws = 2 if loss == 'mse' else 1
        if loss == 'cross_entropy':
            positions //= output.shape[-1]
        scale = self._capture.scale.for_sampling()
        factor = scale / (self._accumulation * self.samples)
        key = (self.seed, self._steps(), indices)
        terms = self._terms(output)
        with self._capture.scale.pinned(scale):
            try:
                for sample in range(self.samples):
                    u = uniforms(*key, sample, positions, draws)
                    value = mc_loss(output, loss, u, mask=mask, terms=terms)
                    self._pass = sample
                    torch.autograd.grad(
                        value * factor,
                        weights,
                        retain_graph=True,
                        allow_unused=True,
                    )
                    self._pass = None
            finally:
                self._pass = None
                self._kept.clear()

    def _terms(self, output: torch.Tensor) -> int | None:
        """`Z`, the terms the loss averages over (None: summed)."""
        if self._loss_average is None:
            return None
        if self._loss_average == 'batch':
            return output.shape[0]
        return output.numel() // output.shape[-1]

    def _next_micro(self) -> int:
        """The number of this forward pass within the step."""
        step, count = self._micro
        if step != self._steps():
            step, count = self._steps(), 0
        self._micro = (step, count + 1)
        return count

    def _indices(
        self, output: torch.Tensor, indices: torch.Tensor | None, micro: int
    ) -> torch.Tensor:
        """The global example indices: `indices`, or
        `(micro W + rank) N + i` for the `i`-th of `N` local examples.
        """
        n = output.shape[0]
        if indices is None:
            first = (micro * get_world_size() + get_rank()) * n
            return torch.arange(first, first + n, device=output.device)
        if (
            not isinstance(indices, torch.Tensor)
            or indices.dtype.is_floating_point
            or indices.dtype.is_complex
            or tuple(indices.shape) != (n,)
        ):
            raise ValueError(
                f'indices must be an integer tensor of shape ({n},), one '
                f'global index per example of output; got {indices!r}',
            )
        return indices.to(output.device, torch.int64)

    def receive(
        self, call: int, grad: torch.Tensor, helper: ModuleHelper
    ) -> torch.Tensor | None:
        """The capture's sink: the gradient to add to `call`, or None.

        Raises:
            RuntimeError: the gradient does not come from a sampled pass.
            ValueError: with `mc_samples > 1`, the module's output has no
                batch dimension to join the samples along.
        """
        if self._pass is None:
            raise RuntimeError(
                "K-FAC: fisher_type='mc' and this step updates factors, "
                'but a backward pass reached a registered module whose '
                'forward pass was not sampled: call '
                'preconditioner.sample_fisher(output, loss) after each '
                'forward pass and before loss.backward(), with the output '
                'every registered module feeds (or leave the others out '
                'with skip_layers)',
            )
        if self.samples == 1:
            return grad
        kept = self._kept.setdefault(call, [])
        kept.append(grad)
        if len(kept) < self.samples:
            return None
        del self._kept[call]
        return _join(kept, helper)


def _join(grads: list[torch.Tensor], helper: ModuleHelper) -> torch.Tensor:
    """`grads` of the samples joined along the batch dimension."""
    dim = int(grads[0].dim() > 2 and not helper.batch_first)
    whole = torch.cat(grads, dim)
    if helper.batch_size(whole) != len(grads) * helper.batch_size(grads[0]):
        raise ValueError(
            f'mc_samples={len(grads)} joins the samples along the batch '
            f'dimension, but module {type(helper.module).__name__} has an '
            f'output of shape {tuple(grads[0].shape)} without one; use '
            'mc_samples=1',
        )
    return whole


def _check_mask(
    mask: torch.Tensor | None, output: torch.Tensor, loss: str
) -> None:
    """Raise `ValueError` unless `mask` is None or a bool tensor shaped
    like `output` without its class dimension (cross-entropy only).
    """
    if mask is None:
        return
    if loss != 'cross_entropy':
        raise ValueError(
            "mask is supported with loss='cross_entropy' only; got "
            f'loss={loss!r}',
        )
    shape = tuple(output.shape[:-1])
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != shape
    ):
        raise ValueError(
            f'mask must be a bool tensor of shape {shape} (True: the '
            f'position counts, e.g. target != ignore_index); got {mask!r}',
        )
