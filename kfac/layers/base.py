"""Per-layer K-FAC state and mathematics, independent of placement.

A :class:`KFACBaseLayer` holds one module's two Kronecker factors and does
what it is told: capture hook data, update the running averages, compute a
factor's decomposition, precondition the gradient, and take part in the
collectives the preconditioner asks for. Which rank does what is decided by
a :class:`kfac.assignment.WorkAssignment`, never here.
"""

from __future__ import annotations

import abc
import math
from collections import Counter
from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup

from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.factor import KroneckerFactor
from kfac.layers.modules import ModuleHelper
from kfac.math import compute_dtype
from kfac.validation import check_dtype
from kfac.validation import check_instance

FACTOR_NAMES = ('A', 'G')
#: ``torch.linalg.LinAlgError``: public, but not re-exported in the stubs.
LinAlgError: type[Exception] = torch.linalg.LinAlgError  # type: ignore[attr-defined]
#: Relative diagonal jitter of the last decomposition attempt.
JITTER = 1e-6
LOSS_REDUCTIONS = ('mean', 'sum')


#: One decomposition attempt: its tensors and a 0-d bool tensor (on the
#: device: no host synchronisation) telling whether they are valid; None
#: when the attempt raised ``LinAlgError``.
Attempt = tuple[tuple[torch.Tensor, ...], torch.Tensor] | None
#: What :meth:`KFACBaseLayer._decompose` returns: the tensors, and a 0-d bool
#: tensor when the routine reports success or failure itself.
Decomposed = tuple[tuple[torch.Tensor, ...], torch.Tensor | None]


