"""The distributed oracle: W ranks with N/W examples each equal one process.

For every world size 1-4, every valid KAISA strategy, both compute methods,
bucketing on and off and symmetry-aware packing on and off (their whole
product at W = 2, a pairwise covering of it at the others; and EKFAC under
each strategy, see ``ekfac_configuration``, and ``position_sample``, whose
draws are keyed to the global example index), a few DDP
training steps must give parameters equal on all ranks and equal to one
process trained on the whole batch (float64, relative difference < 1e-9).
One launch per world size loops over all configurations; the single-process
reference runs in the parent, where ``torch.distributed`` is not
initialised.

On the CPU the ranks join a gloo group. With ``KFAC_TEST_DEVICE=cuda``
(``make gpu-check``) they join an NCCL group, rank ``r`` on ``cuda:r``, and
the reference runs on the parent's CUDA device; NCCL takes one GPU per
rank, so the world sizes above the number of GPUs are skipped.
"""

from __future__ import annotations

import functools
import itertools
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.enums import DistributedStrategy
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.layers.curvature import method_config
from kfac.placement import valid_grad_worker_fractions
from kfac.preconditioner import KFACPreconditioner
from testing import oracle
from testing.models import PooledCNN
from testing.models import TinyCNN
from testing.models import classification_data

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 3
STRATEGIES = {
    'comm_opt': DistributedStrategy.COMM_OPT,
    'hybrid_opt': DistributedStrategy.HYBRID_OPT,
    'mem_opt': DistributedStrategy.MEM_OPT,
}


PAIRWISE = (
    ('comm_opt', 'eigen', 25.0, False),
    ('comm_opt', 'inverse', 0.0, True),
    ('hybrid_opt', 'eigen', 0.0, False),
    ('hybrid_opt', 'inverse', 25.0, True),
    ('mem_opt', 'eigen', 25.0, True),
    ('mem_opt', 'inverse', 0.0, False),
)
"""Strategy, method, bucket cap and symmetry-aware packing: every pair of
values of two of them appears in some row (a covering array, a quarter of
the product)."""


def configurations(world_size: int) -> list[dict[str, Any]]:
    """Every valid strategy x method x bucketing x symmetry-aware packing
    at W = 2; at the other world sizes, rows of `PAIRWISE`.
    """
    fractions = valid_grad_worker_fractions(world_size)
    configs = []
    product = itertools.product(
        STRATEGIES,
        ('eigen', 'inverse'),
        (25.0, 0.0),
        (False, True),
    )
    for strategy, method, cap, symmetric in (
        product if world_size == 2 else PAIRWISE
    ):
        if (
            strategy == 'hybrid_opt'
            and world_size > 1
            and 0.5 not in fractions
        ):
            continue  # HYBRID-OPT needs an even world size
        configs.append(
            {
                'grad_worker_fraction': strategy,
                'compute_method': method,
                'allreduce_bucket_cap_mb': cap,
                'symmetry_aware': symmetric,
                # exercise intervals and non-colocated inverses too
                'factor_update_steps': 1,
                'inv_update_steps': 2,
                'colocate_factors': method == 'eigen',
                'damping': 0.01,
                'kl_clip': 0.01,
                'lr': 0.1,
            },
        )
    # The clip that keeps the learning rate's meaning, with the learning
    # rate read from the optimizer (norms summed over what ranks hold).
    for strategy in STRATEGIES:
        if (
            strategy == 'hybrid_opt'
            and world_size > 1
            and 0.5 not in fractions
        ):
            continue
        configs.append(
            {
                'grad_worker_fraction': strategy,
                'inv_update_steps': 2,
                'damping': 0.01,
                'kl_clip': None,
                'relative_clip': 0.5,
                'optimizer': True,
            },
        )
    for strategy in STRATEGIES:
        even = world_size == 1 or 0.5 in fractions
        if strategy == 'hybrid_opt' and not even:
            continue
        configs.append(ekfac_configuration(strategy))
    warm = {**ekfac_configuration('mem_opt'), 'basis_refresh': 'qr'}
    configs.append({**warm, 'compute_method': 'eigen'})
    # EIGEN_ADAM (its second moments on the gradient workers) and ONE_SIDED
    # (the input factor alone), K-FAC's factors.
    for strategy, method in (
        ('comm_opt', 'eigen_adam'),
        ('mem_opt', 'eigen_adam'),
        ('mem_opt', 'one_sided'),
    ):
        configs.append(
            {
                'grad_worker_fraction': strategy,
                'compute_method': method,
                'inv_update_steps': 2,
                'damping': 0.01,
                'kl_clip': 0.01,
                'lr': 0.1,
            },
        )
    # The Monte Carlo Fisher: targets sampled by global example index, so
    # the ranks' samples are the single process's; and across a checkpoint
    # loaded into a fresh preconditioner (another seed given, the saved one
    # restored).
    mc = {
        'grad_worker_fraction': 'mem_opt',
        'fisher_type': 'mc',
        'mc_samples': 2,
        'mc_seed': 17,
        'inv_update_steps': 2,
        'damping': 0.01,
        'kl_clip': 0.01,
        'lr': 0.1,
    }
    configs += [mc, {**mc, 'resume': True}]
    if world_size == 2:
        configs += cost_configurations()
    # Sampled positions (keyed to the global example index), both captures.
    for sample, in_hook in ((0.5, True), (3, False)):
        configs.append(
            {
                'grad_worker_fraction': 'comm_opt',
                'position_sample': sample,
                'position_sample_seed': 77,
                'update_factors_in_hook': in_hook,
                'damping': 0.01,
            },
        )
    return configs


