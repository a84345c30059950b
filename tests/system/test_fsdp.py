"""The FSDP2 oracle: K-FAC on a `fully_shard` model equals one process.

For world sizes 2, 3 and 4 (3 and 4 leave uneven shards: 13 vocabulary
rows, 7 hidden units, 24 packed attention rows over 3 or 4 ranks), each
rank trains [`testing.fsdp.ShardLM`][testing.fsdp.ShardLM], sharded with
`fully_shard` per block and at the root, on its `12 / W` sequences; its
whole parameters after three steps (factor updates every step,
decompositions at steps 0 and 2) must equal those of one process trained
on all 12 without sharding to 1e-10 relative, in float64, for COMM-OPT
and MEM-OPT, eigen and inverse, and MEM-OPT EKFAC with warm-started bases.
At W = 4 also: a hybrid fraction, no resharding after forward, and HSDP
on a 2 x 2 mesh (replicate x shard, EKFAC among its configurations),
whose replicas must hold bitwise-equal shards. At W = 2, a bfloat16
mixed-precision policy (parameters and gradient reduction in bfloat16)
trains within bfloat16 rounding of the float64 run.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from kfac.config import ShardingConfig
from kfac.layers.curvature import EigenAdamConfig
from kfac.layers.curvature import EKFACConfig
from kfac.preconditioner import KFACPreconditioner
from testing import fsdp
from testing import oracle
from testing.asserts import relative_error
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU
from testing.torch_release import HSDP_ON_CPU

CONFIGS: dict[str, dict[str, Any]] = {
    'comm_opt-eigen': {'grad_worker_fraction': 'comm_opt'},
    'comm_opt-inverse': {
        'grad_worker_fraction': 'comm_opt',
        'compute_method': 'inverse',
    },
    'mem_opt-eigen': {
        'grad_worker_fraction': 'mem_opt',
        'statistics': fsdp.statistics(kfac_approx='reduce'),
        'allreduce_bucket_cap_mb': 0.0,
    },
    'mem_opt-inverse': {
        'grad_worker_fraction': 'mem_opt',
        'compute_method': 'inverse',
    },
    'hybrid-eigen': {
        'grad_worker_fraction': 'hybrid_opt',
        'compute_eigenvalue_outer_product': False,
    },
    'mem_opt-ekfac': {
        'grad_worker_fraction': 'mem_opt',
        'compute_method': EKFACConfig(basis_refresh='qr'),
    },
    'comm_opt-ekfac': {'compute_method': 'ekfac'},
    'mem_opt-eigen_adam': {
        'grad_worker_fraction': 'mem_opt',
        'compute_method': EigenAdamConfig(beta2=0.9, eps=1e-6),
    },
}

# (label, config, mesh shape or None for 1-D, fully_shard keywords)
Case = tuple[str, str, tuple[int, ...] | None, dict[str, Any]]
BASIC: list[Case] = [
    (name, name, None, {})
    for name in (
        'comm_opt-eigen',
        'comm_opt-inverse',
        'mem_opt-eigen',
        'mem_opt-inverse',
        'mem_opt-ekfac',
        'mem_opt-eigen_adam',
    )
]
EXTRA: list[Case] = [
    ('hybrid-eigen', 'hybrid-eigen', None, {}),
    (
        'mem_opt-eigen no reshard',
        'mem_opt-eigen',
        None,
        {'reshard_after_forward': False},
    ),
    ('HSDP 2x2 comm_opt-eigen', 'comm_opt-eigen', (2, 2), {}),
    ('HSDP 2x2 mem_opt-inverse', 'mem_opt-inverse', (2, 2), {}),
    ('HSDP 2x2 comm_opt-ekfac', 'comm_opt-ekfac', (2, 2), {}),
]


MIXED: list[Case] = [
    (
        'bf16 mixed precision',
        'comm_opt-eigen',
        None,
        {
            'mp_policy': MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
            )
        },
    ),
]
BF16_TOLERANCE = 5e-2
"""bfloat16 keeps 8 bits of mantissa: ~4e-3 per rounding."""


CASES: dict[str, Case] = {case[0]: case for case in BASIC + EXTRA + MIXED}


def _cases(world: int) -> list[Case]:
    return BASIC + (EXTRA if world == 4 else MIXED if world == 2 else [])


def _train_sharded(label: str, part: oracle.Part) -> oracle.Trained:
    """Case `label` sharded and trained on rows `part`; whether the
    replicas of an HSDP mesh agree and the bytes K-FAC gathered.
    """
    from torch.distributed.device_mesh import init_device_mesh

    _, config, shape, keywords = CASES[label]
    model = fsdp.fresh()
    mesh = None
    if shape is not None:
        mesh = init_device_mesh(
            'cpu', shape, mesh_dim_names=('replicate', 'shard')
        )
        keywords = {**keywords, 'mesh': mesh}
    fsdp.shard(model, **keywords)
    precon = fsdp.train(model, CONFIGS[config], part=part)
    assert precon is not None
    replicas = True
    if mesh is not None:
        replicas = fsdp.replicas_equal(model, mesh.get_group('replicate'))
    facts = {
        'replicas': replicas,
        'gathered': precon.communicator.bytes_communicated['allgather'],
    }
    return oracle.Trained(fsdp.whole_params(model), facts)


@FSDP2_ON_CPU
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    'world_size', [2, 3, pytest.param(4, marks=HSDP_ON_CPU)]
)
def test_fully_shard_equals_one_process(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    expected = {}
    for name, config in CONFIGS.items():
        model = fsdp.fresh()
        fsdp.train(model, config)
        expected[name] = fsdp.whole_params(model)
    plain = fsdp.fresh()
    fsdp.train(plain, None)
    for name, params in expected.items():  # K-FAC changed the updates
        assert relative_error(params, fsdp.whole_params(plain)) > 1e-2, name
    labels = [case[0] for case in _cases(world_size)]
    outcomes = oracle.run_oracle(
        _train_sharded,
        labels,
        world_size,
        tmp_path=tmp_path,
        timeout=280,
        reference=lambda label: expected[CASES[label][1]],
    )
    exact = [
        (label, ranks)
        for label, ranks in zip(labels, outcomes)
        if not label.startswith('bf16')
    ]
    oracle.check_outcomes(
        [ranks for _, ranks in exact],
        [
            f'FSDP2 W={world_size} {label} vs single process'
            for label, _ in exact
        ],
        rtol=1e-10,
    )
    for label, ranks in zip(labels, outcomes):
        for outcome in ranks:
            if label.startswith('bf16'):  # runs, but rounds to bfloat16
                assert 1e-5 < outcome.versus <= BF16_TOLERANCE, outcome
                continue
            assert outcome.facts['replicas'], label
            assert outcome.facts['gathered'] > 0, label


def _gather_and_scatter() -> None:
    """Whole gradients while gathered; rows written back; a sharded
    parameter without a gradient gets one; plain tensors are left alone.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from kfac.distributed import TorchDistributedCommunicator
    from kfac.distributed._sharding import gather_grads

    torch.manual_seed(0)
    linear = nn.Linear(4, 5)
    plain = nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 2.0)
    fully_shard(linear)
    linear(torch.randn(6, 4)).sum().backward()
    weight, bias = linear.weight, linear.bias
    assert isinstance(weight.grad, DTensor)
    expected = weight.grad.full_tensor()
    bias.grad = None
    params = [weight, bias, plain, weight]
    gathered = gather_grads(TorchDistributedCommunicator(), params)
    assert len(gathered) == 2  # the plain tensor and the repeat skipped
    whole_weight, whole_bias = gathered.get(weight), gathered.get(bias)
    assert whole_weight is not None and whole_bias is not None
    assert type(whole_weight) is torch.Tensor
    assert torch.equal(whole_weight, expected)
    assert torch.equal(whole_bias, torch.zeros(5))
    assert gathered.get(plain) is plain.grad
    whole_weight.mul_(3.0)
    whole_bias.fill_(7.0)
    gathered.scatter()
    assert isinstance(bias.grad, DTensor) and isinstance(weight.grad, DTensor)
    assert torch.equal(bias.grad.full_tensor(), torch.full((5,), 7.0))
    assert torch.equal(weight.grad.full_tensor(), 3.0 * expected)
    assert gathered.get(weight) is weight.grad  # scattered: nothing held
    # Local mode: this rank's rows in zeros, no communication.
    from kfac.distributed._sharding import local_grads
    from kfac.distributed._sharding import owner_labels

    bias.grad = None
    held = local_grads([weight, bias, plain])
    assert len(held) == 2
    mine = weight.to_local().shape[0]
    start = dist.get_rank() * 3  # 5 rows over 2 ranks: 3, 2
    whole_weight = held.get(weight)
    assert whole_weight is not None
    assert torch.equal(
        whole_weight[start : start + mine], weight.grad.to_local()
    )
    assert whole_weight.abs().sum() == weight.grad.to_local().abs().sum()
    whole_bias = held.get(bias)
    assert whole_bias is not None
    assert torch.equal(whole_bias, torch.zeros(5))
    held.clear()
    assert bias.grad is None  # released: nothing written
    assert owner_labels([plain], lambda grads: None) is None
    labels = owner_labels([weight, plain], lambda grads: grads.get(weight))
    assert labels is not None
    assert labels[:, 0].tolist() == [0, 0, 0, 1, 1]