def all_finite(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """0-d bool tensor: whether every entry of every tensor is finite."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return torch.stack(flags).all()


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
        check_instance(
            'module',
            module,
            ModuleHelper,
            'a kfac.layers.modules.ModuleHelper',
        )
        check_dtype('factor_dtype', factor_dtype)
        check_dtype('inv_dtype', inv_dtype)
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
        #: The gradient matrix ``V`` read by :meth:`precondition_grad`.
        self.raw_grad: torch.Tensor | None = None
        #: Fault counters: ``decomposition_retries``,
        #: ``decomposition_failures``, ``unpreconditioned_steps``,
        #: ``nonfinite_gradients`` (absent until the first event).
        self.counters: Counter[str] = Counter()

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

    def update_factors(self, decay: float) -> torch.Tensor | None:
        """Fold the captured batch into both running averages, provisionally.

        Returns:
            None if the module did not run (nothing changes), else a 0-d
            bool tensor: whether both batch statistics were finite. The
            caller then calls :meth:`commit_factors` or
            :meth:`rollback_factors`.
        """
        if not (self.a.captures and self.g.captures):
            self.reset_batch()
            return None
        finite = [factor.update(decay) for factor in self.factors]
        return torch.logical_and(finite[0], finite[1])  # type: ignore[arg-type]  # both captured

    def commit_factors(self) -> None:
        """Keep the last :meth:`update_factors`."""
        for factor in self.factors:
            factor.commit()

    def rollback_factors(self) -> None:
        """Undo the last :meth:`update_factors`."""
        for factor in self.factors:
            factor.rollback()

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

    def compute_decomposition(self, name: str, damping: float) -> bool:
        """Decompose factor ``name``; store it in the factor.

        Only the factor's inverse worker calls this. A decomposition that
        raises ``torch.linalg.LinAlgError`` or returns a non-finite value is
        retried in float64, then in float64 with a small jitter
        (``JITTER · (tr F / n + 1e-30) · I``) added to the factor; if all
        fail, the last good decomposition is kept (none: the layer's
        gradient goes unpreconditioned) and the failure is counted.

        This is :meth:`try_decomposition` followed by
        :meth:`finish_decomposition`; the preconditioner calls those two
        itself so that one host synchronisation checks all the factors it
        decomposes.

        Returns:
            Whether a new decomposition was stored.
        """
        first = self.try_decomposition(name, damping)
        valid = first is not None and bool(first[1])
        return self.finish_decomposition(name, damping, first, valid)

    def _attempts(self) -> list[tuple[torch.dtype, float]]:
        """``(dtype, relative jitter)`` of each attempt, in order."""
        attempts = [(self.decomposition_dtype, 0.0)]
        if self.decomposition_dtype != torch.float64:
            attempts.append((torch.float64, 0.0))
        attempts.append((torch.float64, JITTER))
        return attempts

    def try_decomposition(
        self,
        name: str,
        damping: float,
        attempt: int = 0,
    ) -> Attempt:
        """Run one attempt of decomposing factor ``name``; store nothing.

        The first attempt (``attempt=0``) needs no host synchronisation
        beyond what the decomposition routine itself does.
        """
        value = self.factor(name).value
        if value is None:
            raise RuntimeError(f'factor {name} of {self} has no value yet')
        dtype, jitter = self._attempts()[attempt]
        matrix = value.to(dtype)
        if jitter:
            scale = float(torch.diagonal(matrix).mean().abs()) + 1e-30
            eye = torch.eye(matrix.shape[0], dtype=dtype, device=self.device)
            matrix = matrix + jitter * scale * eye
        try:
            tensors, ok = self._decompose(name, matrix, dtype, damping)
        except LinAlgError:
            return None
        valid = all_finite(tensors)
        return tensors, valid if ok is None else valid & ok

    def finish_decomposition(
        self,
        name: str,
        damping: float,
        first: Attempt,
        valid: bool,
    ) -> bool:
        """Store the first attempt if ``valid``, else retry (see
        :meth:`compute_decomposition`).

        Args:
            name: ``'A'`` or ``'G'``.
            damping: the damping in force.
            first: what :meth:`try_decomposition` returned for attempt 0.
            valid: ``first``'s validity flag, read on the host.

        Returns:
            Whether a new decomposition was stored.
        """
        if valid and first is not None and self._store(name, first, damping):
            return True
        for attempt in range(1, len(self._attempts())):
            result = self.try_decomposition(name, damping, attempt)
            if (
                result is not None
                and bool(result[1])
                and self._store(name, result, damping)
            ):
                self.counters['decomposition_retries'] += attempt
                return True
        self.counters['decomposition_failures'] += 1
        return False

    def _store(self, name: str, result: Attempt, damping: float) -> bool:
        """Keep a valid attempt; False if it cannot be completed."""
        assert result is not None  # the caller checked
        final = self._finalize(name, result[0], damping)
        if final is None:
            return False
        self.factor(name).decomposition = tuple(
            t.to(self.inv_dtype) for t in final
        )
        return True

    def _finalize(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        damping: float,
    ) -> tuple[torch.Tensor, ...] | None:
        """Turn a valid attempt into the stored decomposition (None: it
        depends on another factor's decomposition, which failed).
        """
        return tensors

    @abc.abstractmethod
    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """Decompose ``matrix`` (factor ``name``) computing in ``dtype``.

        Returns:
            The tensors, and None or a 0-d bool tensor: whether the routine
            reported success (finiteness is checked by the caller).

        Raises:
            torch.linalg.LinAlgError: the decomposition failed.
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
    ) -> list[Handle]:
        """Start broadcasting factor ``name``'s decomposition from ``src``.

        Every gradient worker of the layer (the ranks of ``group``) must call
        this. Returns one handle per tensor of :meth:`decomposition_layout`;
        a source without a valid decomposition sends NaNs.
        """
        factor = self.factor(name)
        layout = self.decomposition_layout(name)
        tensors = factor.decomposition
        if tensors is None:
            # NaN marks "no valid decomposition" for the receivers.
            tensors = tuple(
                torch.full(
                    shape,
                    math.nan,
                    dtype=self.inv_dtype,
                    device=self.device,
                )
                for shape, _ in layout
            )
        return [
            comm.broadcast(t, src=src, group=group, symmetric=sym)
            for t, (_, sym) in zip(tensors, layout)
        ]

    def set_decomposition(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...] | None,
    ) -> None:
        """Store a received decomposition (None: no valid one)."""
        self.factor(name).decomposition = tensors

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

        Only gradient workers call this. Without both decompositions (every
        attempt to compute one failed) the raw gradient stands in for the
        preconditioned one, and the event is counted.
        """
        grad = self.module.get_grad()
        if grad is None:
            self.grad = None
            return None
        grad = grad.to(self.inv_dtype)
        self.raw_grad = grad
        if self.has_decomposition:
            self.grad = self._precondition(grad, damping)
        else:
            self.counters['unpreconditioned_steps'] += 1
            self.grad = grad
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
        self.grad = self.raw_grad = None
        if grad is not None:
            self.module.set_grad(grad, scale)

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
