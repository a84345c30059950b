"""Finding the modules K-FAC can precondition.

[`KNOWN_MODULES`][kfac.layers.register.KNOWN_MODULES] maps supported module
types (subclasses included) to their
[`ModuleHelper`][kfac.layers.modules.ModuleHelper].
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from collections.abc import Iterator

from torch import nn

from kfac.layers.modules import Conv2dModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.modules import ModuleHelper

logger = logging.getLogger(__name__)

KNOWN_MODULES: dict[type[nn.Module], type[ModuleHelper]] = {
    nn.Linear: LinearModuleHelper,
    nn.Conv2d: Conv2dModuleHelper,
}
"""Supported module types and their helpers, most specific first."""


def get_module_helper(module: nn.Module) -> ModuleHelper | None:
    """Return the helper for `module`, or None if it is not supported.

    A convolution with `groups > 1` is not supported: K-FAC would need one
    pair of factors per group. It is left to the optimizer unpreconditioned,
    and [`register_modules`][kfac.layers.register.register_modules] logs a
    warning naming it.
    """
    for module_type, helper_type in KNOWN_MODULES.items():
        if isinstance(module, module_type):
            if isinstance(module, nn.Conv2d) and module.groups != 1:
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
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f'skip_layers pattern {pattern!r} is not a valid regular '
                f'expression: {err}',
            ) from None
    return result


def _skipped(name: str, module: nn.Module, patterns: list[str]) -> bool:
    cls = type(module).__name__
    return any(re.search(p, name) or re.search(p, cls) for p in patterns)


def _trainable(module: nn.Module) -> bool:
    weight = getattr(module, 'weight', None)
    return isinstance(weight, nn.Parameter) and weight.requires_grad


def register_modules(
    model: nn.Module,
    *,
    skip_layers: str | Iterable[str] | None = None,
) -> dict[str, ModuleHelper]:
    """Find the modules of `model` that K-FAC preconditions.

    A module is kept when it is supported, its weight requires grad and no
    pattern skips it.

    Args:
        model: the model (unwrap `DistributedDataParallel` first so names
            do not depend on the wrapper).
        skip_layers: regular expressions; a module is skipped when one
            matches (`re.search`) its dotted name or its class name.

    Returns:
        `{dotted name: helper}`, in `model.named_modules()` order.

    Raises:
        TypeError: `model` is not a `torch.nn.Module`, or `skip_layers` is
            not a string or an iterable of strings.
        ValueError: a pattern is not a valid regular expression.

    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f'model must be a torch.nn.Module; got {type(model).__name__}',
        )
    patterns = compile_patterns(skip_layers)
    return dict(_iter_modules(model, patterns))


def _iter_modules(
    model: nn.Module,
    patterns: list[str],
) -> Iterator[tuple[str, ModuleHelper]]:
    for name, module in model.named_modules():
        if _skipped(name, module, patterns) or not _trainable(module):
            continue
        helper = get_module_helper(module)
        if helper is not None:
            yield name, helper
        elif isinstance(module, nn.Conv2d):
            logger.warning(
                'K-FAC leaves %s (%r) unpreconditioned: convolutions with '
                'groups > 1 are not supported',
                name or '<root>',
                module,
            )
