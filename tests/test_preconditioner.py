"""Behaviour of the preconditioner's step, hooks and bookkeeping."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.config import EngineOptions
from kfac.enums import AllreduceMethod
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import EKFACConfig
from kfac.layers.curvature import InverseConfig
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.asserts import relative_error
from testing.models import AttentionNet
from testing.models import BranchNet
from testing.models import TinyCNN
from testing.models import TinyMLP
from testing.models import classification_data
from testing.options import EVERY_STEP
from testing.reference import grad_matrix

F64 = torch.float64


def backward(model: nn.Module, seed: int = 0, n: int = 8) -> None:
    x, y = classification_data(n, (6,), seed=seed)
    F.cross_entropy(model(x), y).backward()


def train(
    model: nn.Module,
    precon: KFACPreconditioner | None,
    steps: int,
    *,
    lr: float = 0.1,
    shape: tuple[int, ...] = (6,),
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = classification_data(32, shape, seed=step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if precon is not None:
            precon.step()
        optimizer.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_kfac_decreases_the_loss_faster_than_sgd(method: str) -> None:
    """The seed's end-to-end check: K-FAC trains a small CNN (with the
    original's every-step updates and KL clip, as the seed had them).
    """
    torch.manual_seed(0)
    model = TinyCNN().double()
    baseline = copy.deepcopy(model)
    x, y = classification_data(64, (2, 8, 8), seed=99)
    precon = KFACPreconditioner(
        model,
        **(ORIGINAL_DEFAULTS | {'damping': 0.01, 'compute_method': method}),
    )
    opt_k = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(baseline.parameters(), lr=0.1)
    first = float(F.cross_entropy(model(x), y))
    for _ in range(15):
        for m, opt, p in ((model, opt_k, precon), (baseline, opt_s, None)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if p is not None:
                p.step()
            opt.step()
    kfac_loss = float(F.cross_entropy(model(x), y))
    sgd_loss = float(F.cross_entropy(baseline(x), y))
    assert kfac_loss < 0.5 * first
    assert kfac_loss < sgd_loss


def test_update_intervals_gate_factors_and_decompositions() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=4
    )
    layer = precon.layers['fc1']
    seen = []
    for step in range(8):
        model.zero_grad()
        before = (layer.a.value, layer.a.decomposition)
        backward(model, seed=step)
        precon.step()
        after = (layer.a.value, layer.a.decomposition)
        seen.append((after[0] is not before[0], after[1] is not before[1]))
    assert seen == [(step % 2 == 0, step % 4 == 0) for step in range(8)]
    assert precon.steps == 8


def test_non_capture_steps_store_nothing() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, factor_update_steps=3)
    backward(model)
    precon.step()
    backward(model)
    assert precon.memory_usage()['a_batch'] == 0
    assert precon.layers['fc1'].a.captures == 0


def test_callable_hyperparameters_are_called_with_the_step() -> None:
    model = TinyMLP().double()
    calls: list[int] = []

    def damping(step: int) -> float:
        calls.append(step)
        return 0.01 * (step + 1)

    precon = KFACPreconditioner(model, damping=damping, relative_clip=None)
    for step in range(3):
        model.zero_grad()
        backward(model, seed=step)
        precon.step()
        assert precon.damping == pytest.approx(0.01 * (step + 2))
    assert set(calls) == {0, 1, 2, 3}


def test_callable_hyperparameter_with_invalid_value_raises() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, damping=lambda step: -1.0)
    with pytest.raises(
        ValueError, match='damping must be a finite number > 0'
    ):
        backward(model)
        precon.step()


def test_no_clip_leaves_preconditioned_grad_unscaled() -> None:
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    a = KFACPreconditioner(model, relative_clip=None)
    b = KFACPreconditioner(twin, relative_clip=1e12)  # never clips
    backward(model)
    backward(twin)
    a.step()
    b.step()
    for name in a.layers:
        assert torch.equal(
            grad_matrix(model.get_submodule(name)),
            grad_matrix(twin.get_submodule(name)),
        )


def test_module_that_did_not_run_keeps_its_gradient(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = BranchNet().double()
    precon = KFACPreconditioner(model, **EVERY_STEP)
    x = torch.randn(5, 4, dtype=F64)
    with caplog.at_level(logging.WARNING, logger='kfac'):
        for _ in range(3):
            model.zero_grad()
            model(x).sum().backward()
            precon.step()
    assert model.branch.weight.grad is None
    assert not precon.layers['branch'].has_factors
    assert precon.layers['fc1'].has_factors
    messages = [
        r.getMessage() for r in caplog.records if 'branch' in r.getMessage()
    ]
    assert len([m for m in messages if 'did not run' in m]) == 1
    assert 'module branch did not run forward and backward' in messages[0]
    # When the branch starts running, it is preconditioned from then on.
    model.use_branch = True
    model.zero_grad()
    model(x).sum().backward()
    raw = grad_matrix(model.branch).clone()
    precon.step()
    assert precon.layers['branch'].has_factors
    assert not torch.equal(grad_matrix(model.branch), raw)


def test_multihead_attention_is_converted_and_preconditioned() -> None:
    """`out_proj` was never called as a module (its hooks never fired);
    the preconditioner converts the attention so that they do.
    """
    model = AttentionNet().double()
    precon = KFACPreconditioner(model)
    assert [n for n in precon.layers if n.startswith('attn')] == [
        'attn.out_proj',
        'attn.q_proj',
        'attn.k_proj',
        'attn.v_proj',
    ]
    x = torch.randn(4, 5, 8, dtype=F64)
    y = torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    raw = model.attn.in_proj_weight.grad.clone()  # type: ignore[union-attr]  # backward() above set it
    precon.step()
    assert all(layer.has_factors for layer in precon.layers.values())
    assert not torch.equal(model.attn.in_proj_weight.grad, raw)  # type: ignore[arg-type]  # backward() above set it


def test_remove_detaches_hooks() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, update_factors_in_hook=False)
    precon.remove()
    backward(model)
    assert precon.memory_usage()['a_batch'] == 0
    assert not model.fc1._forward_hooks
    with pytest.raises(RuntimeError, match='removed'):
        precon.step()


def test_reset_batch_drops_captured_data() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, update_factors_in_hook=False)
    backward(model)
    usage = precon.memory_usage()
    # Stored activations: fc1 input 8x6, fc2 input 8x5, grads 8x5 and 8x3.
    assert usage['a_batch'] == 8 * (6 + 5) * 8
    assert usage['g_batch'] == 8 * (5 + 3) * 8
    precon.reset_batch()
    usage = precon.memory_usage()
    assert usage['a_batch'] == usage['g_batch'] == 0


def test_memory_usage_counts_factors_and_decompositions() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model, compute_method='eigen', compute_eigenvalue_outer_product=False
    )
    backward(model)
    precon.step()
    usage = precon.memory_usage()
    # fc1: A 7x7, G 5x5; fc2: A 6x6, G 3x3 (float64).
    assert usage['a_factors'] == (49 + 36) * 8
    assert usage['g_factors'] == (25 + 9) * 8
    # eigenvectors and eigenvalues
    assert usage['a_inverses'] == (49 + 7 + 36 + 6) * 8
    assert usage['g_inverses'] == (25 + 5 + 9 + 3) * 8
    assert usage['total'] == sum(v for k, v in usage.items() if k != 'total')


def test_hook_accumulation_with_statistics_in_hook_uses_no_activations() -> (
    None
):
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model, update_factors_in_hook=True, accumulation_steps=2
    )
    x, _ = classification_data(8, (6,))
    out = model(x)
    # A call counts only once its gradient arrives.
    assert precon.memory_usage()['a_batch'] == 0
    out.sum().backward()  # the first of two micro-batches
    # Statistics, not activations: a (n x n) sum per factor.
    assert precon.memory_usage()['a_batch'] == (49 + 36) * 8


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.calls = 0

    def get_scale(self) -> float:
        self.calls += 1
        return self.scale


def test_grad_scaler_object_is_read_once_per_step() -> None:
    model = TinyMLP().double()
    scaler = _Scaler(8.0)
    precon = KFACPreconditioner(model, grad_scaler=scaler, **EVERY_STEP)
    for step in range(3):
        model.zero_grad()
        backward(model, seed=step)
        precon.step()
    assert scaler.calls == 3


#: A loss scale whose removal is exact in floating point, and far enough
#: from 1 that a G formed from scaled gradients (SCALE**2 too large) fails.
LOSS_SCALE = 2.0**10


def g_factors(
    model: nn.Module,
    grad_scaler: torch.amp.GradScaler | None,
    scale_loss: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """G of every layer after one step on ``scale_loss(loss)``."""
    precon = KFACPreconditioner(model, grad_scaler=grad_scaler)
    x, y = classification_data(8, (6,))
    scaled = scale_loss(F.cross_entropy(model(x), y))
    scaled.backward()
    precon.step()
    factors = {}
    for name, layer in precon.layers.items():
        assert layer.g.value is not None
        factors[name] = layer.g.value
    return factors


def test_amp_grad_scaler_scale_is_divided_out() -> None:
    scaler = torch.amp.GradScaler('cpu', init_scale=LOSS_SCALE)
    # On the CPU the scaler is live: it really multiplies the loss.
    assert scaler.is_enabled()
    assert (
        float(scaler.scale(torch.tensor(1.5, dtype=F64))) == 1.5 * LOSS_SCALE
    )
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    scaled = g_factors(model, scaler, scaler.scale)
    plain = g_factors(twin, None, lambda loss: loss)
    assert scaled.keys() == plain.keys() == {'fc1', 'fc2'}
    for name, g in plain.items():
        assert_rel_close(scaled[name], g, rtol=1e-14, label='amp scaler')


class EnabledCudaScaler(torch.cuda.amp.GradScaler):
    """The deprecated CUDA scaler as on a GPU: enabled, scale LOSS_SCALE.

    Without CUDA the real one is disabled and its scale is 1.0, which would
    make any comparison with an unscaled run pass.
    """

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return LOSS_SCALE


def test_deprecated_cuda_grad_scaler_scale_is_divided_out() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # deprecated; CUDA missing
        scaler = EnabledCudaScaler()
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    scaled = g_factors(model, scaler, lambda loss: loss * LOSS_SCALE)
    plain = g_factors(twin, None, lambda loss: loss)
    assert scaled.keys() == plain.keys() == {'fc1', 'fc2'}
    for name, g in plain.items():
        assert_rel_close(scaled[name], g, rtol=1e-14, label='cuda scaler')


def test_step_counts_and_repr() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    assert precon.steps == 0
    backward(model)
    precon.step()
    assert precon.steps == 1
    assert 'layers=2, steps=1' in repr(precon)
    # a layer's repr names its method (INVERSE, the default) and
    # identifies its module
    layer = repr(precon.layers['fc1'])
    assert layer.startswith('KFACBaseLayer(') and layer.endswith(', inverse)')
    assert repr(model.fc1) in layer


def test_bfloat16_model_is_preconditioned_like_its_float64_twin() -> None:
    """Statistics accumulate in float32: A equals the float64 model's to
    float32 rounding (bfloat16 sums are off by ~1e-3), and the
    preconditioned gradient is the float64 one to bfloat16 rounding.
    """
    torch.manual_seed(0)
    model = TinyMLP().to(torch.bfloat16)
    twin = copy.deepcopy(model).double()  # the same (bfloat16) values
    x, y = classification_data(64, (6,), dtype=torch.bfloat16)
    precon = KFACPreconditioner(model, damping=0.01)
    reference = KFACPreconditioner(twin, damping=0.01)
    F.cross_entropy(model(x).float(), y).backward()
    F.cross_entropy(twin(x.double()), y).backward()
    raw = grad_matrix(twin.fc1).clone()
    precon.step()
    reference.step()
    a, a_ref = precon.layers['fc1'].a.value, reference.layers['fc1'].a.value
    assert a is not None and a_ref is not None
    assert a.dtype == torch.float32
    assert_rel_close(a, a_ref, rtol=1e-6, label='bfloat16 model')
    got, expected = grad_matrix(model.fc1), grad_matrix(twin.fc1)
    assert got.dtype == torch.bfloat16
    # preconditioning moves the gradient far more than the tolerance
    assert relative_error(raw, expected) > 0.5
    assert_rel_close(got, expected, rtol=3e-2, label='bfloat16 model')


def test_loss_decreases_for_bfloat16_model() -> None:
    torch.manual_seed(0)
    model = TinyMLP().to(torch.bfloat16)
    precon = KFACPreconditioner(
        model, **(ORIGINAL_DEFAULTS | {'damping': 0.01})
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = classification_data(64, (6,), dtype=torch.bfloat16)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        precon.step()
        optimizer.step()
        losses.append(float(loss))
    # Measured: 1.072 -> 0.963 (seeds 0-2 drop 0.09-0.14; SGD alone 0.02).
    assert losses[-1] < losses[0] - 0.05


def test_phase_timer_records_every_local_phase() -> None:
    from kfac.tracing import PhaseTimer

    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    syncs: list[int] = []
    delay = 0.002

    def sync() -> None:
        syncs.append(1)
        time.sleep(delay)

    precon.timer = PhaseTimer(sync=sync)
    backward(model)
    precon.step()
    timer = precon.timer
    assert set(timer.seconds) == {
        'factor_capture',
        'running_average',
        'factor_allreduce',
        'decomposition',
        'precondition',
        'kl_clip',
        'write_back',
    }
    assert timer.counts['factor_capture'] == 4  # 2 layers x (A, G)
    # the sync closing each phase runs inside its timing: seconds add up
    for name, count in timer.counts.items():
        assert timer.seconds[name] >= delay * count
    assert len(syncs) == 2 * sum(timer.counts.values())
    timer.reset()
    assert not timer.seconds


def test_base_preconditioner_validates_its_arguments() -> None:
    model = nn.Linear(2, 2)
    precon = KFACPreconditioner(model)
    with pytest.raises(
        ValueError, match='layers must contain at least one KFACBaseLayer'
    ):
        BaseKFACPreconditioner({}, assignment=precon.assignment)
    with pytest.raises(
        TypeError, match='update_factors_in_hook must be a bool'
    ):
        BaseKFACPreconditioner(
            dict(precon.layers),
            assignment=precon.assignment,
            options=EngineOptions(update_factors_in_hook='yes'),  # type: ignore[arg-type]  # wrong on purpose
        )


class Detached(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).detach()


def test_output_without_grad_captures_only_inputs() -> None:
    model = nn.Sequential(Detached(3, 3), nn.Linear(3, 2)).double()
    precon = KFACPreconditioner(model)
    model(torch.randn(4, 3, dtype=F64)).sum().backward()
    precon.step()
    assert not precon.layers['0'].has_factors
    assert precon.layers['1'].has_factors


def test_factor_rank_no_shorter_than_the_factors_is_plain_eigen() -> None:
    """`factor_rank` at the longest side keeps every factor whole: the
    same parameters as without it, bit for bit; one less keeps that factor
    at low rank.
    """
    results = []
    for rank in (None, 49, 48):
        torch.manual_seed(0)
        model = TinyCNN().double()
        precon = KFACPreconditioner(
            model, lr=0.1, compute_method=InverseConfig(factor_rank=rank)
        )
        for step in range(3):
            x, y = classification_data(6, (2, 8, 8), seed=step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            precon.step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results.append(torch.cat([g.flatten() for g in grads]))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


@pytest.mark.parametrize(
    ('build', 'error', 'match'),
    [
        (lambda: InverseConfig(factor_rank=0), ValueError, 'factor_rank'),
        (
            lambda: EigenConfig(factor_rank=2.5),  # type: ignore[arg-type]  # wrong on purpose
            TypeError,
            'factor_rank',
        ),
        (
            lambda: InverseConfig(damping_mode='scaled'),
            ValueError,
            'damping_mode',
        ),
        # EKFAC adds λ to its scaling as given: no such option to write
        (
            lambda: EKFACConfig(damping_mode='relative'),  # type: ignore[call-arg]  # no such option
            TypeError,
            'damping_mode',
        ),
        (
            lambda: KFACPreconditioner(
                TinyCNN(), module_options={'fc': {'factor_rank': 0}}
            ),
            ValueError,
            "module_options\\['fc'\\] has unknown options \\['factor_rank'\\]",
        ),
    ],
)
def test_cost_options_are_validated(
    build: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build()


def test_original_attributes_read_the_configuration() -> None:
    # The original KAISA code's attributes of KFACPreconditioner.
    given: dict[str, Any] = {
        'allreduce_bucket_cap_mb': 0,
        'assignment_strategy': 'memory',
        'colocate_factors': False,
        'compute_method': 'eigen',
        'compute_eigenvalue_outer_product': False,
        'factor_dtype': torch.float64,
        'inv_dtype': torch.float64,
        'skip_layers': ['conv'],
        'symmetry_aware': True,
    }
    precon = KFACPreconditioner(TinyCNN(), **given)
    for name, value in given.items():
        assert getattr(precon, name) == value, name
    assert precon.allreduce_method is AllreduceMethod.ALLREDUCE
    assert precon.assignment_strategy is AssignmentStrategy.MEMORY
    assert precon.compute_method is ComputeMethod.EIGEN
    bucketed = KFACPreconditioner(TinyMLP(), allreduce_bucket_cap_mb=1)
    assert bucketed.allreduce_method is AllreduceMethod.ALLREDUCE_BUCKETED


@pytest.mark.parametrize('fraction', [0, 0.5, 1, 'mem_opt', 'hybrid_opt'])
def test_one_process_is_comm_opt_whatever_the_fraction(
    fraction: float | str,
) -> None:
    precon = KFACPreconditioner(TinyMLP(), grad_worker_fraction=fraction)
    assert precon.grad_worker_fraction == 1.0
    assert precon.distributed_strategy is DistributedStrategy.COMM_OPT


@pytest.mark.parametrize(
    ('fraction', 'expected', 'strategy'),
    [
        (1, 1.0, DistributedStrategy.COMM_OPT),
        (0.5, 0.5, DistributedStrategy.HYBRID_OPT),
        (0.25, 0.25, DistributedStrategy.MEM_OPT),
        (0, 0.25, DistributedStrategy.MEM_OPT),
    ],
)
def test_distributed_strategy_follows_the_placement(
    fraction: float, expected: float, strategy: DistributedStrategy
) -> None:
    # The placement of a rank of 4 (no process group: groups are not made).
    precon = KFACPreconditioner(TinyMLP())
    precon._kaisa = KAISAAssignment(
        decomposition_work(precon.layers, 'compute'),
        local_rank=0,
        world_size=4,
        grad_worker_fraction=fraction,
        group_func=lambda ranks: None,
    )
    assert precon.grad_worker_fraction == expected
    assert precon.distributed_strategy is strategy


def test_loglevel_sets_the_level_of_construction_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger='kfac'):
        KFACPreconditioner(TinyMLP())  # loglevel=logging.DEBUG
    assert caplog.records == []
    with caplog.at_level(logging.INFO, logger='kfac'):
        KFACPreconditioner(TinyMLP(), loglevel=logging.INFO)
    messages = [r.getMessage() for r in caplog.records]
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 2
    assert messages[0].startswith('K-FAC preconditions 2 modules')
    assert 'KAISAAssignment' in messages[1]
