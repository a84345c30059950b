"""The registration report: what is preconditioned, and what is not.

Built once, when a
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] is
constructed, from the [`Registration`][kfac.layers.register.Registration]
and the layers; logged at `INFO` and returned by its `describe()`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

from kfac.layers.base import KFACBaseLayer
from kfac.layers.blocks import BlockHelper
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.register import Registration
from kfac.layers.tied import TiedHelper


def describe_method(config: CurvatureConfig) -> str:
    """`config` as the report shows it: the method's name and options,
    choices by their values (`eigen(basis_refresh='qr', ...)`).
    """
    fields = ', '.join(
        f'{field.name}={_plain(getattr(config, field.name))}'
        for field in dataclasses.fields(config)
    )
    return f'{config.name}({fields})'


def _plain(value: object) -> str:
    """`repr` of `value`, of a choice's value for an enum member."""
    return repr(value.value if isinstance(value, enum.Enum) else value)


def describe_registration(
    registration: Registration, layers: Mapping[str, KFACBaseLayer]
) -> dict[str, list[dict[str, Any]]]:
    """The report as data.

    Returns:
        `{'preconditioned': [...], 'not_preconditioned': [...]}`. A
            preconditioned entry has `name`, `type`, `A` and `G` (the
            running factors' shapes: `(n,)` for a diagonal factor, kept as
            its diagonal), `factor_bytes` (both running factors) and `options`
            (`{option: {'value': ..., 'source': ...}}`) and
            `shares_weight_with` (modules whose calls count as its own:
            they share its weight) and `block` (None, or for one tile of a
            module whose factors exceed `max_factor_dim`: `module`,
            `index`, `count`, and the tile's `rows` (`G`) and `cols` (`A`)
            of the module's gradient matrix as `[start, stop]`; see
            [`kfac.layers.blocks`][kfac.layers.blocks]) and `tied` (None,
            or for a weight tied in transposed roles: the `embedding` and
            `head` names and the combination `rule`; see
            [`kfac.layers.tied`][kfac.layers.tied]); the other entries
            have `name`, `type`, `parameters` (the module's own) and
            `reason`.
    """
    preconditioned = []
    for name, layer in layers.items():
        resolved = registration.options[name]
        options: dict[str, Any] = {
            field.name: getattr(resolved, field.name)
            for field in dataclasses.fields(resolved)
        }
        options['compute_method'] = describe_method(layer.method)
        sources = registration.sources[name]
        size = layer.factor_dtype.itemsize
        preconditioned.append(
            {
                'name': name,
                'type': type(layer.module.module).__name__,
                'A': layer.a.shape,
                'G': layer.g.shape,
                'factor_bytes': sum(
                    math.prod(f.shape) * size for f in layer.factors
                ),
                'options': {
                    key: {'value': value, 'source': sources[key]}
                    for key, value in options.items()
                },
                'shares_weight_with': list(registration.aliases.get(name, [])),
                'block': _block(registration, name, layer),
                'tied': _tied(layer),
            }
        )
    others = [
        {
            'name': skipped.name,
            'type': skipped.type,
            'parameters': list(skipped.parameters),
            'reason': skipped.reason,
        }
        for skipped in registration.skipped
    ]
    return {'preconditioned': preconditioned, 'not_preconditioned': others}


def _block(
    registration: Registration, name: str, layer: KFACBaseLayer
) -> dict[str, Any] | None:
    """The tile a layer is of its module, or None."""
    helper = layer.module
    if isinstance(helper, TiedHelper):
        helper = helper.embedding
    if not isinstance(helper, BlockHelper):
        return None
    return {
        'module': registration.blocks[name] or '<root>',
        'index': helper.index,
        'count': helper.count,
        'rows': [helper.rows.start, helper.rows.stop],
        'cols': [helper.cols.start, helper.cols.stop],
    }


TIED_RULE = (
    'one Kronecker product for the sum of both uses, A_e (x) G_e + G_h (x) '
    'A_h in the embedding orientation: A = sum_u m(Y_u) X_u / sqrt(C), '
    'G = sum_u m(X_u) Y_u / sqrt(C), m = mean eigenvalue, '
    'C = sum_u m(X_u) m(Y_u) (kfac.math.kronecker_sum_factors)'
)
"""How a weight tied in transposed roles is preconditioned, as reported."""


def _tied(layer: KFACBaseLayer) -> dict[str, Any] | None:
    """The uses of a weight tied in transposed roles, or None."""
    helper = layer.module
    if not isinstance(helper, TiedHelper):
        return None
    embedding, head = helper.names
    return {'embedding': embedding, 'head': head, 'rule': TIED_RULE}


def format_report(report: Mapping[str, list[dict[str, Any]]]) -> str:
    """The report as text, one line per module."""
    done, others = report['preconditioned'], report['not_preconditioned']
    total = sum(entry['factor_bytes'] for entry in done)
    lines = [
        f'K-FAC preconditions {len(done)} modules (running factors '
        f'{total / 2**20:.1f} MiB):'
    ]
    for entry in done:
        options = ', '.join(
            f'{key}={setting["value"]} ({setting["source"]})'
            for key, setting in entry['options'].items()
        )
        block = entry['block']
        if block is not None:
            options = (
                f'tile {block["index"] + 1} of {block["count"]} of '
                f'{block["module"]} (block-diagonal factors: rows '
                f'{_span(block["rows"])}, columns {_span(block["cols"])}); '
                + options
            )
        tied = entry['tied']
        if tied is not None:
            options = (
                f'weight tied: embedding {tied["embedding"]} and head '
                f'{tied["head"]} (transposed), {tied["rule"]}; ' + options
            )
        shared = entry['shares_weight_with']
        if shared and tied is None:
            options += f'; weight shared with {", ".join(shared)}'
        lines.append(
            f'  {entry["name"]} ({entry["type"]}): A {_shape(entry["A"])}, '
            f'G {_shape(entry["G"])}; {options}'
        )
    lines.append(
        f'and leaves {len(others)} modules with parameters to the optimizer:'
    )
    for entry in others:
        lines.append(
            f'  {entry["name"]} ({entry["type"]}; '
            f'{", ".join(entry["parameters"])}): {entry["reason"]}'
        )
    return '\n'.join(lines)


def _span(span: list[int]) -> str:
    return f'{span[0]}:{span[1]}'


def _shape(shape: tuple[int, ...]) -> str:
    """`'9x9'`, or `'diag(50000)'` for a diagonal factor."""
    if len(shape) == 1:
        return f'diag({shape[0]})'
    return 'x'.join(map(str, shape))