def _nonfinite_gradient() -> None:
    """A layer whose preconditioned gradient is not finite keeps its
    (sharded) gradient; the others are preconditioned.
    """
    from torch.distributed.tensor import DTensor

    for mode in ('lossless', 'local'):
        model = fsdp.shard(fsdp.fresh())
        precon = KFACPreconditioner(
            model, sharding=ShardingConfig(shard_mode=mode)
        )
        tokens = fsdp.batch(0)
        model(tokens[:, :-1]).sum().backward()
        grads = {}
        for name, param in model.named_parameters():
            assert isinstance(param.grad, DTensor)
            if name == 'up.weight':
                param.grad.to_local().fill_(float('inf'))
            grads[name] = param.grad.full_tensor()
        precon.step()
        for name, param in model.named_parameters():
            assert isinstance(param.grad, DTensor)
            after = param.grad.full_tensor()
            if name.startswith('up.'):  # kept as it was
                assert torch.equal(after, grads[name]), name
            elif name.startswith(('conv.', 'down.', 'head.')):
                assert not torch.equal(after, grads[name]), name
        assert precon.layers['up'].counters['nonfinite_gradients'] == 1


def _errors(out_dir: str) -> None:
    """Each unsupported set-up raises at construction, naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module

    from kfac.distributed._sharding import row_shard

    messages: dict[str, str] = {}

    def expect(
        label: str, error: type[Exception], build: Callable[[], nn.Module]
    ) -> None:
        with pytest.raises(error) as info:
            KFACPreconditioner(build())
        messages[label] = str(info.value)

    def fsdp1() -> nn.Module:
        # FSDP1 needs an accelerator to wrap a module; on this CPU-only
        # machine an instance that skipped FSDP1's own __init__ stands in.
        wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
        nn.Module.__init__(wrapper)
        return nn.Sequential(nn.Linear(4, 4), wrapper)

    def tensor_parallel() -> nn.Module:
        mesh = init_device_mesh('cpu', (dist.get_world_size(),))
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        parallelize_module(model, mesh, {'0': ColwiseParallel()})
        return model

    def offload() -> nn.Module:
        # CPUOffloadPolicy needs an accelerator to shard; on this CPU-only
        # machine the policy is set on an ordinary sharded module instead.
        model = nn.Sequential(nn.Linear(4, 6))
        group = fully_shard(model)._get_fsdp_state()._fsdp_param_group
        assert group is not None
        group.offload_policy = CPUOffloadPolicy()
        return model

    def attention_sharded_first() -> nn.Module:
        model = nn.Sequential(nn.MultiheadAttention(4, 2))
        fully_shard(model[0])
        return model

    expect('fsdp1', TypeError, fsdp1)
    expect('tensor_parallel', ValueError, tensor_parallel)
    expect('offload', ValueError, offload)
    expect('attention', ValueError, attention_sharded_first)
    mesh = init_device_mesh('cpu', (dist.get_world_size(),))
    columns = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    with pytest.raises(ValueError) as wrong:
        row_shard(columns)
    messages['columns'] = str(wrong.value)
    # The model sharded after the preconditioner was built.
    model = fsdp.fresh()
    precon = KFACPreconditioner(model)
    fsdp.shard(model)
    tokens = fsdp.batch(0)
    model(tokens[:, :-1]).sum().backward()
    with pytest.raises(RuntimeError) as late:
        precon.step()
    messages['late'] = str(late.value)
    _gather_and_scatter()
    # Local mode over two different process groups.
    split = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(split[0])
    hsdp = init_device_mesh(
        'cpu', (2, 1), mesh_dim_names=('replicate', 'shard')
    )
    fully_shard(split[1], mesh=hsdp)
    with pytest.raises(ValueError) as groups:
        KFACPreconditioner(split, sharding=ShardingConfig(shard_mode='local'))
    messages['groups'] = str(groups.value)
    # The gradient's own factors need the whole gradient on every rank.
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    fully_shard(plain)
    with pytest.raises(ValueError) as own:
        KFACPreconditioner(
            plain, compute_method=EigenAdamConfig(source='gradient')
        )
    messages['gradient_source'] = str(own.value)
    _nonfinite_gradient()
    if dist.get_rank() == 0:
        (pathlib.Path(out_dir) / 'errors.json').write_text(
            json.dumps(messages)
        )


@FSDP2_ON_CPU
@pytest.mark.timeout(120)
def test_unsupported_sharding_raises_at_construction(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(_errors, 2, str(tmp_path), tmp_path=tmp_path, timeout=110)
    messages = json.loads((tmp_path / 'errors.json').read_text())
    assert 'FSDP1' in messages['fsdp1'] and 'fully_shard' in messages['fsdp1']
    assert 'parallelize_module' in messages['tensor_parallel']
    assert 'CPUOffloadPolicy' in messages['offload']
    assert 'convert_attention' in messages['attention']
    assert 'Shard(dim=1)' in messages['columns']
    assert 'replaced' in messages['late'] and 'embed' in messages['late']
    assert 'same process group' in messages['groups']
    assert "source='gradient'" in messages['gradient_source']
    assert 'FSDP2' in messages['gradient_source']


class _TiedLM(nn.Module):
    """An embedding tied to its output head, and a Linear between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(fsdp.VOCAB, fsdp.WIDTH)
        self.mid = nn.Linear(fsdp.WIDTH, fsdp.WIDTH)
        self.head = nn.Linear(fsdp.WIDTH, fsdp.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mid(self.embed(tokens))))
        return out


