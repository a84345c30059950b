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

Layers of today's models, in the same terms:

* **Linear on sequences** ``(N, T, in)`` (expand, the default): ``R = N T``,
  every position a row. **reduce** (``kfac_approx='reduce'``): inputs are
  averaged and output gradients summed over the ``T`` positions of each
  example first, so ``R = N`` (the averaging is a pass over the input and
  output gradient, already in the bytes). A convolution under reduce
  likewise has ``R = N``. **sampled positions** (``position_sample``,
  expand): ``R = N k`` with ``k`` the positions drawn per example
  (:func:`kfac.layers.sampling.sample_size`); drawing them is a few integer
  operations per position, outside the count.
* **Attention projections**: ``nn.MultiheadAttention`` is converted as the
  preconditioner converts it (:func:`kfac.layers.attention.convert_attention`)
  and its q, k, v and ``out_proj`` projections are Linear layers of
  ``E`` outputs (``a = E + 1``, ``g = E``) on sequences.
* **Embedding** (``V`` tokens of width ``d``): a Linear on one-hot inputs
  with a *diagonal* ``A`` (token counts, ``a = V``, a vector) and ``g = d``;
  ``R`` is the number of indices. Capture: ``2 R g²`` (``A`` is a scatter
  of ``R`` ones, no product; its ``R`` index reads are in the bytes);
  running average ``3 (V + g²)``; decomposition of ``G`` alone (eigen
  ``9 g³`` plus the ``d_G d_Aᵀ`` table, ``2 g V``; inverse ``g³``);
  precondition eigen ``4 g² V``, inverse ``2 g² V`` (products with ``Q_G``
  or ``G⁻¹``; the diagonal ``A`` is a scaling, in the bytes).
* **Tied embedding and head** (an ``nn.Embedding`` whose weight a
  bias-free output head also uses, :mod:`kfac.layers.tied`): one layer,
  named after the first of the two modules, in the embedding's orientation
  (``a = V``, ``g = d``) with a *dense* combined ``A``. Each use keeps its
  own statistics: the embedding's as above, the head's as a Linear of
  ``d`` inputs and ``V`` outputs on its ``R_h`` rows, so capture adds
  ``2 R_h (d² + V²)`` and the running average ``3 (d² + V²)``; the
  decomposition and preconditioning are those of a dense ``(V, V)`` ``A``.
  Any other weight shared between modules of different types is left to
  the optimizer, as the library leaves it.

Communication phases have no arithmetic; at world size 1 they move no bytes
and their floor is 0 (their time is reported as overhead). The running
average could be fused into the statistic's matrix product (``C ← ξ C +
(1-ξ) XᵀX`` is one ``gemm``), so its floor is a conservative separate pass.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Iterable
from collections.abc import Mapping

import torch
from torch import nn

from kfac.layers.attention import AttentionProjection
from kfac.layers.attention import convert_attention
from kfac.layers.sampling import sample_size

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
        a_diagonal: whether ``A`` is diagonal (an embedding's token
            counts), kept as a vector of length ``a_dim``.
        head_rows: for an embedding tied to an output head, the rows of
            the head's statistics (0 otherwise; the fields above describe
            the embedding's use).
        head_numel: elements of the head's input and output in one step.

    """

    name: str
    a_dim: int
    g_dim: int
    rows: int = 0
    input_numel: int = 0
    output_numel: int = 0
    bias: bool = False
    a_diagonal: bool = False
    tied: bool = False
    head_rows: int = 0
    head_numel: int = 0

    @property
    def a_numel(self) -> int:
        """Elements of ``A`` as stored: ``a²``, or ``a`` when diagonal."""
        return self.a_dim if self.a_diagonal else self.a_dim**2

    @property
    def running_numel(self) -> int:
        """Elements of the running factors: ``A`` and ``G``, or each use's
        (a tied layer: the embedding's ``a`` and ``g²``, the head's ``g²``
        and ``a²``).
        """
        if self.tied:
            return self.a_dim + 2 * self.g_dim**2 + self.a_dim**2
        return self.a_numel + self.g_dim**2

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


def _trainable(tensor: object) -> bool:
    return isinstance(tensor, nn.Parameter) and tensor.requires_grad


def _static_shape(name: str, module: nn.Module) -> LayerShape | None:
    """K-FAC's view of ``module``, or None when it is not preconditioned."""
    if isinstance(module, AttentionProjection):
        weight, rows, bias = module.parameters_slices()
        has_bias = _trainable(bias)
        out, inputs = weight[rows].shape
        return LayerShape(name, inputs + int(has_bias), out, bias=has_bias)
    if isinstance(module, nn.Embedding):
        plain = module.max_norm is None and not module.sparse
        if not (plain and _trainable(module.weight)):
            return None
        if module.scale_grad_by_freq:
            return None
        v, d = module.weight.shape
        return LayerShape(name, v, d, a_diagonal=True)
    conv = isinstance(module, nn.Conv2d) and module.groups == 1
    if not (conv or isinstance(module, nn.Linear)):
        return None
    param = getattr(module, 'weight', None)
    if not _trainable(param):
        return None
    assert isinstance(param, torch.Tensor)
    has_bias = _trainable(getattr(module, 'bias', None))
    a_dim = param[0].numel() + int(has_bias)
    return LayerShape(name, a_dim, param.shape[0], bias=has_bias)