def cost_configurations() -> list[dict[str, Any]]:
    """`factor_rank` (decompositions broadcast under COMM-OPT, gradients
    under MEM-OPT) and `damping_mode='relative'`, at W=2 only.
    """
    base = {'damping': 0.01, 'kl_clip': 0.01, 'lr': 0.1, 'inv_update_steps': 2}
    return [
        {
            **base,
            'grad_worker_fraction': 'comm_opt',
            'factor_rank': 3,
            'basis_refresh': 'qr',
            'damping_mode': 'relative',
        },
        {
            **base,
            'grad_worker_fraction': 'mem_opt',
            'compute_method': 'inverse',
            'factor_rank': 2,
            'symmetry_aware': True,
        },
        {
            **base,
            'grad_worker_fraction': 'comm_opt',
            'damping_mode': 'relative',
        },
        {
            **base,
            'grad_worker_fraction': 'mem_opt',
            'compute_method': 'inverse',
            'damping_mode': 'relative',
        },
    ]


def ekfac_configuration(strategy: str) -> dict[str, Any]:
    """EKFAC under `strategy` (its bases on every rank, `S` averaged over
    all): COMM-OPT with a decomposition on a step without a factor update
    (the eigenvalues stand in for `S`), MEM-OPT unbucketed with `S + λ`
    formed each step, HYBRID-OPT with warm-started bases. These train
    `PooledCNN`, whose factors have full rank (see `train`).
    """
    return {
        'grad_worker_fraction': strategy,
        'compute_method': 'ekfac',
        'allreduce_bucket_cap_mb': 0.0 if strategy == 'mem_opt' else 25.0,
        'compute_eigenvalue_outer_product': strategy != 'mem_opt',
        'basis_refresh': 'qr' if strategy == 'hybrid_opt' else 'eigh',
        'factor_update_steps': 2 if strategy == 'comm_opt' else 1,
        'inv_update_steps': 1 if strategy == 'comm_opt' else 2,
        'colocate_factors': strategy != 'mem_opt',
        'damping': 0.01,
        'kl_clip': 0.01,
        'lr': 0.1,
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(GLOBAL_BATCH, (2, 8, 8), seed=step)


def train(
    device_type: str, config: dict[str, Any], part: oracle.Part
) -> torch.Tensor:
    """TinyCNN (float64) trained on rows `part`; on `cuda:<rank>` with
    `device_type` cuda.
    """
    device = torch.device('cpu')
    if device_type == 'cuda':
        device = torch.device('cuda', part[0])
    torch.manual_seed(1234)
    # EKFAC, EIGEN_ADAM and warm-started bases depend on the eigenvectors
    # chosen inside a repeated eigenvalue (the null space of TinyCNN's
    # 49-wide head input factor, of rank 36 after three steps), which
    # follow rounding: one process and W ranks would choose differently.
    # PooledCNN's factors have full rank.
    special = config.get('compute_method') in ('ekfac', 'eigen_adam') or (
        'basis_refresh' in config or 'factor_rank' in config
    )
    model = (PooledCNN() if special else TinyCNN()).to(device, torch.float64)
    wrapped = oracle.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # the original's defaults (every step, the KL clip) unless set
    options = _keywords({**ORIGINAL_DEFAULTS, **config})
    if options.pop('optimizer', False):
        options['optimizer'] = optimizer
    resume = options.pop('resume', False)
    precon = KFACPreconditioner(wrapped, **options)
    train = functools.partial(
        oracle.train_steps,
        wrapped,
        optimizer=optimizer,
        batch=_batch,
        part=part,
        loss=oracle.sampled_loss(lambda: precon),
    )
    train(precon, steps=range(2 if resume else STEPS))
    if resume:
        state = precon.state_dict()
        precon.remove()
        fisher = options['fisher']
        precon = KFACPreconditioner(
            wrapped, **{**options, 'fisher': replace(fisher, mc_seed=0)}
        )
        precon.load_state_dict(state)
        train(precon, steps=range(2, STEPS))
    return oracle.flat_params(model)


_METHOD = ('basis_refresh', 'damping_mode', 'factor_rank')
_FISHER = ('fisher_type', 'mc_samples', 'mc_seed')
_STATISTICS = ('position_sample', 'position_sample_seed')


def _keywords(case: dict[str, Any]) -> dict[str, Any]:
    """The preconditioner's keywords of a case written flat: the method's
    options into its config (`method_config`), the Fisher's and the
    statistics' into their groups.
    """
    options = dict(case)
    method = {k: options.pop(k) for k in _METHOD if k in options}
    if method:
        name = options.pop('compute_method')
        prediv = options.pop('compute_eigenvalue_outer_product', True)
        if name != 'inverse':
            method['prediv_eigenvalues'] = prediv
        options['compute_method'] = method_config(name, **method)
    fisher = {k: options.pop(k) for k in _FISHER if k in options}
    options['fisher'] = FisherConfig(**fisher)
    statistics = {k: options.pop(k) for k in _STATISTICS if k in options}
    if statistics:
        options['statistics'] = StatisticsConfig(**statistics)
    return options


@pytest.mark.timeout(300)
@pytest.mark.parametrize('world_size', [1, 2, 3, 4])
def test_ddp_equals_single_process(
    world_size: int, tmp_path: pathlib.Path, device: torch.device
) -> None:
    backend = 'gloo'
    if device.type == 'cuda':
        backend = 'nccl'
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            pytest.skip(
                f'NCCL takes one GPU per rank: world size {world_size} '
                f'needs {world_size} GPUs, this machine has {gpus}'
            )
    configs = configurations(world_size)
    strategies = {config['grad_worker_fraction'] for config in configs}
    assert strategies == (
        {'comm_opt', 'mem_opt'}
        if world_size == 3
        else {'comm_opt', 'mem_opt', 'hybrid_opt'}
    )
    outcomes = oracle.run_oracle(
        functools.partial(train, device.type),
        configs,
        world_size,
        tmp_path=tmp_path,
        timeout=280,
        backend=backend,
    )
    label = f'DDP W={world_size} vs single process'
    if backend != 'gloo':
        label += f' [{backend}]'
    oracle.check_outcomes(
        outcomes,
        [label] * len(configs),
        rtol=1e-9,
        split=False,
        across_label='DDP ranks vs each other',
    )
