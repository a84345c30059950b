"""Per-module options: one model-wide value, overrides by name or type.

Every per-module option (`batch_first`, `kfac_approx`, `max_factor_dim`,
`position_sample`, `compute_method`) has a model-wide value (the
preconditioner's `statistics=` group, and its `compute_method`).
`module_options` overrides it for the modules it selects:
`{pattern: {option: value}}`, where a pattern is a regular expression
searched (`re.search`) in a module's dotted name and in its class name,
as `skip_layers` patterns are. Options are resolved once, at registration,
in this order (the first that applies wins):

1. the last `module_options` pattern that selects the module and sets the
   option;
2. for `batch_first`: the `batch_first` attribute of the nearest enclosing
   `nn.MultiheadAttention`, `nn.TransformerEncoderLayer`,
   `nn.TransformerDecoderLayer` or `nn.Transformer` (the layout its
   submodules see);
3. the model-wide value.

The registration report shows each layer's options and where each came
from.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from kfac.enums import KFACApprox
from kfac.enums import parse_enum
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.sampling import check_position_sample
from kfac.validation import check_bool
from kfac.validation import type_error
from kfac.validation import validate_int

DEFAULT_MAX_FACTOR_DIM = 8192
"""Default `max_factor_dim`: every factor of ResNet-50 (largest side 4608)
and BERT-Large (4097) stays whole; a 50k-token vocabulary's is split."""

_LAYOUT_OWNERS = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.Transformer,
)


@dataclasses.dataclass(frozen=True)
class ModuleOptions:
    """The options of one module (or their model-wide values)."""

    batch_first: bool = True
    """Inputs are `(N, ..., features)`; False: `(T, N, ..., features)`
    (the sequence-first layout of `nn.MultiheadAttention` and
    `nn.Transformer*` by default). The number of examples `N` is read from
    the layout. A 2-D input is `(N, features)` either way."""

    kfac_approx: KFACApprox | str = KFACApprox.EXPAND
    """How weight-sharing positions (sequence positions of a Linear,
    output positions of a convolution) enter the factors: `'expand'`
    treats each position as a further example, `'reduce'` averages the
    inputs and sums the output gradients over an example's positions first
    (Eschenhagen et al., NeurIPS 2023; see [`kfac.math`][kfac.math])."""

    max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM
    """The largest side of a dense factor kept whole; a longer one is
    split into the fewest near-equal diagonal blocks of at most this side
    (see [`kfac.layers.blocks`][kfac.layers.blocks]). None: no limit. A
    diagonal factor (an embedding's `A`) is never split."""

    position_sample: int | float | None = None
    """Form `A` and `G` from a sample of each example's weight-sharing
    positions: an int `k` (that many positions, all if fewer) or a float
    `f` in `(0, 1]` (`⌈f T⌉` of the `T` positions); None: every position.
    Unbiased for the *expand* factors; Linear layers and convolutions
    under `kfac_approx='expand'` only (see
    [`kfac.layers.sampling`][kfac.layers.sampling])."""

    compute_method: CurvatureConfig | None = None
    """This module's method with its options (for instance
    `EigenConfig(factor_rank=32)` for a wide layer); None: the model-wide
    `compute_method`."""

    def __post_init__(self) -> None:
        check_bool('batch_first', self.batch_first)
        approx = parse_enum(KFACApprox, self.kfac_approx, 'kfac_approx')
        object.__setattr__(self, 'kfac_approx', approx)
        if self.max_factor_dim is not None:
            validate_int('max_factor_dim', self.max_factor_dim)
        check_position_sample(self.position_sample)
        if self.compute_method is not None and not isinstance(
            self.compute_method, CurvatureConfig
        ):
            raise type_error(
                'compute_method',
                self.compute_method,
                'None or a CurvatureConfig (e.g. kfac.EigenConfig(...))',
            )


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(ModuleOptions))
"""The per-module options."""

Overrides = tuple[tuple[str, Mapping[str, Any]], ...]
"""Validated `module_options`: `(pattern, {option: value})` in order."""


def check_module_options(value: object) -> Overrides:
    """Validate `module_options`: None or `{pattern: {option: value}}`.

    Raises:
        TypeError: not a mapping, a pattern that is not a string, options
            that are not a mapping, or an option value of the wrong type.
        ValueError: an invalid regular expression or an unknown option.
    """
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise type_error(
            'module_options', value, 'None or a mapping {pattern: options}'
        )
    checked = []
    for pattern, options in value.items():
        if not isinstance(pattern, str):
            raise type_error('module_options pattern', pattern, 'a str')
        check_pattern('module_options', pattern)
        if not isinstance(options, Mapping):
            raise type_error(
                f'module_options[{pattern!r}]',
                options,
                'a mapping {option: value}',
            )
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ValueError(
                f'module_options[{pattern!r}] has unknown options {unknown}; '
                f'allowed: {", ".join(OPTION_NAMES)}',
            )
        for option, setting in options.items():
            try:
                ModuleOptions(**{option: setting})  # checks the value
            except (TypeError, ValueError) as error:
                raise type(error)(
                    f'module_options[{pattern!r}]: {error}'
                ) from None
        checked.append((pattern, dict(options)))
    return tuple(checked)


def check_pattern(argument: str, pattern: str) -> None:
    """Raise `ValueError` unless `pattern` is a valid regular expression.

    Args:
        argument: the argument it belongs to, named in the message.
        pattern: the regular expression.
    """
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(
            f'{argument} pattern {pattern!r} is not a valid regular '
            f'expression: {err}',
        ) from None


def selects(pattern: str, name: str, module: nn.Module) -> bool:
    """Whether `pattern` selects a module: found (`re.search`) in its
    dotted name or in its class name (`skip_layers` and `module_options`
    alike).
    """
    return bool(
        re.search(pattern, name) or re.search(pattern, type(module).__name__)
    )


def _inherited_layout(
    modules: Mapping[str, nn.Module], name: str
) -> tuple[bool, str] | None:
    """`batch_first` of the nearest layout-owning ancestor, and its name."""
    parts = name.split('.')
    for depth in range(len(parts) - 1, -1, -1):
        ancestor = '.'.join(parts[:depth])
        owner = modules.get(ancestor)
        if not isinstance(owner, _LAYOUT_OWNERS):
            continue
        # Transformer*Layer keep the layout in their attention module.
        holder = getattr(owner, 'self_attn', owner)
        return bool(
            holder.batch_first
        ), f'inherited from {ancestor or "<root>"}'
    return None


def resolve_options(
    modules: Mapping[str, nn.Module],
    name: str,
    defaults: ModuleOptions,
    overrides: Overrides,
) -> tuple[ModuleOptions, dict[str, str]]:
    """The options of module `name` and where each came from.

    Args:
        modules: the model's `named_modules()` as a mapping.
        name: the module's dotted name.
        defaults: the model-wide values.
        overrides: validated `module_options`.

    Returns:
        The options, and `{option: source}` with source `'model'`,
        `'inherited from <ancestor>'` or `'module_options[<pattern>]'`.
    """
    module = modules[name]
    values = {
        f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)
    }
    sources = dict.fromkeys(values, 'model')
    inherited = _inherited_layout(modules, name)
    if inherited is not None:
        values['batch_first'], sources['batch_first'] = inherited
    for pattern, options in overrides:
        if selects(pattern, name, module):
            for option, setting in options.items():
                values[option] = setting
                sources[option] = f'module_options[{pattern!r}]'
    return ModuleOptions(**values), sources
