"""Finding the modules K-FAC can precondition.

[`KNOWN_MODULES`][kfac.layers.register.KNOWN_MODULES] maps supported module
types (subclasses included) to their
[`ModuleHelper`][kfac.layers.modules.ModuleHelper].
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import overload

import torch
from torch import nn

from kfac.layers._sharing import tie
from kfac.layers.attention import AttentionProjection
from kfac.layers.attention import AttentionProjectionHelper
from kfac.layers.attention import KFACMultiheadAttention
from kfac.layers.base import KFACBaseLayer
from kfac.layers.blocks import block_helpers
from kfac.layers.conv import ConvGroupHelper
from kfac.layers.conv import ConvModuleHelper
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.embedding import unsupported_reason
from kfac.layers.helper import ModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.options import ModuleOptions
from kfac.layers.options import check_module_options
from kfac.layers.options import check_pattern
from kfac.layers.options import resolve_options
from kfac.layers.options import selects
from kfac.layers.sampling import PositionSampler
from kfac.layers.sampling import SampleKey

KNOWN_MODULES: dict[type[nn.Module], type[ModuleHelper]] = {
    nn.Linear: LinearModuleHelper,
    nn.Conv1d: ConvModuleHelper,
    nn.Conv2d: ConvModuleHelper,
    nn.Conv3d: ConvModuleHelper,
    nn.Embedding: EmbeddingModuleHelper,
    AttentionProjection: AttentionProjectionHelper,
}
"""Supported module types and their helpers, most specific first."""

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def get_module_helper(module: nn.Module) -> ModuleHelper | None:
    """Return the helper for `module`, or None if it is not supported.

    A convolution with `groups > 1` has one helper per group
    ([`ConvGroupHelper`][kfac.layers.conv.ConvGroupHelper]), made by
    registration; here it gets None. So does an embedding with an
    option K-FAC does not support (see
    [`unsupported_reason`][kfac.layers.embedding.unsupported_reason]).
    """
    for module_type, helper_type in KNOWN_MODULES.items():
        if isinstance(module, module_type):
            if isinstance(module, _CONVOLUTIONS) and module.groups != 1:
                return None
            if isinstance(module, nn.Embedding) and unsupported_reason(module):
                return None
            return helper_type(module)
    return None


def compile_patterns(skip_layers: str | Iterable[str] | None) -> list[str]:
    """Validate `skip_layers`: None, a regex, or an iterable of regexes.

    Raises:
        TypeError: not a string or an iterable of strings.
        ValueError: a pattern is not a valid regular expression.

    """
    if skip_layers is None:
        return []
    patterns = [skip_layers] if isinstance(skip_layers, str) else skip_layers
    try:
        result = list(patterns)
    except TypeError:
        raise TypeError(
            'skip_layers must be None, a regular expression or an iterable '
            f'of them; got {skip_layers!r}',
        ) from None
    for pattern in result:
        if not isinstance(pattern, str):
            raise TypeError(
                f'skip_layers entries must be strings; got {pattern!r}',
            )
        check_pattern('skip_layers', pattern)
    return result


def any_match(query: str, patterns: Iterable[str]) -> bool:
    """Whether any regular expression of `patterns` is found in `query`
    (`re.search`), as the original's `skip_layers` test; registration
    also matches the class name (see
    [`selects`][kfac.layers.options.selects]).

    Examples:
        >>> any_match('block.fc1', ['^fc', 'fc1$'])
        True
    """
    return any(re.search(pattern, query) for pattern in patterns)


def get_flattened_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The leaves of `model` (modules without children) with their dotted
    names, in `model.named_modules()` order; registration itself visits
    every module
    ([`register_model`][kfac.layers.register.register_model]).
    """
    return [
        (name, module)
        for name, module in model.named_modules()
        if next(module.children(), None) is None
    ]


def requires_grad(module: nn.Module) -> bool:
    """Whether every parameter of `module` (its children's included)
    requires a gradient; registration asks this of the weight alone and
    reports a frozen one.
    """
    return all(param.requires_grad for param in module.parameters())


_SEPARATE_WEIGHTS = ('q_proj_weight', 'k_proj_weight', 'v_proj_weight')

_FUNCTIONAL = ((nn.MultiheadAttention, 'out_proj'),)
"""`(parent type, child name)` of modules whose parent uses their weight
without calling them, so their hooks never fire."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A module with trainable parameters that K-FAC leaves alone."""

    name: str
    """Its dotted name."""
    type: str
    """Its class name."""
    parameters: tuple[str, ...]
    """Its own parameters (not its children's)."""
    reason: str
    """Why it is not preconditioned."""


