"""The preconditioning phase of a step: precondition, clip, write back.

[`precondition`][kfac._engine.preconditioning.precondition] preconditions
the layers on their gradient workers, clips every preconditioned gradient
by one scale `ν` (see [`kfac.math`][kfac.math]), and writes `.grad`,
holding and moving gradients as the engine's
[`GradientDistributor`][kfac._engine.distributor.GradientDistributor] says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kfac._engine.distributor import GradientDistributor
from kfac.hyperparams import HyperparameterValues
from kfac.layers.base import KFACBaseLayer
from kfac.layers.helper import Grads
from kfac.math import kl_clip_scale
from kfac.math import relative_clip_scale
from kfac.tracing import Clip
from kfac.tracing import ClipMonitor
from kfac.tracing import Phase

__all__ = ['precondition']


def precondition(
    distributor: GradientDistributor,
    active: list[str],
    values: HyperparameterValues,
    step: int,
    *,
    phase: Phase,
    log_once: Callable[..., None],
    monitor: ClipMonitor,
) -> None:
    """The preconditioning phase of a step: precondition the `active`
    layers on their gradient workers, clip, write `.grad`,
    holding and moving gradients as `distributor` says; `monitor` records the
    clip.

    A layer whose preconditioned gradient is not finite keeps its
    original gradient (counted, logged once); one host read. Every rank
    calls it with the same `active` layers.
    """
    layers = distributor.layers
    for part, grads in distributor.precondition(active):
        with phase('precondition'):
            for name in part:
                if distributor.assignment.is_grad_worker(name):
                    _precondition(name, layers[name], values, grads, log_once)
    with phase('kl_clip'):
        names, stats = distributor.statistics()
        flags, scale, clip = _clip(names, stats, values)
    if clip is not None:
        monitor.record(clip)
    ok = dict(zip(names, flags))
    for part, grads in distributor.write_back():
        with phase('write_back'):
            for name in part:
                layer = layers[name]
                if ok[name]:
                    layer.write_grad(scale, grads)
                    continue
                layer.discard_grad()
                log_once(
                    'nonfinite-grad',
                    name,
                    'K-FAC: the preconditioned gradient of %s is not '
                    'finite in step %d; its original gradient is left in '
                    'place',
                    name,
                    step,
                )


def _precondition(
    name: str,
    layer: KFACBaseLayer,
    values: HyperparameterValues,
    grads: Grads | None,
    log_once: Callable[..., None],
) -> None:
    layer.precondition_grad(values.damping, grads)
    if not layer.has_decomposition:
        log_once(
            'unpreconditioned',
            name,
            'K-FAC: module %s has no valid decomposition; its raw '
            'gradient is used this step',
            name,
        )


def _clip(
    names: list[str],
    stats: torch.Tensor | None,
    values: HyperparameterValues,
) -> tuple[list[bool], torch.Tensor | None, Clip | None]:
    """Per layer, whether its statistics are finite; the clip's scale
    `ν = min(ν_KL, ν_rel)` (None without a clip; see
    [`kfac.math`][kfac.math]); the step's
    [`Clip`][kfac.tracing.Clip]. One host read.
    """
    if stats is None:
        return [], None, None
    finite = torch.isfinite(stats).all(dim=1)
    kept = torch.where(finite[:, None], stats, torch.zeros_like(stats))
    vg, pre_sq, raw_sq = (column.contiguous() for column in kept.unbind(1))
    scale = kl = None
    if values.relative_clip is not None:
        scale = relative_clip_scale(
            raw_sq.sum(), pre_sq.sum(), values.relative_clip
        )
    if values.kl_clip is not None:
        if values.lrs is None:
            kl = kl_clip_scale(vg.sum(), values.lr, values.kl_clip)
        else:
            lrs = torch.tensor(
                [values.lrs[n] for n in names], dtype=vg.dtype
            ).to(vg.device)
            kl = kl_clip_scale((vg * lrs * lrs).sum(), 1.0, values.kl_clip)
        scale = kl if scale is None else torch.minimum(scale, kl)
    nu = torch.ones_like(vg[0]) if scale is None else scale
    ratio = nu * torch.sqrt(pre_sq.sum() / raw_sq.sum())
    tail = [nu[None], ratio[None]] + ([] if kl is None else [kl[None]])
    read = torch.cat([finite.to(vg.dtype), *tail]).tolist()
    count = len(names)
    flags = [bool(f) for f in read[:count]]
    kl_scale = None if kl is None else read[count + 2]
    return flags, scale, Clip(read[count], read[count + 1], kl_scale)
