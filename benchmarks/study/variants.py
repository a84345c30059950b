"""The study's K-FAC configurations, by name.

`BASE_KFAC` is the starting point; each of `VARIANTS` changes one thing of
it; `defaults` sets nothing (the library's defaults); `defaults+X` is
variant `X` over the defaults set explicitly (`OVER_DEFAULTS`). The
command line (`python -m benchmarks.study --kfac NAME ...`) and the cost
per step (`python -m benchmarks.study.step_cost --kfac NAME ...`) take
these names.
"""

from __future__ import annotations

from typing import Any

from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.layers.curvature import method_config

BASE_KFAC: dict[str, Any] = {
    # (set: the library's default became INVERSE after the study began)
    'compute_method': 'eigen',
    'factor_update_steps': 10,
    'inv_update_steps': 100,
    'damping': 0.003,
    'relative_clip': 1.0,
}
"""K-FAC's starting point: EIGEN, updates every 10/100 steps, the relative
clip."""

VARIANTS: dict[str, dict[str, Any]] = {
    'kfac': {},
    'ekfac': {'compute_method': 'ekfac'},
    'damping0.03': {'damping': 0.03},
    'damping0.0003': {'damping': 0.0003},
    'updates5/50': {'factor_update_steps': 5, 'inv_update_steps': 50},
    'updates20/200': {'factor_update_steps': 20, 'inv_update_steps': 200},
    'kl0.001': {'kl_clip': 0.001, 'relative_clip': None},
    'noclip': {'relative_clip': None},
    'clip10': {'relative_clip': 10.0},
    'mc': {'fisher_type': 'mc'},
    # (the GPT's tied embedding and head keep whole factors, as when these
    # were measured: the low-rank form did not apply to a tied weight then)
    'rank64': {
        'factor_rank': 64,
        'module_options': {'embed|head': {'factor_rank': None}},
    },
    'rank32': {
        'factor_rank': 32,
        'module_options': {'embed|head': {'factor_rank': None}},
    },
    'rank16': {
        'factor_rank': 16,
        'module_options': {'embed|head': {'factor_rank': None}},
    },
    'blocks512': {'max_factor_dim': 512},
    'sample0.25': {'position_sample': 0.25},
    'sample0.5': {'position_sample': 0.5},
    'relative1': {'damping_mode': 'relative', 'damping': 1.0},
    'qr': {'basis_refresh': 'qr'},
    # (two changes: EKFAC's scaling over warm-started bases)
    'ekfac-qr': {'compute_method': 'ekfac', 'basis_refresh': 'qr'},
    # explicit inverses with factored damping: half the eigenbasis's
    # matrix products per step
    'inverse': {'compute_method': 'inverse'},
    # the GPT's blocks left to the optimizer: K-FAC on the tied embedding
    # and head only (with Muon: the part AdamW trains)
    'embedonly': {'skip_layers': [r'^blocks\.']},
    # the autoencoder's Linear layers are modules 1, 3, ..., 15 of its
    # Sequential: K-FAC on the first and last only (with Muon: the part
    # AdamW trains), or on the six between them only (Muon's)
    'outeronly': {'skip_layers': [r'^(3|5|7|9|11|13)$']},
    'inneronly': {'skip_layers': [r'^(1|15)$']},
    # Adam's second moments in the eigenbases of the gradient's own factors
    # (K-FAC's for the GPT's tied embedding and head, which the gradient's
    # own cannot serve), factors every step and bases every 10, no clip:
    # over SGD at Adam-scale learning rates
    **{
        f'eigen_adam{suffix}': {
            'compute_method': 'eigen_adam',
            'source': 'gradient',
            'factor_update_steps': 1,
            'inv_update_steps': 10,
            'relative_clip': None,
            'module_options': {'embed|head': {'source': 'kfac'}},
            **change,
        }
        for suffix, change in (
            ('', {}),
            ('-restart', {'on_refresh': 'restart'}),
            ('-clip', {'relative_clip': 1.0}),
            ('-bases20', {'inv_update_steps': 20}),
            ('-kfac', {'source': 'kfac', 'module_options': {}}),
        )
    },
    # the input factor's damped inverse alone, for Muon (Newton-Muon's
    # relative damping)
    'one_sided': {'compute_method': 'one_sided', 'damping': 0.01},
}
"""K-FAC variants: each changes one thing of `BASE_KFAC` (`ekfac-qr`
two)."""

TASK_VARIANTS = {
    'embedonly': 'gpt',
    'outeronly': 'autoencoder',
    'inneronly': 'autoencoder',
}
"""The variants that name one task's modules, and that task."""

DEFAULTS = 'defaults'
"""The variant that sets nothing: `KFACPreconditioner(model,
optimizer=optimizer)` with the library's defaults."""

OVER_DEFAULTS: dict[str, dict[str, Any]] = {
    f'{DEFAULTS}+{name}': {**BASE_KFAC, **VARIANTS['inverse'], **change}
    for name, change in VARIANTS.items()
    # (not `kfac` itself, the compute methods, nor what needs the
    # eigenbasis)
    if name != 'kfac' and not {'compute_method', 'basis_refresh'} & set(change)
}
"""The variants over the library's defaults (`BASE_KFAC` with INVERSE,
set explicitly): `defaults+rank64` is `rank64` under INVERSE."""


NAMES = sorted([*VARIANTS, DEFAULTS, *OVER_DEFAULTS])
"""Every name `settings` knows."""


def settings(name: str) -> dict[str, Any]:
    """The configuration `name` (of `NAMES`), described flat (see
    `keywords` for the preconditioner's keyword arguments).

    Raises:
        ValueError: `name` is not one of `NAMES`.
    """
    if name == DEFAULTS:
        return {}
    if name in OVER_DEFAULTS:
        return dict(OVER_DEFAULTS[name])
    if name in VARIANTS:
        return {**BASE_KFAC, **VARIANTS[name]}
    raise ValueError(f'K-FAC variant must be one of {NAMES}; got {name!r}')


_METHOD = (
    'basis_refresh',
    'damping_mode',
    'factor_rank',
    'source',
    'on_refresh',
    'side',
)
_GROUPS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    'statistics': (
        StatisticsConfig,
        ('kfac_approx', 'max_factor_dim', 'position_sample'),
    ),
    'fisher': (FisherConfig, ('fisher_type', 'mc_samples', 'mc_seed')),
}


def keywords(described: dict[str, Any]) -> dict[str, Any]:
    """The `KFACPreconditioner` keywords of a configuration as `settings`
    describes it (flat, as the results record it): the method's options
    into its config (`method_config`), a module's method options (say
    `factor_rank: None`, the method without the rank) into that module's
    method, the other options into their groups.
    """
    options = dict(described)
    method = {k: options.pop(k) for k in _METHOD if k in options}
    name = options.pop('compute_method', None)
    if method or name is not None:
        options['compute_method'] = method_config(name or 'inverse', **method)
    overrides = options.pop('module_options', None)
    if overrides:
        options['module_options'] = {
            pattern: {
                'compute_method': method_config(
                    name or 'inverse', **{**method, **per_module}
                )
            }
            for pattern, per_module in overrides.items()
        }
    for group, (kind, keys) in _GROUPS.items():
        given = {k: options.pop(k) for k in keys if k in options}
        if given:
            options[group] = kind(**given)
    return options


def refusal(task: str, name: str) -> str | None:
    """Why `name` cannot run on `task` (it names another task's modules),
    or None.
    """
    own = TASK_VARIANTS.get(name.removeprefix(f'{DEFAULTS}+'), task)
    if own == task:
        return None
    return f'--kfac {name}: names modules of task {own!r} only'