def _shared(model: nn.Module) -> tuple[dict[str, str], set[str]]:
    """Weights shared by modules of different types.

    Returns ``({embedding: head}, left)``: each embedding whose weight a
    bias-free Linear head uses as well (one tied layer), and the modules of
    every other such sharing (left to the optimizer).
    """
    users: dict[int, list[tuple[str, nn.Module]]] = collections.defaultdict(
        list
    )
    for name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get('weight')
        if weight is not None:
            users[id(weight)].append((name, module))
    tied: dict[str, str] = {}
    left: set[str] = set()
    for group in users.values():
        if len({type(m) for _, m in group}) < 2:
            continue
        kinds = {type(m): name for name, m in group}
        emb, head = kinds.get(nn.Embedding), kinds.get(nn.Linear)
        modules = dict(group)
        pair = len(group) == 2 and emb is not None and head is not None
        if pair and emb and head and modules[head].bias is None:
            tied[emb] = head
        else:
            left.update(name for name, _ in group)
    return tied, left


def layer_shapes(
    model: nn.Module,
    inputs: torch.Tensor | None = None,
    *,
    kfac_approx: str = 'expand',
    skip_types: Iterable[str] = (),
    position_sample: float | None = None,
) -> list[LayerShape]:
    """Shapes of the layers K-FAC preconditions, in ``named_modules`` order.

    The Linear, Conv2d (``groups == 1``) and Embedding modules with a
    trainable weight and the projections of every ``nn.MultiheadAttention``
    (a copy of ``model`` is converted as the preconditioner converts it;
    ``model`` itself is left as it is),
    less those whose type name is in ``skip_types`` and those sharing their
    weight with a module of another type (see the module docstring). With
    ``inputs``, one forward pass (without gradients) records each layer's
    rows and tensor sizes; under ``kfac_approx='reduce'`` a Linear or
    convolution has one row per example (embeddings stay at expand), with
    ``position_sample`` (expand) ``k`` rows per example of ``T``
    positions.
    """
    if kfac_approx not in ('expand', 'reduce'):
        raise ValueError(
            f"kfac_approx must be 'expand' or 'reduce'; got {kfac_approx!r}"
        )
    if any(type(m) is nn.MultiheadAttention for m in model.modules()):
        model = copy.deepcopy(model)  # converted as the preconditioner would
        convert_attention(model)
    tied, left = _shared(model)
    heads = {head: emb for emb, head in tied.items()}
    skipped = set(skip_types) | left | set(heads)
    shapes = {}
    for name, module in model.named_modules():
        if name in skipped or type(module).__name__ in skipped:
            continue
        shape = _static_shape(name, module)
        if shape is not None:
            if name in tied:  # the combined A is dense
                shape = dataclasses.replace(shape, tied=True, a_diagonal=False)
            shapes[name] = shape
    if inputs is None:
        return list(shapes.values())
    modules = dict(model.named_modules())
    sizes: dict[str, tuple[int, int, int]] = {}

    def record(name: str, args: tuple[torch.Tensor, ...], out: object) -> None:
        assert isinstance(out, torch.Tensor)
        # a tied head (not in shapes) is a Linear: its outputs are last
        outputs = shapes[name].g_dim if name in shapes else out.shape[-1]
        rows = out.numel() // outputs
        diagonal = isinstance(modules[name], nn.Embedding)
        examples = out.shape[0] if out.dim() > 1 else 1
        if kfac_approx == 'reduce' and not diagonal:
            rows = examples
        elif position_sample is not None and not diagonal:
            rows = examples * sample_size(position_sample, rows // examples)
        sizes[name] = (rows, args[0].numel(), out.numel())

    recorded = [*shapes, *(h for h in heads if heads[h] in shapes)]
    handles = [
        modules[name].register_forward_hook(
            lambda _m, args, out, name=name: record(name, args, out)
        )
        for name in recorded
    ]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    result = []
    for name, shape in shapes.items():
        if name not in sizes:
            continue
        head = sizes.get(tied.get(name, ''), (0, 0, 0))
        result.append(
            dataclasses.replace(
                shape,
                rows=sizes[name][0],
                input_numel=sizes[name][1],
                output_numel=sizes[name][2],
                head_rows=head[0],
                head_numel=head[1] + head[2],
            )
        )
    return result


def _capture(layer: LayerShape, itemsize: int) -> Work:
    one_hot = layer.a_diagonal or layer.tied  # A from counts, no product
    inputs = 0 if one_hot else layer.a_dim - int(layer.bias)
    flops = 2.0 * layer.rows * (inputs**2 + layer.g_dim**2)
    # a tied layer's head: a Linear of g inputs and a outputs
    flops += 2.0 * layer.head_rows * (layer.g_dim**2 + layer.a_dim**2)
    moved = layer.input_numel + layer.output_numel + layer.head_numel
    return Work(flops, (moved + layer.running_numel) * itemsize)


def _ranks(layer: LayerShape, rank: int | None) -> tuple[int, int] | None:
    """``(k_A, k_G)`` of a low-rank layer under ``factor_rank=rank`` (a
    side kept whole at its full size), or None (a plain layer).
    """
    if rank is None or layer.a_diagonal or layer.tied:
        return None
    if max(layer.a_dim, layer.g_dim) <= rank:
        return None
    return min(layer.a_dim, rank), min(layer.g_dim, rank)


def _decomposition(
    layer: LayerShape, method: str, itemsize: int, rank: int | None = None
) -> Work:
    a_cube = 0 if layer.a_diagonal else layer.a_dim**3
    cubes = float(a_cube + layer.g_dim**3)
    squares = layer.a_numel + layer.g_dim**2
    ranks = _ranks(layer, rank)
    if ranks is not None and method == 'inverse':
        # eigh of a low-rank factor, the Cholesky inverse of a whole one
        flops = sum(
            float(n**3) * (EIGH_FLOPS_PER_N3 if k < n else 1.0)
            for n, k in zip((layer.a_dim, layer.g_dim), ranks)
        )
        return Work(flops, 2 * squares * itemsize)
    if ranks is not None:  # eigh of each factor, no outer product
        return Work(EIGH_FLOPS_PER_N3 * cubes, 2 * squares * itemsize)
    if method == 'eigen':
        flops = EIGH_FLOPS_PER_N3 * cubes + 2.0 * layer.grad_numel
        return Work(flops, (2 * squares + layer.grad_numel) * itemsize)
    return Work(INVERSE_FLOPS_PER_N3 * cubes, 2 * squares * itemsize)


def _lowrank_chain(a: int, g: int, ka: int, kg: int, method: str) -> float:
    """Matrix-product flops of the low-rank preconditioner
    (:func:`kfac.math.lowrank.lowrank_eigen_precondition` or
    :func:`~kfac.math.lowrank.lowrank_inverse_precondition`).
    """
    low_a, low_g = ka < a, kg < g
    if method == 'inverse':
        left = 4 * g * kg * a if low_g else 2 * g * g * a
        right = 4 * g * a * ka if low_a else 2 * g * a * a
        return float(left + right)
    flops = 2 * g * a * ka + 4 * kg * g * ka + 2 * g * ka * a
    flops += 2 * g * kg * ka if low_g else 0
    if low_a:
        flops += 2 * g * ka * a + 4 * kg * g * a
        flops += 2 * g * kg * a if low_g else 0
    return float(flops)


def _precondition(
    layer: LayerShape, method: str, itemsize: int, rank: int | None = None
) -> Work:
    a, g, v = layer.a_dim, layer.g_dim, layer.grad_numel
    ranks = _ranks(layer, rank)
    if ranks is not None:
        held = a * ranks[0] + g * ranks[1]  # Q_k of each side
        flops = _lowrank_chain(a, g, *ranks, method)
        return Work(flops, (3 * v + held) * itemsize)
    a_side = 0 if layer.a_diagonal else g * a * a
    chain = float(g * g * a + a_side)
    factors = layer.a_numel + g * g
    if method == 'eigen':
        return Work(4.0 * chain, (3 * v + factors) * itemsize)
    return Work(2.0 * chain, (2 * v + factors) * itemsize)


def phase_work(
    layer: LayerShape,
    method: str,
    itemsize: int = 4,
    rank: int | None = None,
) -> dict[str, Work]:
    """Work of each computing phase of ``layer``, once.

    Args:
        layer: the layer (``rows`` must be known for ``factor_capture``).
        method: ``'eigen'`` or ``'inverse'``.
        itemsize: bytes per element of factors and gradients.
        rank: ``factor_rank`` (a dense factor longer than it kept as
            ``Q_k``; its decomposition is still a full ``eigh``).

    """
    if method not in ('eigen', 'inverse'):
        raise ValueError(
            f"method must be 'eigen' or 'inverse'; got {method!r}"
        )
    v = layer.grad_numel
    return {
        'factor_capture': _capture(layer, itemsize),
        'running_average': Work(
            3.0 * layer.running_numel, 3 * layer.running_numel * itemsize
        ),
        'decomposition': _decomposition(layer, method, itemsize, rank),
        'precondition': _precondition(layer, method, itemsize, rank),
        'kl_clip': Work(2.0 * v, 2 * v * itemsize),
        'write_back': Work(float(v), 2 * v * itemsize),
    }


def step_work(
    layers: Iterable[LayerShape],
    method: str,
    itemsize: int = 4,
    rank: int | None = None,
) -> dict[str, Work]:
    """:func:`phase_work` summed over ``layers``, per phase (once each)."""
    total: dict[str, Work] = {}
    for layer in layers:
        for phase, work in phase_work(layer, method, itemsize, rank).items():
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
