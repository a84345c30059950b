"""A warm-started basis refresh against ``eigh``: accuracy and cost.

``python -m benchmarks.warm_start`` measures what ``basis_refresh='qr'``
(`kfac.math.subspace_iteration` from the previous basis) gives up against
a full ``eigh``, and what it saves:

* **accuracy**, on the real factors of the two workloads of
  `benchmarks.ekfac` (the Fashion-MNIST CNN and the small GPT), trained with
  EIGEN (``factor_update_steps=5``) for ``--steps`` steps and recorded with
  the raw gradients every 20 steps. For refresh intervals of 20 and 100
  steps the warm basis is chained from refresh to refresh as a run would
  (the first is ``eigh``'s) with 1, 2 or 4 QR steps, and compared with
  ``eigh`` of the same factor (in float64): the sine of the largest
  principal angle between the spans of the eigenvectors holding 90% of the
  trace, the relative error of ``Q diag(d) Qᵀ`` against the factor, and the
  relative error of EIGEN's preconditioned gradient (both factors warm,
  the workload's damping) against ``eigh``'s;
* **cost**, on the factor sides of ResNet-50 and BERT-Large
  (`benchmarks.shapes`, up to ``--max-side``): CPU seconds of ``eigh`` and
  of one and two QR steps in float32 on one thread, best of three, on a
  random positive semi-definite matrix.

One thread (``torch.set_num_threads(1)``); writes
``benchmarks/results/warm_start.json`` (``--out``); no test runs it.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.ekfac import WORKLOADS
from benchmarks.shapes import SCALING_MODELS
from kfac.layers.curvature.eigen import WARM_START_STEPS
from kfac.math import eigen_precondition
from kfac.math import eigenvalue_outer_product
from kfac.math import subspace_iteration
from kfac.preconditioner import KFACPreconditioner

__all__ = ['accuracy', 'cost', 'main']

F64 = torch.float64
Snapshot = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def snapshots(name: str, steps: int, every: int = 20) -> list[Snapshot]:
    """`{layer: (A, G, V)}` after every `every`-th step of an EIGEN run."""
    workload = WORKLOADS[name]()
    precon = KFACPreconditioner(
        workload.model,
        factor_update_steps=5,
        inv_update_steps=every,
        **workload.kfac,
    )
    found = []
    for step in range(steps):
        x, y = next(workload.batches)
        workload.optimizer.zero_grad(set_to_none=True)
        workload.loss(workload.model(x), y).backward()
        raw = {
            n: layer.module.get_grad() for n, layer in precon.layers.items()
        }
        precon.step()
        workload.optimizer.step()
        if workload.schedule is not None:
            workload.schedule.step()
        if step % every:
            continue
        snap: Snapshot = {}
        for n, layer in precon.layers.items():
            a, g, v = layer.factor('A').value, layer.factor('G').value, raw[n]
            if a is None or g is None or v is None or a.dim() == 1:
                continue  # a diagonal factor is its own eigenbasis
            snap[n] = (a.to(F64), g.to(F64), v.detach().to(F64))
        found.append(snap)
    precon.remove()
    return found


def _top_count(d: torch.Tensor, share: float) -> int:
    """How many of the largest eigenvalues hold `share` of the trace."""
    ordered = torch.sort(d, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / d.sum().clamp(min=1e-300)
    return int((cumulative < share).sum()) + 1


def _sine(
    warm: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    share: float = 0.9,
) -> float:
    """Sine of the largest principal angle between the spans of the `k`
    leading eigenvectors of each (`k`: those of `eigh` holding `share` of
    the trace), each ordered by its own eigenvalues.
    """
    k = _top_count(exact[1], share)
    x, y = (
        q[:, torch.argsort(d, descending=True)[:k]] for q, d in (warm, exact)
    )
    cosines = torch.linalg.svdvals(x.T @ y)
    return float((1 - cosines.min().clamp(max=1.0) ** 2).clamp(min=0).sqrt())


def _precondition(
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
    v: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    (qa, da), (qg, dg) = parts['A'], parts['G']
    scale = eigenvalue_outer_product(dg, da, damping)
    return eigen_precondition(v, qa, qg, scale)


def _chain(
    snaps: list[Snapshot], stride: int, steps: int, damping: float
) -> dict[str, list[float]]:
    """Warm bases chained over every `stride`-th snapshot."""
    metrics: dict[str, list[float]] = {'sine': [], 'factor': [], 'grad': []}
    chosen = snaps[::stride]
    previous: dict[tuple[str, str], torch.Tensor] = {}
    for index, snap in enumerate(chosen):
        for name, (a, g, v) in snap.items():
            warm, exact = {}, {}
            for key, f in (('A', a), ('G', g)):
                d_ref, q_ref = torch.linalg.eigh(f)
                exact[key] = (q_ref, d_ref.clamp(min=0))
                basis = previous.get((name, key))
                if index == 0 or basis is None:
                    warm[key] = exact[key]
                else:
                    warm[key] = subspace_iteration(f, basis, steps)
                    norm = float(f.norm())
                    q, d = warm[key]
                    err = float((q @ torch.diag(d) @ q.T - f).norm()) / norm
                    metrics['factor'].append(err)
                    metrics['sine'].append(_sine(warm[key], exact[key]))
                previous[(name, key)] = warm[key][0]
            if index:
                want = _precondition(exact, v, damping)
                got = _precondition(warm, v, damping)
                metrics['grad'].append(
                    float((got - want).norm() / want.norm())
                )
    return metrics


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        'median': statistics.median(values),
        'max': max(values),
        'count': len(values),
    }


def accuracy(names: Sequence[str], steps: int) -> dict[str, Any]:
    """The accuracy study (see the module docstring)."""
    result: dict[str, Any] = {}
    for name in names:
        damping = float(WORKLOADS[name]().kfac['damping'])
        snaps = snapshots(name, steps)
        for interval in (20, 100):
            for qr_steps in (1, 2, 4):
                metrics = _chain(snaps, interval // 20, qr_steps, damping)
                key = f'{name} inv={interval} qr_steps={qr_steps}'
                result[key] = {k: _summary(v) for k, v in metrics.items()}
                print(key, result[key], flush=True)
    return result


def _best(fn: Any, repeats: int = 3) -> float:
    """Least CPU seconds of `repeats` calls (one thread: the time other
    processes hold the core is not counted).
    """
    times = []
    for _ in range(repeats):
        began = time.process_time()
        fn()
        times.append(time.process_time() - began)
    return min(times)


def cost(max_side: int) -> dict[str, Any]:
    """Seconds of `eigh` and of 1 and 2 QR steps per factor side."""
    sides = sorted(
        {
            n
            for shapes in SCALING_MODELS.values()
            for layer in shapes()
            for n in (layer.a_dim, layer.g_dim)
            if n <= max_side
        }
    )
    result: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for n in sides:
        x = torch.randn(n, 2 * n, generator=generator)
        f = x @ x.T / (2 * n)
        _, basis = torch.linalg.eigh(f + 0.01 * torch.eye(n))
        row = {'eigh_s': _best(functools.partial(torch.linalg.eigh, f))}
        for steps in (1, 2):
            warm = functools.partial(subspace_iteration, f, basis, steps)
            row[f'qr{steps}_s'] = _best(warm)
        row['eigh_over_qr2'] = row['eigh_s'] / row['qr2_s']
        result[str(n)] = row
        print(n, row, flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both studies; write JSON."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.warm_start')
    parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS))
    parser.add_argument('--steps', type=int, default=401)
    parser.add_argument('--max-side', type=int, default=2304)
    parser.add_argument(
        '--out',
        type=pathlib.Path,
        default=pathlib.Path('benchmarks/results/warm_start.json'),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {
        'threads': torch.get_num_threads(),
        'warm_start_steps_default': WARM_START_STEPS,
        'cost': cost(args.max_side),
        'accuracy': accuracy(args.workloads, args.steps),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == '__main__':
    main()