@dataclasses.dataclass(frozen=True)
class Registration:
    """What registration decided for every module of a model."""

    helpers: dict[str, ModuleHelper]
    """The modules preconditioned, by dotted name, in model order."""
    options: dict[str, ModuleOptions]
    """Their resolved options."""
    sources: dict[str, dict[str, str]]
    """Where each option of each module came from."""
    skipped: tuple[Skipped, ...]
    """Every other module that has parameters, with the reason."""
    aliases: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Per preconditioned module, the other modules sharing its weight in
    the same role: their calls count as its calls (one set of factors per
    parameter, keyed by the first module's name)."""
    blocks: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per layer that is one tile of a module whose factors exceed its
    `max_factor_dim` (see [`kfac.layers.blocks`][kfac.layers.blocks]), the
    module's name."""


def _functional_parent(
    modules: Mapping[str, nn.Module], name: str
) -> str | None:
    parent, _, child = name.rpartition('.')
    owner = modules.get(parent)
    if isinstance(owner, KFACMultiheadAttention):
        return None  # converted: calls out_proj as a module
    for parent_type, child_name in _FUNCTIONAL:
        if isinstance(owner, parent_type) and child == child_name:
            return type(owner).__name__
    return None


def _own_parameters(module: nn.Module) -> tuple[str, ...]:
    """The module's own parameters that no registered layer covers."""
    own = tuple(n for n, _ in module.named_parameters(recurse=False))
    if isinstance(module, KFACMultiheadAttention):
        # Its projections precondition these.
        covered = {'in_proj_weight', 'in_proj_bias', *_SEPARATE_WEIGHTS}
        return tuple(n for n in own if n not in covered)
    return own


def _reason(
    modules: Mapping[str, nn.Module],
    name: str,
    module: nn.Module,
    patterns: list[str],
) -> str | None:
    """Why `module` is not preconditioned (None: it is)."""
    if isinstance(module, KFACMultiheadAttention):
        return 'attention key/value biases (add_bias_kv): plain gradient'
    if not any(isinstance(module, kind) for kind in KNOWN_MODULES):
        return 'unsupported type (trained with the plain gradient)'
    if isinstance(module, nn.Embedding) and (
        embedding := unsupported_reason(module)
    ):
        return embedding
    parent = _functional_parent(modules, name)
    if parent is not None:
        return f'called functionally by its parent {parent}'
    matched = [p for p in patterns if selects(p, name, module)]
    if matched:
        return f'skipped by the skip_layers pattern {matched[0]!r}'
    helper = get_module_helper(module)
    weight = (
        getattr(module, 'weight', None) if helper is None else helper.weight
    )
    if not (isinstance(weight, nn.Parameter) and weight.requires_grad):
        return 'frozen at construction (weight.requires_grad is False)'
    return None


def register_model(
    model: nn.Module,
    *,
    skip_layers: str | Iterable[str] | None = None,
    defaults: ModuleOptions | None = None,
    module_options: object = None,
    sample_key: SampleKey | None = None,
) -> Registration:
    """Decide, once, which modules of `model` K-FAC preconditions.

    A module is preconditioned when its type is supported, its weight
    requires grad, no `skip_layers` pattern selects it and its parent does
    not use its weight without calling it (`nn.MultiheadAttention`'s
    `out_proj`). Modules sharing a weight or a bias in the same role
    (helpers of one type and gradient shape, the same weight and bias and
    equal [`call_settings`][kfac.layers.helper.ModuleHelper.call_settings];
    a grouped convolution group by group) are the first one's layers,
    whose calls are all the sharers' calls; an embedding and a bias-free
    Linear head sharing its weight are one layer (see
    [`kfac.layers.tied`][kfac.layers.tied]); any other sharing leaves
    every module involved to the optimizer. Every other module with
    parameters of its own is listed in
    [`Registration.skipped`][kfac.layers.register.Registration.skipped]
    with the reason.

    Args:
        model: the model (unwrap `DistributedDataParallel` first so names
            do not depend on the wrapper).
        skip_layers: regular expressions; a module is skipped when one
            matches (`re.search`) its dotted name or its class name.
        defaults: the model-wide per-module options.
        module_options: overrides `{pattern: {option: value}}` (see
            [`kfac.layers.options`][kfac.layers.options]).
        sample_key: where the helpers' position samplers read their seed,
            step and rank (`position_sample`; default: seed 0, step 0,
            rank 0).

    Raises:
        TypeError: `model` is not a `torch.nn.Module`, or an option has
            the wrong type.
        ValueError: an invalid pattern or an unknown option, or
            `position_sample` set by `module_options` for a module that
            cannot sample positions.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f'model must be a torch.nn.Module; got {type(model).__name__}',
        )
    patterns = compile_patterns(skip_layers)
    overrides = check_module_options(module_options)
    defaults = ModuleOptions() if defaults is None else defaults
    modules = dict(model.named_modules())
    helpers, options, sources, skipped = {}, {}, {}, []
    for name, module in modules.items():
        reason = _reason(modules, name, module, patterns)
        if reason is None:
            for key, helper in _helpers(name, module):
                options[key], sources[key] = resolve_options(
                    modules, name, defaults, overrides
                )
                if isinstance(helper, EmbeddingModuleHelper):
                    _embeddings_expand(options, sources, key)
                helper.batch_first = options[key].batch_first
                helper.kfac_approx = options[key].kfac_approx
                _attach_sampler(helper, key, options, sources, sample_key)
                helpers[key] = helper
            continue
        own = _own_parameters(module)
        if own:
            cls = type(module).__name__
            skipped.append(Skipped(name or '<root>', cls, own, reason))
    aliases, shared = tie(modules, helpers)
    for name, reason in shared:
        module = modules[name]
        own = _own_parameters(module)
        skipped.append(Skipped(name, type(module).__name__, own, reason))
    helpers, blocks = _split_large(helpers, options, sources, aliases)
    options = {n: options[n] for n in helpers}
    sources = {n: sources[n] for n in helpers}
    return Registration(
        helpers, options, sources, tuple(skipped), aliases, blocks
    )


def _split_large(
    helpers: dict[str, ModuleHelper],
    options: dict[str, ModuleOptions],
    sources: dict[str, dict[str, str]],
    aliases: dict[str, list[str]],
) -> tuple[dict[str, ModuleHelper], dict[str, str]]:
    """Replace each helper with a factor longer than its `max_factor_dim`
    by its tiles (in place for the options, sources and aliases), keeping
    model order.

    Returns:
        The helpers, and `{tile: module name}`.
    """
    result: dict[str, ModuleHelper] = {}
    blocks: dict[str, str] = {}
    for name, helper in helpers.items():
        tiles = block_helpers(name, helper, options[name].max_factor_dim)
        if len(tiles) == 1:
            result[name] = helper
            continue
        for key, tile in tiles:
            result[key], blocks[key] = tile, name
            options[key], sources[key] = options[name], sources[name]
            if name in aliases:
                aliases[key] = aliases[name]
        aliases.pop(name, None)
    return result, blocks


def _helpers(name: str, module: nn.Module) -> list[tuple[str, ModuleHelper]]:
    """The layers of a supported module: one, or one per group of a grouped
    convolution (`<name>.group<j>`).
    """
    if isinstance(module, _CONVOLUTIONS) and module.groups != 1:
        return [
            (f'{name}.group{j}', ConvGroupHelper(module, j))
            for j in range(module.groups)
        ]
    helper = get_module_helper(module)
    assert helper is not None  # _reason checked the type
    return [(name, helper)]


def _embeddings_expand(
    options: dict[str, ModuleOptions],
    sources: dict[str, dict[str, str]],
    name: str,
) -> None:
    """A model-wide `kfac_approx='reduce'` leaves embeddings at expand
    (their diagonal `A` has no reduced form); asked for by
    `module_options`, it is an error (raised by the helper).
    """
    if (
        options[name].kfac_approx == 'reduce'
        and sources[name]['kfac_approx'] == 'model'
    ):
        options[name] = dataclasses.replace(
            options[name], kfac_approx='expand'
        )
        sources[name]['kfac_approx'] = 'model (embeddings: expand only)'


def _attach_sampler(
    helper: ModuleHelper,
    name: str,
    options: dict[str, ModuleOptions],
    sources: dict[str, dict[str, str]],
    key: SampleKey | None,
) -> None:
    """Give `helper` its `position_sample` sampler. A module that cannot
    sample (an embedding, or `kfac_approx='reduce'`) is left unsampled
    under a model-wide value, and refused when `module_options` asks.
    """
    option = options[name].position_sample
    if option is None:
        return
    reason = None
    if not helper.samples_positions:
        reason = f'{type(helper).__name__} has no sampled form'
    elif helper.kfac_approx != 'expand':
        reason = "it needs kfac_approx='expand'"
    if reason is None:
        helper.sampler = PositionSampler(option, key or SampleKey())
    elif sources[name]['position_sample'] == 'model':
        options[name] = dataclasses.replace(
            options[name], position_sample=None
        )
        sources[name]['position_sample'] = f'model (not sampled: {reason})'
    else:
        raise ValueError(
            f'position_sample={option!r} selects {name}, which cannot form '
            f'its statistics on sampled positions: {reason}; set it to '
            'None for this module in module_options',
        )


_ENGINE_KEYWORDS = {
    'allreduce_method': 'KFACPreconditioner(allreduce_bucket_cap_mb=...)',
    'grad_scaler': 'KFACPreconditioner(grad_scaler=...)',
    'symmetry_aware': 'KFACPreconditioner(symmetry_aware=...)',
    'tdc': 'BaseKFACPreconditioner(communicator=...)',
}
"""The original's keywords of `register_modules` that a layer no longer
uses, and where each goes now."""

_L = TypeVar('_L', bound=KFACBaseLayer)


@overload
def register_modules(
    model: nn.Module,
    kfac_layer_type: None = None,
    *,
    skip_layers: str | Iterable[str] | None = None,
) -> dict[str, ModuleHelper]: ...


@overload
def register_modules(
    model: nn.Module,
    kfac_layer_type: type[_L],
    *,
    skip_layers: str | Iterable[str] | None = None,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    **engine: object,
) -> dict[nn.Module, tuple[str, _L]]: ...


def register_modules(
    model: nn.Module,
    kfac_layer_type: type[KFACBaseLayer] | None = None,
    *,
    skip_layers: str | Iterable[str] | None = None,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    **engine: object,
) -> dict[Any, Any]:  # one of the overloads' types
    """Find the modules of `model` that K-FAC preconditions.

    The helpers of [`register_model`][kfac.layers.register.register_model]
    with the default options, or, as in the original, a layer of
    `kfac_layer_type` for each.

    Args:
        model: the model.
        kfac_layer_type: the original's form: a subclass of
            [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] (e.g.
            `KFACEigenLayer`), made as `kfac_layer_type(helper,
            factor_dtype=..., inv_dtype=...)` for each module.
        skip_layers: see `register_model`.
        factor_dtype: with `kfac_layer_type`: the layers' factor dtype.
        inv_dtype: with `kfac_layer_type`: the layers' decomposition dtype.
        **engine: with `kfac_layer_type`, the original's keywords that a
            layer no longer uses (`allreduce_method`, `grad_scaler`,
            `symmetry_aware`, `tdc`): each emits a `DeprecationWarning`
            naming where it goes now, and has no effect here.

    Returns:
        `{dotted name: helper}` in `model.named_modules()` order; with
        `kfac_layer_type`, `{module: (dotted name, layer)}`.

    Raises:
        TypeError: `kfac_layer_type` is not a `KFACBaseLayer` subclass, a
            keyword is unknown, or a layer keyword is given without it.
        ValueError: with `kfac_layer_type`, a module is preconditioned as
            several layers (a grouped convolution, a tiled factor).
    """
    helpers = register_model(model, skip_layers=skip_layers).helpers
    if unknown := sorted(set(engine) - set(_ENGINE_KEYWORDS)):
        raise TypeError(
            f'register_modules() got unknown keywords {unknown}; the '
            f"original's were {sorted(_ENGINE_KEYWORDS)}, factor_dtype and "
            'inv_dtype'
        )
    if kfac_layer_type is None:
        if engine or factor_dtype is not None or inv_dtype is not None:
            raise TypeError(
                'register_modules(): factor_dtype, inv_dtype and '
                f'{sorted(_ENGINE_KEYWORDS)} need kfac_layer_type'
            )
        return helpers
    if not (
        isinstance(kfac_layer_type, type)
        and issubclass(kfac_layer_type, KFACBaseLayer)
    ):
        raise TypeError(
            'kfac_layer_type must be a subclass of KFACBaseLayer; got '
            f'{kfac_layer_type!r}'
        )
    for keyword in engine:
        warnings.warn(
            f'register_modules({keyword}=...) has no effect: layers no '
            f'longer communicate or unscale; give it to '
            f'{_ENGINE_KEYWORDS[keyword]} instead',
            DeprecationWarning,
            stacklevel=2,
        )
    return _original_layers(helpers, kfac_layer_type, factor_dtype, inv_dtype)


def _original_layers(
    helpers: Mapping[str, ModuleHelper],
    layer_type: type[KFACBaseLayer],
    factor_dtype: torch.dtype | None,
    inv_dtype: torch.dtype | None,
) -> dict[nn.Module, tuple[str, KFACBaseLayer]]:
    layers: dict[nn.Module, tuple[str, KFACBaseLayer]] = {}
    for name, helper in helpers.items():
        if helper.module in layers:
            raise ValueError(
                f'{layers[helper.module][0]!r} is preconditioned as several '
                f'layers ({name!r} too), which the original form '
                '{module: (name, layer)} cannot hold; call '
                'register_modules(model) for {name: helper}'
            )
        layer = layer_type(
            helper, factor_dtype=factor_dtype, inv_dtype=inv_dtype
        )
        layers[helper.module] = (name, layer)
    return layers
