"""The decomposition phase of a step.

[`decompose`][kfac._engine.decompositions.decompose] decomposes the factors
each rank is the inverse worker of (one host synchronisation checks them
all; failures are retried by the layers) and broadcasts them where the
assignment says.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping

from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.distributed._exchange import broadcast_decompositions
from kfac.enums import FACTOR_NAMES
from kfac.layers.base import KFACBaseLayer
from kfac.layers.base import decompose_all
from kfac.tracing import Phase

__all__ = ['decompose']


def decompose(
    layers: Mapping[str, KFACBaseLayer],
    names: Iterable[str],
    plan: WorkAssignment,
    communicator: TorchDistributedCommunicator,
    damping: float,
    *,
    phase: Phase,
    log_once: Callable[..., None],
) -> list[str]:
    """Decompose the factors of `names` this rank is the inverse worker
    of, then broadcast them to the gradient workers where the plan says.

    Every rank calls it with the same `names`.

    Returns:
        The layers of `names` that have factors (those decomposed).
    """
    rank = get_rank()
    ready = [name for name in names if layers[name].has_factors]
    jobs = [
        (name, f)
        for name in ready
        for f in FACTOR_NAMES
        if plan.inv_worker(name, f) == rank
    ]
    with phase('decomposition'):
        failed = decompose_all([(layers[n], f) for n, f in jobs], damping)
    for index in failed:
        name = jobs[index][0]
        log_once(
            'decomposition',
            name,
            'K-FAC: decomposing a factor of %s failed in every attempt '
            '(float64, jitter); the last good decomposition is kept, and '
            'without one the gradient goes unpreconditioned (counters: '
            '%s)',
            name,
            dict(layers[name].counters),
        )
    if plan.broadcast_inverses():
        with phase('decomposition_broadcast'):
            broadcast_decompositions(
                communicator, plan, {name: layers[name] for name in ready}
            )
    return ready
