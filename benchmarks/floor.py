"""The arithmetic floor of each phase of a K-FAC step, from layer shapes.

Each phase does a known amount of work: floating-point operations
(``flops``, a multiply-add counting 2) and the bytes it must at least read
and write (``nbytes``). Its *floor* on a machine is the roofline bound
``max(flops / matmul rate, nbytes / memory bandwidth)`` with both rates
measured on that machine (:mod:`benchmarks.machine`). Per layer, with
``a = in[+1]`` (side of ``A``), ``g = out`` (side of ``G``), ``R`` rows of
statistics per step (examples times weight-sharing positions) and ``s``
bytes per element:

============================  ===========================  ================
phase (when)                  flops                        bytes
============================  ===========================  ================
factor_capture (factor step)  ``2 R (in² + g²)``           input + output
                                                           gradient + ``a²
                                                           + g²`` results
running_average (factor)      ``3 (a² + g²)``              ``3 (a² + g²)``
decomposition (inverse step)  eigen ``9 (a³ + g³)``;       ``2 (a² + g²)``
                              inverse ``a³ + g³``
precondition (every step)     eigen ``4 (g² a + g a²)``;   ``V``, ``V'``,
                              inverse ``2 (g² a + g a²)``  both factors
kl_clip (every step)          ``2 g a``                    ``2 g a``
write_back (every step)       ``g a``                      ``2 g a``
============================  ===========================  ================

(bytes column times ``s``; the flops of ``factor_capture`` and
``precondition`` are exactly those of their matrix products, which
``torch.utils.flop_counter`` confirms in the tests; elementwise work, such
as eigen's division by ``d_G d_Aᵀ + λ``, is in the bytes.) The constants of
the decompositions:

* ``9 n³`` for a symmetric eigendecomposition with eigenvectors (the
  symmetric QR algorithm, Golub & Van Loan, *Matrix Computations*, 4th ed.,
  §8.3); LAPACK's divide and conquer (``syevd``, used by
  ``torch.linalg.eigh`` on CPUs) needs fewer on easy spectra, but half of
  its tridiagonal reduction is matrix-vector work that runs far below the
  matrix-multiply rate, so ``9 n³`` at that rate is a floor no CPU
  implementation beats. :mod:`benchmarks.machine` measures the effective
  constant of ``eigh`` on the machine and reports it.
* ``n³`` for the inverse of a symmetric positive definite matrix through
  its Cholesky factor (``potrf`` ``n³/3`` + ``potri`` ``2n³/3``); a
  general LU inverse (``torch.linalg.inv``) costs ``2 n³``.

Communication phases have no arithmetic; at world size 1 they move no bytes
and their floor is 0 (their time is reported as overhead). The running
average could be fused into the statistic's matrix product (``C ← ξ C +
(1-ξ) XᵀX`` is one ``gemm``), so its floor is a conservative separate pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Mapping

import torch
from torch import nn

__all__ = [
    'EIGH_FLOPS_PER_N3',
    'INVERSE_FLOPS_PER_N3',
    'PHASE_SCHEDULE',
    'LayerShape',
    'Work',
    'cycle_counts',
    'floor_seconds',
    'layer_shapes',
    'phase_work',
    'step_work',
]

#: Flops of a symmetric eigendecomposition with eigenvectors, over ``n³``.
EIGH_FLOPS_PER_N3 = 9.0
#: Flops of a symmetric positive definite inverse (Cholesky), over ``n³``.
INVERSE_FLOPS_PER_N3 = 1.0

#: When each phase runs: on factor-update steps, decomposition steps, or
#: every step.
PHASE_SCHEDULE: Mapping[str, str] = {
    'factor_capture': 'factor',
    'running_average': 'factor',
    'factor_allreduce': 'factor',
    'decomposition': 'inverse',
    'decomposition_broadcast': 'inverse',
    'precondition': 'step',
    'grad_broadcast': 'step',
    'kl_clip': 'step',
    'write_back': 'step',
}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """K-FAC's view of one layer.

    Attributes:
        name: the module's dotted name.
        a_dim: side of ``A``: inputs per output (``in``, or ``C kh kw`` for
            a convolution), plus 1 with a bias.
        g_dim: side of ``G``: the outputs (``out``).
        rows: rows ``R`` of both statistics in one step (examples times
            weight-sharing positions); 0 when unknown.
        input_numel: elements of the module's input in one step.
        output_numel: elements of its output (and output gradient).
        bias: whether ``A`` includes a bias row and column (the library
            fills those from column sums, not a matrix product).

    """

    name: str
    a_dim: int
    g_dim: int
    rows: int = 0
    input_numel: int = 0
    output_numel: int = 0
    bias: bool = False

    @property
    def grad_numel(self) -> int:
        """Elements of the gradient matrix ``V``, ``g · a``."""
        return self.a_dim * self.g_dim


@dataclasses.dataclass(frozen=True)
class Work:
    """Floating-point operations and bytes moved by some computation."""

    flops: float = 0.0
    nbytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.nbytes + other.nbytes)

    def __mul__(self, times: float) -> Work:
        return Work(self.flops * times, self.nbytes * times)


def _supported(module: nn.Module) -> bool:
    weight = getattr(module, 'weight', None)
    trainable = isinstance(weight, nn.Parameter) and weight.requires_grad
    if isinstance(module, nn.Conv2d):
        return trainable and module.groups == 1
    return trainable and isinstance(module, nn.Linear)


def _static_shape(name: str, module: nn.Module) -> LayerShape:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # checked by _supported
    bias = getattr(module, 'bias', None)
    has_bias = isinstance(bias, torch.Tensor) and bias.requires_grad
    a_dim = weight[0].numel() + int(has_bias)
    return LayerShape(name, a_dim, weight.shape[0], bias=has_bias)


def layer_shapes(
    model: nn.Module,
    inputs: torch.Tensor | None = None,
) -> list[LayerShape]:
    """Shapes of the layers K-FAC preconditions, in ``named_modules`` order.

    The Linear and Conv2d (``groups == 1``) modules with a trainable
    weight. With ``inputs``, one forward pass (without gradients) records
    each layer's rows and tensor sizes.
    """
    shapes = {
        name: _static_shape(name, module)
        for name, module in model.named_modules()
        if _supported(module)
    }
    if inputs is None:
        return list(shapes.values())
    modules = dict(model.named_modules())
    sizes: dict[str, tuple[int, int, int]] = {}

    def record(name: str, args: tuple[torch.Tensor, ...], out: object) -> None:
        assert isinstance(out, torch.Tensor)
        rows = out.numel() // shapes[name].g_dim
        sizes[name] = (rows, args[0].numel(), out.numel())

    handles = [
        modules[name].register_forward_hook(
            lambda _m, args, out, name=name: record(name, args, out)
        )
        for name in shapes
    ]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [
        dataclasses.replace(
            shape,
            rows=sizes[name][0],
            input_numel=sizes[name][1],
            output_numel=sizes[name][2],
        )
        for name, shape in shapes.items()
        if name in sizes
    ]


def _capture(layer: LayerShape, itemsize: int) -> Work:
    squares = layer.a_dim**2 + layer.g_dim**2
    inputs = layer.a_dim - int(layer.bias)
    flops = 2.0 * layer.rows * (inputs**2 + layer.g_dim**2)
    moved = layer.input_numel + layer.output_numel + squares
    return Work(flops, moved * itemsize)


def _decomposition(layer: LayerShape, method: str, itemsize: int) -> Work:
    cubes = float(layer.a_dim**3 + layer.g_dim**3)
    squares = layer.a_dim**2 + layer.g_dim**2
    if method == 'eigen':
        flops = EIGH_FLOPS_PER_N3 * cubes + 2.0 * layer.grad_numel
        return Work(flops, (2 * squares + layer.grad_numel) * itemsize)
    return Work(INVERSE_FLOPS_PER_N3 * cubes, 2 * squares * itemsize)


def _precondition(layer: LayerShape, method: str, itemsize: int) -> Work:
    a, g, v = layer.a_dim, layer.g_dim, layer.grad_numel
    chain = float(g * g * a + g * a * a)
    if method == 'eigen':
        return Work(4.0 * chain, (3 * v + a * a + g * g) * itemsize)
    return Work(2.0 * chain, (2 * v + a * a + g * g) * itemsize)


def phase_work(
    layer: LayerShape,
    method: str,
    itemsize: int = 4,
) -> dict[str, Work]:
    """Work of each computing phase of ``layer``, once.

    Args:
        layer: the layer (``rows`` must be known for ``factor_capture``).
        method: ``'eigen'`` or ``'inverse'``.
        itemsize: bytes per element of factors and gradients.

    """
    if method not in ('eigen', 'inverse'):
        raise ValueError(
            f"method must be 'eigen' or 'inverse'; got {method!r}"
        )
    squares = layer.a_dim**2 + layer.g_dim**2
    v = layer.grad_numel
    return {
        'factor_capture': _capture(layer, itemsize),
        'running_average': Work(3.0 * squares, 3 * squares * itemsize),
        'decomposition': _decomposition(layer, method, itemsize),
        'precondition': _precondition(layer, method, itemsize),
        'kl_clip': Work(2.0 * v, 2 * v * itemsize),
        'write_back': Work(float(v), 2 * v * itemsize),
    }


def step_work(
    layers: Iterable[LayerShape],
    method: str,
    itemsize: int = 4,
) -> dict[str, Work]:
    """:func:`phase_work` summed over ``layers``, per phase (once each)."""
    total: dict[str, Work] = {}
    for layer in layers:
        for phase, work in phase_work(layer, method, itemsize).items():
            total[phase] = total.get(phase, Work()) + work
    return total


def cycle_counts(
    factor_steps: int,
    inv_steps: int,
    cycle: int = 100,
) -> dict[str, int]:
    """How often each schedule runs in ``cycle`` steps starting at step 0.

    >>> cycle_counts(10, 100)
    {'factor': 10, 'inverse': 1, 'step': 100}
    """
    return {
        'factor': len(range(0, cycle, factor_steps)),
        'inverse': len(range(0, cycle, inv_steps)),
        'step': cycle,
    }


def floor_seconds(work: Work, flops_per_s: float, bytes_per_s: float) -> float:
    """Roofline floor: ``max(flops / matmul rate, bytes / bandwidth)``."""
    return max(work.flops / flops_per_s, work.nbytes / bytes_per_s)
