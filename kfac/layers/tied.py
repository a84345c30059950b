r"""A weight tied in transposed roles: an embedding and its output head.

A language model's `lm_head` (an `nn.Linear(d, V, bias=False)`) often
shares its weight with the input embedding (`nn.Embedding(V, d)`):
`lm_head.weight is embedding.weight`. The embedding uses the weight `E`
as a Linear `s = Eᵀ e_k` from `V` one-hot inputs to `d` outputs; the head
as `s = E h`, from `d` inputs to `V` outputs. The parameter gets one
layer, keyed by the first of the two names in model order, whose
statistics ([`TiedStatistics`][kfac.layers.tied.TiedStatistics])

* captures each use's factors separately, as its own layer would
  ([`LayerStatistics`][kfac.layers.statistics.LayerStatistics] per use:
  the embedding's diagonal `A_e` and `(d, d)` `G_e`, the head's `(d, d)`
  `A_h` and `(V, V)` `G_h`), and keeps, allreduces and saves these running
  averages (named `'<module>:A'` and `'<module>:G'`);
* and whose curvature preconditions `V = (∇E)ᵀ`, of shape `(d, V)` (the
  embedding's orientation), with one Kronecker product `A ⊗ G` combining
  both uses: `A = X̄` `(V, V)`, `G = Ȳ` `(d, d)` from
  [`kronecker_sum_factors`][kfac.math.tied.kronecker_sum_factors] with the
  terms `(A_e, G_e)` and `(G_h, A_h)` (the formula and why it was chosen
  are in [`kfac.math`][kfac.math]), computed from the running averages
  whenever the factors are decomposed.

The combined `A` is dense, so a vocabulary longer than `max_factor_dim`
splits it into diagonal blocks (tiles, see
[`kfac.layers.blocks`][kfac.layers.blocks]): each tile combines the two
uses' blocks of its vocabulary range. A use that has not run yet counts as
no curvature (zero factors). Only this layer writes `E`'s gradient. A
call is told apart by its input: integer indices are the embedding's,
floating inputs the head's.

A head with a trained bias, or any other pair of roles, is left to the
optimizer (the registration report says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kfac.layers.examples import Call
from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.statistics import Captured
from kfac.layers.statistics import KroneckerFactor
from kfac.layers.statistics import LayerStatistics
from kfac.math.tied import kronecker_sum_factors

__all__ = ['TiedHelper', 'TiedStatistics', 'make_statistics']


class TiedHelper(ModuleHelper):
    """An embedding's weight that a bias-free head also uses, transposed.

    The gradient matrix and factor shapes are the embedding's (`V` the
    `(d, V)` transpose of the weight's gradient); the statistics come from
    each use's own helper.

    Args:
        embedding: the embedding's helper (or one tile of it).
        head: the head's helper, whose `A` side is the embedding's `G`
            side and vice versa (or the matching tile of it).
        names: the two modules' names, the embedding's first.

    Raises:
        ValueError: the helpers are not an embedding (diagonal `A`) and a
            head without bias of transposed shape.
    """

    def __init__(
        self,
        embedding: ModuleHelper,
        head: ModuleHelper,
        names: tuple[str, str],
    ) -> None:
        if not (
            embedding.a_diagonal
            and not head.a_diagonal
            and head.bias is None
            and embedding.a_factor_shape == head.g_factor_shape
            and embedding.g_factor_shape == head.a_factor_shape
        ):
            raise ValueError(
                'TiedHelper needs an embedding helper and a bias-free head '
                f'helper of transposed shape; got {embedding!r} and {head!r}'
            )
        self.module = embedding.module
        self.embedding = embedding
        """The embedding's helper: the orientation of `V`."""
        self.head = head
        """The head's helper."""
        self.names = names
        """The names of the embedding and of the head."""
        self.a_diagonal = False

    def __repr__(self) -> str:
        return f'TiedHelper({self.embedding!r}, {self.head!r})'

    @property
    def weight(self) -> torch.Tensor:  # noqa: D102
        return self.embedding.weight

    @property
    def bias(self) -> None:  # noqa: D102
        return None

    @property
    def in_features(self) -> int:  # noqa: D102
        return self.embedding.in_features

    @property
    def a_factor_shape(self) -> tuple[int, int]:  # noqa: D102
        return self.embedding.a_factor_shape

    @property
    def g_factor_shape(self) -> tuple[int, int]:  # noqa: D102
        return self.embedding.g_factor_shape

    def get_grad(  # noqa: D102
        self, grads: Grads | None = None
    ) -> torch.Tensor | None:
        return self.embedding.get_grad(grads)

    def set_grad(  # noqa: D102
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        self.embedding.set_grad(grad, scale, grads)

    def a_columns(
        self, layer_input: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[torch.Tensor]:
        """Not available: each use forms its own factors."""
        raise NotImplementedError('a tied weight forms factors per use')

    def g_columns(
        self, grad_output: torch.Tensor, dtype: torch.dtype, scale: float
    ) -> torch.Tensor:
        """Not available: each use forms its own factors."""
        raise NotImplementedError('a tied weight forms factors per use')

    def a_example_rows(
        self, layer_input: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Not available: each use has its own rows."""
        raise NotImplementedError('a tied weight has rows per use')

    def g_example_rows(
        self, grad_output: torch.Tensor, dtype: torch.dtype, scale: float
    ) -> torch.Tensor:
        """Not available: each use has its own rows."""
        raise NotImplementedError('a tied weight has rows per use')

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return self.embedding.batch_size(tensor)

    def positions(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return self.embedding.positions(tensor)


class TiedStatistics(LayerStatistics):
    """The statistics of a tied weight: one set per use, combined when
    decomposed.

    Args:
        module: the tied weight's helper.
        **kwargs: see
            [`LayerStatistics`][kfac.layers.statistics.LayerStatistics].

    Raises:
        TypeError: `module` is not a
            [`TiedHelper`][kfac.layers.tied.TiedHelper].
    """

    module: TiedHelper

    def __init__(self, module: ModuleHelper, **kwargs: Any) -> None:
        if not isinstance(module, TiedHelper):
            raise TypeError(
                f'{type(self).__name__} needs a TiedHelper; got {module!r}'
            )
        super().__init__(module, **kwargs)
        factor_dtype, inv_dtype = self._dtype_options
        self.uses = tuple(
            LayerStatistics(
                helper,
                factor_dtype=factor_dtype,
                inv_dtype=inv_dtype,
                loss_average=self.loss_average,
            )
            for helper in (module.embedding, module.head)
        )
        """The statistics of the embedding's use, then of the head's."""
        for name, use in zip(module.names, self.uses):
            use.a.name, use.g.name = f'{name}:A', f'{name}:G'
        self._examples = [0, 0]

    @property
    def factors(self) -> tuple[KroneckerFactor, ...]:
        """The running factors of both uses (what is reduced and saved)."""
        return tuple(f for use in self.uses for f in use.factors)

    def factor(self, name: str) -> KroneckerFactor:
        """`'A'`, `'G'` (the combined factors, holding the
        decompositions) or a use's factor by its name.
        """
        if name in ('A', 'G'):
            return super().factor(name)
        for factor in self.factors:
            if factor.name == name:
                return factor
        allowed = ['A', 'G', *(f.name for f in self.factors)]
        raise ValueError(f'factor name must be one of {allowed}; got {name!r}')

    def follow_module(self) -> bool:  # noqa: D102  # as in the base
        moved = super().follow_module()
        for use in self.uses:
            use.follow_module()
        if moved:
            for factor in (self.a, self.g):
                factor.move(self.device, self.factor_dtype, self.inv_dtype)
        return moved

    def prepare_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> Captured:
        """Capture one call's input: indices are the embedding's, a
        floating input the head's.
        """
        index = int(layer_input.is_floating_point())
        captured = self.uses[index].prepare_input(layer_input, now=now)
        return self.keep_input(captured._replace(use=index), layer_input)

    def add_call(  # noqa: D102  # as in the base
        self,
        layer_input: Captured,
        grad_output: torch.Tensor,
        *,
        loss_scale: float,
        accumulation_steps: int,
        now: bool,
    ) -> int:
        index = layer_input.use
        use = self.uses[index]
        count = use.add_call(
            layer_input,
            grad_output,
            loss_scale=loss_scale,
            accumulation_steps=accumulation_steps,
            now=now,
        )
        self._examples[index] = max(self._examples[index], count)
        multiplier, _ = use.g_scaling(grad_output, accumulation_steps)
        self.keep_call(layer_input, grad_output, multiplier / loss_scale)
        return count

    def add_examples(self, count: int) -> None:
        """Count each use's examples of one backward pass (its own, not
        `count`, the larger of the two).
        """
        for use, examples in zip(self.uses, self._examples):
            use.add_examples(examples)
        if self.examples is not None:
            self.examples.end_pass(max(self._examples))
        self._examples = [0, 0]

    @property
    def captures(self) -> tuple[int, int]:  # noqa: D102  # as in the base
        a, g = zip(*(use.captures for use in self.uses))
        return (sum(a), sum(g))

    def update_factors(
        self, decay: float, *, compiled: bool = False
    ) -> torch.Tensor | None:
        """Update each use that ran; None if neither did.

        A use that has not run yet while the other has counts as no
        curvature: its running factors start at zero (so its term drops
        out of the combination) and later batches average into them as
        into any running average.
        """
        if self.examples is not None:
            self.examples.seal()
        flags = [
            use.update_factors(decay, compiled=compiled) for use in self.uses
        ]
        ran = [flag for flag in flags if flag is not None]
        if not ran:
            return None
        for factor in self.factors:
            if factor.value is None:
                factor.value = torch.zeros(
                    factor.shape, dtype=factor.dtype, device=self.device
                )
        return torch.stack(ran).all()

    def reset_batch(self) -> None:  # noqa: D102  # as in the base
        super().reset_batch()
        self._examples = [0, 0]

    @property
    def has_factors(self) -> bool:
        """Whether some use has both running factors."""
        return any(use.has_factors for use in self.uses)

    def decomposition_input(self, name: str) -> torch.Tensor | None:
        """The combined factor `name` (`A`: `(V, V)`, `G`: `(d, d)`) from
        the uses that have factors (see
        [`kronecker_sum_factors`][kfac.math.tied.kronecker_sum_factors]).
        """
        embedding, head = self.uses
        terms = [
            (x.value, y.value)
            for x, y in ((embedding.a, embedding.g), (head.g, head.a))
            if x.value is not None and y.value is not None
        ]
        if not terms:
            return None
        combined = kronecker_sum_factors(terms)
        return combined[0] if name == 'A' else combined[1]

    def memory_usage(self) -> dict[str, int]:
        """As for any layer; `a_factors`/`a_batch` count the running
        factors on the vocabulary side (`A_e`, `G_h`), `g_factors`/`g_batch`
        those on the embedding side (`G_e`, `A_h`).
        """
        usage: dict[str, int] = {}
        embedding, head = self.uses
        for key, factors in (
            ('a', (embedding.a, head.g)),
            ('g', (embedding.g, head.a)),
        ):
            parts = [f.memory_usage() for f in factors]
            usage[f'{key}_factors'] = sum(p['factor'] for p in parts)
            usage[f'{key}_batch'] = sum(p['batch'] for p in parts)
            usage[f'{key}_inverses'] = self.factor(key.upper()).memory_usage()[
                'decomposition'
            ]
        return usage

    def example_rows(
        self, call: Call, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of one call of either use, oriented as `V`.

        Each example's gradient sums both uses (in the embedding's
        orientation, `(d, V)`): `Σ_t g_{e,t} e_{k_t}ᵀ` from the embedding
        and `Σ_t h_t g_{h,t}ᵀ` from the head, so the head's input rows `h`
        are on the `G` side and its output gradients `g_h` on the `A` side.
        """
        if call.use == 0:
            embedding = self.module.embedding
            return (
                embedding.g_example_rows(call.grad_output, dtype, call.scale),
                embedding.a_example_rows(call.layer_input, dtype),
            )
        head = self.module.head
        return (
            head.a_example_rows(call.layer_input, dtype),
            head.g_example_rows(call.grad_output, dtype, call.scale),
        )


def make_statistics(
    helper: ModuleHelper,
    *,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    loss_average: str | None = 'batch',
) -> LayerStatistics:
    """The statistics of the layer of `helper`: one set per use for a tied
    weight ([`TiedStatistics`][kfac.layers.tied.TiedStatistics]), the
    plain ones otherwise.
    """
    tied = isinstance(helper, TiedHelper)
    kind = TiedStatistics if tied else LayerStatistics
    return kind(
        helper,
        factor_dtype=factor_dtype,
        inv_dtype=inv_dtype,
        loss_average=loss_average,
    )
