"""Per-layer K-FAC state and mathematics, independent of placement.

A :class:`KFACBaseLayer` holds one module's two Kronecker factors and does
what it is told: capture hook data, update the running averages, compute a
factor's decomposition, precondition the gradient, and take part in the
collectives the preconditioner asks for. Which rank does what is decided by
a :class:`kfac.assignment.WorkAssignment`, never here.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup

from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.factor import KroneckerFactor
from kfac.layers.modules import ModuleHelper
from kfac.math import compute_dtype

FACTOR_NAMES = ('A', 'G')
LOSS_REDUCTIONS = ('mean', 'sum')


class KFACBaseLayer(abc.ABC):
    """K-FAC state of one module.

    Args:
        module: helper of the module this layer preconditions.
        factor_dtype: dtype of the running factors; default: the wider of
            the parameter dtype and float32. Batch statistics are always
            accumulated in at least float32.
        inv_dtype: dtype in which decompositions are stored and gradients
            preconditioned; default: the wider of the parameter dtype and
            float32. Decompositions are computed in the wider of this and
            float32.
        loss_reduction: ``'mean'`` (the loss averages its ``N`` examples, so
            output gradients are multiplied by ``N``) or ``'sum'``.

    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_reduction: str = 'mean',
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f'loss_reduction must be one of {LOSS_REDUCTIONS}; got '
                f'{loss_reduction!r}',
            )
        self.module = module
        self.loss_reduction = loss_reduction
        param_dtype = module.weight.dtype
        stat_dtype = compute_dtype(param_dtype, factor_dtype or param_dtype)
        self.factor_dtype = factor_dtype or compute_dtype(param_dtype)
        self.inv_dtype = inv_dtype or compute_dtype(param_dtype)
        self.decomposition_dtype = compute_dtype(self.inv_dtype)
        self.a = KroneckerFactor(
            'A',
            module.a_factor_shape[0],
            lambda x, _: module.a_statistic(x, stat_dtype),
            self.factor_dtype,
        )
        self.g = KroneckerFactor(
            'G',
            module.g_factor_shape[0],
            lambda x, m: module.g_statistic(
                x,
                stat_dtype,
                m,
                per_example=loss_reduction == 'mean',
            ),
            self.factor_dtype,
        )
        #: The preconditioned gradient of the current step, if any.
        self.grad: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.module.module!r})'

    # Factors ---------------------------------------------------------------

    @property
    def factors(self) -> tuple[KroneckerFactor, KroneckerFactor]:
        """``(A, G)``."""
        return (self.a, self.g)

    def factor(self, name: str) -> KroneckerFactor:
        """The factor called ``name`` (``'A'`` or ``'G'``)."""
        if name == 'A':
            return self.a
        if name == 'G':
            return self.g
        raise ValueError(f'factor name must be "A" or "G"; got {name!r}')

    def save_layer_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> None:
        """Capture the module input of one micro-batch (forward hook)."""
        self.a.capture(layer_input, 1.0, now=now)

    def save_layer_grad_output(
        self,
        grad_output: torch.Tensor,
        *,
        loss_scale: float = 1.0,
        accumulation_steps: int = 1,
        now: bool,
    ) -> None:
        """Capture the output gradient of one micro-batch (backward hook).

        Args:
            grad_output: gradient of the (scaled) loss w.r.t. the output.
            loss_scale: the mixed-precision loss scale to divide out.
            accumulation_steps: micro-batches in the step; with ``'mean'``
                reduction each micro-batch loss is assumed divided by it, so
                the output gradient is multiplied back.
            now: compute the statistic now instead of keeping the tensor.

        """
        accumulation = (
            accumulation_steps if self.loss_reduction == 'mean' else 1
        )
        self.g.capture(grad_output, accumulation / loss_scale, now=now)

    def update_factors(self, decay: float) -> bool:
        """Fold the captured batch into both running averages.

        Returns:
            Whether both factors had a batch (the module ran).

        """
        if not (self.a.captures and self.g.captures):
            self.reset_batch()
            return False
        for factor in self.factors:
            factor.update(decay)
        return True

    def reset_batch(self) -> None:
        """Drop captured data of both factors."""
        for factor in self.factors:
            factor.reset_batch()

    @property
    def has_factors(self) -> bool:
        """Whether both running factors exist."""
        return self.a.value is not None and self.g.value is not None

    def reduce_factors(
        self,
        comm: TorchDistributedCommunicator,
        group: ProcessGroup | None,
        *,
        bucketed: bool,
    ) -> Iterator[tuple[KroneckerFactor, Handle]]:
        """Start averaging both running factors over ``group``.

        Every rank of ``group`` must call this for the same layers in the
        same order. Yields ``(factor, handle)``; the caller stores
        ``handle.wait()`` into ``factor.value``.
        """
        reduce = comm.allreduce_bucketed if bucketed else comm.allreduce
        for factor in self.factors:
            value = factor.value
            if value is None:
                raise RuntimeError(f'{self}: reduce_factors before update')
            yield factor, reduce(value, group=group, symmetric=True)

    # Decompositions --------------------------------------------------------

    @abc.abstractmethod
    def compute_decomposition(self, name: str, damping: float) -> None:
        """Decompose factor ``name``; store it in the factor.

        Only the factor's inverse worker calls this.
        """

    @property
    @abc.abstractmethod
    def decomposition_format(self) -> str:
        """Name of the decomposition's layout, checked when loading."""

    @abc.abstractmethod
    def decomposition_layout(
        self,
        name: str,
    ) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Shapes of factor ``name``'s decomposition tensors, and whether each
        is symmetric (so may be sent as a packed triangle).
        """

    def broadcast_decomposition(
        self,
        name: str,
        comm: TorchDistributedCommunicator,
        *,
        src: int,
        group: ProcessGroup | None,
    ) -> list[tuple[int, Handle]]:
        """Start broadcasting factor ``name``'s decomposition from ``src``.

        Every gradient worker of the layer (the ranks of ``group``) must call
        this. Receivers allocate the tensors; returns ``(index, handle)``
        pairs that :meth:`set_decomposition_part` consumes.
        """
        factor = self.factor(name)
        layout = self.decomposition_layout(name)
        tensors = factor.decomposition
        if tensors is None:
            tensors = tuple(
                torch.empty(shape, dtype=self.inv_dtype, device=self.device)
                for shape, _ in layout
            )
            factor.decomposition = tensors
        return [
            (i, comm.broadcast(t, src=src, group=group, symmetric=sym))
            for i, (t, (_, sym)) in enumerate(zip(tensors, layout))
        ]

    def set_decomposition_part(
        self,
        name: str,
        index: int,
        tensor: torch.Tensor,
    ) -> None:
        """Store one received decomposition tensor."""
        factor = self.factor(name)
        parts = list(factor.decomposition or ())
        parts[index] = tensor
        factor.decomposition = tuple(parts)

    @property
    def has_decomposition(self) -> bool:
        """Whether both factors' decompositions are held on this rank."""
        return all(f.decomposition is not None for f in self.factors)

    def clear_decompositions(self) -> None:
        """Drop both decompositions (a rank that is no gradient worker)."""
        for factor in self.factors:
            factor.decomposition = None

    # Gradients -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Device of the module's weight."""
        return self.module.weight.device

    @abc.abstractmethod
    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        """Return the preconditioned ``V`` (in ``inv_dtype``)."""

    def precondition_grad(self, damping: float) -> torch.Tensor | None:
        """Compute :attr:`grad` from the module's current gradient.

        Only gradient workers call this, after :meth:`compute_decomposition`
        or a broadcast gave them both decompositions.
        """
        grad = self.module.get_grad()
        if grad is None:
            self.grad = None
        else:
            self.grad = self._precondition(grad.to(self.inv_dtype), damping)
        return self.grad

    def broadcast_grad(
        self,
        comm: TorchDistributedCommunicator,
        *,
        src: int,
        group: ProcessGroup | None,
    ) -> Handle:
        """Start broadcasting the preconditioned gradient from ``src``.

        Every rank of ``group`` (the gradient receivers served by ``src``)
        must call this; receivers allocate the buffer.
        """
        grad = self.grad
        if grad is None:
            shape = self.module.grad_shape
            grad = torch.empty(shape, dtype=self.inv_dtype, device=self.device)
        return comm.broadcast(grad, src=src, group=group)

    def write_grad(self, scale: torch.Tensor | None) -> None:
        """Write :attr:`grad` (times ``scale``) into ``.grad`` and clear it."""
        grad = self.grad
        if grad is None:
            return
        if scale is not None:
            grad = grad * scale
        self.module.set_grad(grad)
        self.grad = None

    # Introspection ---------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer on this rank.

        Keys: ``a_factors``, ``g_factors``, ``a_batch``, ``g_batch``,
        ``a_inverses``, ``g_inverses`` and ``grad``.
        """
        usage: dict[str, int] = {}
        for factor in self.factors:
            key = factor.name.lower()
            parts = factor.memory_usage()
            usage[f'{key}_factors'] = parts['factor']
            usage[f'{key}_batch'] = parts['batch']
            usage[f'{key}_inverses'] = parts['decomposition']
        grad = self.grad
        usage['grad'] = (
            0 if grad is None else grad.numel() * grad.element_size()
        )
        return usage