def _tied() -> _TiedLM:
    torch.manual_seed(2)
    return _TiedLM().double()


def _tiled(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with factors of at most 5 rows (13-token vocabulary,
    width 8: tiles).
    """
    base = config.get('statistics', fsdp.statistics())
    return {**config, 'statistics': replace(base, max_factor_dim=5)}


def _train_tied(name: str, part: oracle.Part) -> torch.Tensor:
    """The tied model, sharded under a process group (the tied weight in
    the root's unit), trained on rows `part`.
    """
    from torch.distributed.fsdp import fully_shard

    model = _tied()
    if dist.is_initialized():
        fully_shard(model.mid)
        fully_shard(model)
    precon = fsdp.train(model, _tiled(CONFIGS[name]), part=part)
    assert precon is not None
    assert {'embed.block0', 'mid.block0'} <= set(precon.layers)
    assert not any(n.startswith('head') for n in precon.layers)
    return fsdp.whole_params(model)


@FSDP2_ON_CPU
@pytest.mark.timeout(200)
def test_tied_and_tiled_layers_under_fully_shard(
    tmp_path: pathlib.Path,
) -> None:
    """The tied embedding and head (one layer) and tiles of a blocked
    layer under FSDP2 equal one process, COMM-OPT and MEM-OPT.
    """
    names = ['comm_opt-eigen', 'mem_opt-inverse']
    outcomes = oracle.run_oracle(
        _train_tied, names, 2, tmp_path=tmp_path, timeout=180
    )
    labels = [f'FSDP2 W=2 tied and tiled {name}' for name in names]
    oracle.check_outcomes(outcomes, labels, rtol=1e-10)
