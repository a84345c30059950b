"""The time-to-target study's harness on tiny data (benchmarks/study).

The study itself runs outside CI; these tests check that its runs train
what they say and that its analysis picks the best baseline and times the
others the way the issue defines. No test here asserts a time.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import math
import pathlib
import statistics
from typing import Any

import pytest
import torch

from benchmarks.study import __main__ as study
from benchmarks.study import analysis
from benchmarks.study import runner
from benchmarks.study import step_cost
from benchmarks.study import tasks
from benchmarks.study import variants
from examples.data import ImageData
from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.layers.curvature import InverseConfig
from kfac.preconditioner import KFACPreconditioner
from testing.torch_release import MUON


def _images(count: int = 64) -> ImageData:
    generator = torch.Generator().manual_seed(0)
    return ImageData(
        train_images=torch.randn(count, 1, 28, 28, generator=generator),
        train_labels=torch.randint(0, 10, (count,), generator=generator),
        test_images=torch.randn(32, 1, 28, 28, generator=generator),
        test_labels=torch.randint(0, 10, (32,), generator=generator),
        num_classes=10,
        source='random',
    )


def _text() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 256, (4000,), generator=generator),
        torch.randint(0, 256, (1000,), generator=generator),
    )


def _tiny(task: tasks.Task) -> tasks.Task:
    return dataclasses.replace(task, steps=3, eval_every=2)


TINY = {
    'cnn': lambda: _tiny(tasks.cnn(_images(), epochs=1, batch=16)),
    'gpt': lambda: _tiny(tasks.gpt(_text(), batch=4, valid_windows=8)),
    'autoencoder': lambda: _tiny(tasks.autoencoder(_images(), batch=16)),
}


@pytest.mark.parametrize('name', sorted(TINY))
@pytest.mark.parametrize(
    'config',
    [
        runner.Config('sgd', 0.01),
        pytest.param(runner.Config('muon', 0.001), marks=MUON),
        runner.kfac_config('adamw', 0.001, 'kfac', variants.BASE_KFAC),
        runner.kfac_config(
            'sgd',
            0.01,
            'mc',
            {**variants.BASE_KFAC, **variants.VARIANTS['mc']},
        ),
        runner.Config('soap', 0.003),
        runner.Config('kron', 0.001, schedule='cosine'),
        runner.kfac_config('adamw', 0.001, 'defaults', {}, 'cosine'),
    ],
    ids=[
        'sgd',
        'muon',
        'adamw+kfac',
        'sgd+mc',
        'soap',
        'kron-cosine',
        'adamw+defaults-cosine',
    ],
)
def test_a_run_trains_and_records(name: str, config: runner.Config) -> None:
    task = TINY[name]()
    record = runner.run(task, config, seed=0)
    steps = [e[0] for e in record['evals']]
    assert steps == [0, 2, 3]
    for clock in (1, 3):
        seconds = [e[clock] for e in record['evals']]
        assert seconds == sorted(seconds) and seconds[0] == 0.0
    assert record['final'] == record['evals'][-1][2]
    assert not record['diverged'] and record['steps'] == 3
    assert record['schedule'] == config.schedule
    # K-FAC's clip at each evaluation after step 0: a scale in (0, 1] and
    # a positive norm ratio; nothing for the optimizer alone
    clips = record['kfac_clip']
    if config.kfac is None:
        assert clips == []
    else:
        assert [c[0] for c in clips] == [2, 3]
        assert all(0 < c[1] <= 1 and c[2] > 0 for c in clips)
    # The same seed starts every optimizer from the same weights and
    # batches: step 0's metric is the untrained model's.
    assert record['evals'][0][2] == task.evaluate(task.build(0))


@pytest.mark.parametrize('name', sorted(TINY))
@pytest.mark.parametrize(
    'config',
    [
        runner.kfac_config('adamw', 0.001, variants.DEFAULTS, {}),
        pytest.param(
            runner.kfac_config(
                'muon',
                0.001,
                'defaults+mc',
                variants.OVER_DEFAULTS['defaults+mc'],
            ),
            marks=MUON,
        ),
    ],
    ids=['adamw+defaults', 'muon+defaults+mc'],
)
def test_a_run_on_the_test_device_repeats_the_cpu(
    name: str, config: runner.Config, device: torch.device
) -> None:
    """`make gpu-study`'s path: the model, the batches and the evaluation
    on `device` (``KFAC_TEST_DEVICE``; the record says where the model's
    parameters were), the same weights and batches as on the CPU, and so
    nearly the same numbers.
    """
    task = TINY[name]()
    here = runner.run(task, config, seed=0)
    there = runner.run(task, config, seed=0, device=str(device))
    assert (here['device'], there['device']) == ('cpu', str(device))
    for a, b in zip(here['evals'], there['evals'], strict=True):
        assert a[0] == b[0]
        assert math.isclose(a[2], b[2], rel_tol=1e-4, abs_tol=1e-4)


@MUON
@pytest.mark.parametrize('name', sorted(TINY))
def test_muon_trains_the_hidden_matrices_and_adamw_the_rest(name: str) -> None:
    task = TINY[name]()
    model = task.build(0)
    muon, adamw = runner.make_optimizers('muon', model, 0.01, task)
    matrices = [p for group in muon.param_groups for p in group['params']]
    rest = [p for group in adamw.param_groups for p in group['params']]
    assert matrices and all(p.ndim == 2 for p in matrices)
    assert {id(p) for p in matrices} | {id(p) for p in rest} == {
        id(p) for p in model.parameters()
    }
    assert not {id(p) for p in matrices} & {id(p) for p in rest}
    # The output layer (and the tied embedding) is never Muon's.
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    assert all(p is not last.weight for p in matrices)


@pytest.mark.parametrize('name', sorted(TINY))
def test_soap_and_kron_train_every_parameter_as_their_authors_say(
    name: str,
) -> None:
    """SOAP and PSGD Kron come from `pytorch-optimizer`, one optimizer over
    every parameter, with the settings `runner.packaged` documents.
    """
    pytorch_optimizer = pytest.importorskip('pytorch_optimizer')
    task = TINY[name]()
    model = task.build(0)
    everything = {id(p) for p in model.parameters()}
    (soap,) = runner.make_optimizers('soap', model, 0.003, task)
    (kron,) = runner.make_optimizers('kron', model, 0.001, task)
    assert isinstance(soap, pytorch_optimizer.SOAP)
    assert isinstance(kron, pytorch_optimizer.Kron)
    for optimizer, lr in ((soap, 0.003), (kron, 0.001)):
        (group,) = optimizer.param_groups
        assert {id(p) for p in group['params']} == everything
        assert group['lr'] == lr and group['weight_decay'] == 0.01
    (group,) = soap.param_groups
    assert group['betas'] == (0.95, 0.95)
    assert group['precondition_frequency'] == 10
    assert group['shampoo_beta'] is None  # beta2's
    assert not group['precondition_1d']
    (group,) = kron.param_groups
    assert group['momentum'] == 0.9 and group['weight_decouple']
    # the package's decaying update probability, as its authors advise
    assert group['pre_conditioner_update_probability'] is None


def test_the_schedule_warms_up_linearly_then_decays_to_zero() -> None:
    """Over 60 steps: warm-up over 5% of them (3 steps) to the base rate,
    then half a cosine period down to zero after the last step; the rates
    an optimizer takes at each step are these.
    """
    steps, base = 60, 0.5
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([parameter], lr=base)
    (scheduler,) = runner.schedulers('cosine', [optimizer], steps)
    taken = []
    for _ in range(steps):
        taken.append(optimizer.param_groups[0]['lr'])
        parameter.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    warm = math.ceil(0.05 * steps)
    expected = [base * (k + 1) / warm for k in range(warm)] + [
        base * (1 + math.cos(math.pi * (k - warm) / (steps - warm))) / 2
        for k in range(warm, steps)
    ]
    assert taken == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert max(taken) == base and 0 < taken[-1] < 1e-3 * base
    assert runner.warmup_cosine(steps, steps) == pytest.approx(0, abs=1e-15)
    # a constant rate has no scheduler; an unknown schedule is refused
    assert runner.schedulers(None, [optimizer], steps) == []
    with pytest.raises(ValueError, match="schedule must be one of.*'step'"):
        runner.schedulers('step', [optimizer], steps)


@MUON
def test_the_command_line_sets_rates_and_kfac_per_optimizer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--lr-of` replaces one optimizer's grid; `--kfac-over` runs K-FAC
    over the optimizers it names only (the others alone); `--schedule`
    labels every run and sends them to a file of their own.
    """
    argv = ['--task', 'gpt', '--optimizers', 'soap', 'muon']
    more = ['--kfac-over', 'muon', '--baselines', '--schedule', 'cosine']
    args = study.parse_args(
        [*argv, '--lr-of', 'muon=0.005,0.01', '--kfac', 'defaults', *more]
    )
    labels = [config.label for config in study.configs(args)]
    assert labels == [
        *(f'soap lr={lr:g} cosine' for lr in study.GRIDS['gpt']['soap']),
        'muon lr=0.005 cosine',
        'muon+defaults lr=0.005 cosine',
        'muon lr=0.01 cosine',
        'muon+defaults lr=0.01 cosine',
    ]
    assert study.default_out('gpt', 'cpu', 'cosine') == (
        study.RESULTS / 'study_gpt_cosine.json'
    )
    for wrong in ('adamw=0.1', 'muon', 'muon='):
        with pytest.raises(SystemExit):
            study.parse_args([*argv, '--lr-of', wrong])
        assert f"--lr-of: '{wrong}': expected" in capsys.readouterr().err


def test_a_diverging_run_stops_with_the_worst_metric() -> None:
    task = TINY['autoencoder']()
    record = runner.run(task, runner.Config('sgd', 1e30), seed=0)
    assert record['diverged'] and math.isnan(record['final'])
    summary = analysis.summarise([record], higher_is_better=False)
    assert summary['rows'][0]['final_median'] == math.inf
    assert math.isnan(summary['rows'][0]['time_ratio'])
    assert '| n/a |' in analysis.markdown(summary, 'error')


@pytest.mark.parametrize(
    ('device', 'says'),
    [
        ('gpu0', 'Invalid device string'),  # torch's own words
        ('meta', "'cpu' or a CUDA device"),
        ('cuda:99', 'no such GPU'),
    ],
)
def test_a_device_it_cannot_use_is_refused(
    device: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        study.parse_args(['--task', 'gpt', '--device', device])
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ('task', 'variant'),
    [
        ('gpt', 'outeronly'),
        ('cnn', 'defaults+inneronly'),
        ('autoencoder', 'defaults+embedonly'),
    ],
)
def test_a_variant_of_another_tasks_modules_is_refused(
    task: str, variant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    says = f'--kfac {variant}: names modules of task'
    with pytest.raises(SystemExit):
        study.parse_args(['--task', task, '--kfac', variant])
    assert says in capsys.readouterr().err
    argv = ['--task', task, '--optimizer', 'sgd', '--lr', '0.1']
    with pytest.raises(SystemExit):
        step_cost.parse_args([*argv, '--kfac', variant])
    assert says in capsys.readouterr().err


def test_gpu_runs_never_mix_with_the_cpus(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert study.default_out('gpt', 'cpu') == study.RESULTS / 'study_gpt.json'
    assert study.default_out('gpt', 'cuda:1') == (
        study.RESULTS / 'study_gpt_cuda.json'
    )
    monkeypatch.setattr(tasks, 'load', lambda name: TINY[name]())
    out = tmp_path / 'study.json'
    argv = ['--task', 'gpt', '--optimizers', 'sgd', '--lrs', '0.01']
    study.main([*argv, '--seeds', '0', '--no-plot', '--out', str(out)])
    document = json.loads(out.read_text())
    assert document['runs'][0]['device'] == 'cpu'
    # a file whose runs were on a GPU takes no CPU runs, and the refusal
    # leaves it as it was
    document['runs'][0]['device'] = 'cuda:0'
    out.write_text(json.dumps(document))
    with pytest.raises(SystemExit, match='go to a file of their own'):
        study.main([*argv, '--seeds', '1', '--no-plot', '--out', str(out)])
    assert json.loads(out.read_text()) == document


def test_unknown_names_are_refused() -> None:
    task = TINY['cnn']()
    with pytest.raises(ValueError, match='optimizer must be one of'):
        runner.make_optimizers('lamb', task.build(0), 0.1, task)
    with pytest.raises(ValueError, match='task must be'):
        tasks.load('mnist')
    with pytest.raises(ValueError, match='K-FAC variant must be one of'):
        variants.settings('shampoo')


def test_muon_is_refused_where_torch_has_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before torch 2.9 (no `torch.optim.Muon`) asking for Muon is an
    error naming the release, from both command lines and from
    `make_optimizers`; the other optimizers are unaffected.
    """
    monkeypatch.delattr(torch.optim, 'Muon', raising=False)
    says = r"the optimizer 'muon' needs torch>=2\.9 \(torch\.optim\.Muon\)"
    task = TINY['cnn']()
    with pytest.raises(RuntimeError, match=f'{says}; this is torch 2'):
        runner.make_optimizers('muon', task.build(0), 0.01, task)
    (sgd,) = runner.make_optimizers('sgd', task.build(0), 0.01, task)
    assert isinstance(sgd, torch.optim.SGD)
    with pytest.raises(SystemExit):
        study.parse_args(['--task', 'gpt', '--optimizers', 'sgd', 'muon'])
    assert '--optimizers muon: the optimizer' in capsys.readouterr().err
    assert study.parse_args(['--task', 'gpt', '--report'])  # runs nothing
    with pytest.raises(SystemExit):
        step_cost.main(['--task', 'gpt', '--optimizer', 'muon', '--lr', '1'])
    assert '--optimizer muon: the optimizer' in capsys.readouterr().err
    assert study.parse_args(['--task', 'gpt', '--optimizers', 'sgd'])


def _run(
    label: str, kfac: str | None, seed: int, evals: list[tuple[int, float]]
) -> dict[str, object]:
    return {
        'label': label,
        'optimizer': label.split()[0].split('+')[0],
        'kfac': kfac,
        'lr': 0.1,
        'seed': seed,
        'steps': evals[-1][0],
        'seconds_per_step': 1.0,
        'cpu_seconds_per_step': 0.5,
        'diverged': False,
        'final': evals[-1][1],
        # wall seconds = step, CPU seconds = step / 2
        'evals': [(s, float(s), metric, s / 2) for s, metric in evals],
    }


def test_the_best_baseline_and_the_time_to_its_final_metric() -> None:
    # Baseline A ends at 80, 82, 84 (median 82); B at 70 every seed.
    # K-FAC reaches 82 at step 2 on two seeds and never on the third.
    runs = [
        _run('sgd lr=0.1', None, s, [(0, 10), (2, 60), (4, 80 + 2 * s)])
        for s in range(3)
    ]
    runs += [
        _run('adamw lr=0.1', None, s, [(0, 10), (4, 70)]) for s in range(3)
    ]
    runs += [
        _run('sgd+kfac lr=0.1', 'kfac', s, [(0, 10), (2, 90 - 20 * s)])
        for s in range(3)
    ]
    summary = analysis.summarise(runs, higher_is_better=True)
    assert summary['best_baseline'] == 'sgd lr=0.1'
    assert summary['target'] == 82
    rows = {row['label']: row for row in summary['rows']}
    # Seeds 1 and 2 of the best baseline reach 82 at step 4, seed 0 never:
    # the median is 4 steps (4 s at one second per step, 2 CPU seconds).
    assert rows['sgd lr=0.1']['seconds_to_target'] == 4
    assert rows['sgd lr=0.1']['cpu_seconds_to_target'] == 2
    assert rows['sgd lr=0.1']['reached'] == 2
    assert rows['sgd lr=0.1']['time_ratio'] == 1
    assert rows['adamw lr=0.1']['reached'] == 0
    assert rows['adamw lr=0.1']['time_ratio'] == math.inf
    # K-FAC: 90 and 70 and 50 at step 2; only seed 0 reaches: median never.
    assert rows['sgd+kfac lr=0.1']['reached'] == 1
    assert rows['sgd+kfac lr=0.1']['final_spread'] == 40
    # Against its own optimizer (SGD alone: 82 at 4 s), the same rows.
    own = analysis.per_optimizer(runs, higher_is_better=True)
    assert set(own) == {'sgd', 'adamw'}
    assert own['sgd']['best_baseline'] == 'sgd lr=0.1'
    assert own['adamw']['target'] == 70
    own_rows = {row['label']: row for row in own['adamw']['rows']}
    assert own_rows['adamw lr=0.1']['time_ratio'] == 1
    text = analysis.markdown_own(own, 'accuracy')
    assert text.splitlines()[2] == (
        '| sgd+kfac lr=0.1 | sgd lr=0.1: 82 | 70 | never | never | 1/3 |'
    )
    table = analysis.markdown(summary, 'accuracy')
    assert table.splitlines()[4] == (
        '| sgd lr=0.1 | 3 | 82 (4) | 4 | 2 | 4 | 500.0 | 1 | 2/3 |'
    )
    assert 'never' in table


def test_the_defaults_against_each_optimizer_at_its_best_lr() -> None:
    def at(run: dict[str, object], lr: float) -> dict[str, object]:
        return {**run, 'lr': lr, 'label': f'{run["label"]} lr={lr}'}

    # SGD alone: lr 0.1 ends at 80, 82, 84 (median 82, spread 4) and lr
    # 0.2 at 70: 0.1 is its best. K-FAC with the defaults at 0.1 ends at
    # 79, 79.5, 80 (median 79.5, spread 1): 2.5 worse, within 4.
    runs = [
        at(_run('sgd', None, s, [(0, 10), (4, 80 + 2 * s)]), 0.1)
        for s in range(3)
    ]
    runs += [at(_run('sgd', None, 0, [(0, 10), (4, 70)]), 0.2)]
    runs += [
        at(
            _run('sgd+defaults', 'defaults', s, [(0, 10), (4, 79 + s / 2)]),
            0.1,
        )
        for s in range(3)
    ]
    # K-FAC at a learning rate SGD is not best at is not compared.
    runs += [at(_run('sgd+defaults', 'defaults', 0, [(0, 10), (4, 99)]), 0.2)]
    # AdamW alone at 0.1 ends at 70 (one seed); with the defaults it gets
    # there at step 1 and ends at 60 on one seed and 75 on the other
    # (median 67.5, spread 15 allows it).
    runs += [at(_run('adamw', None, 0, [(0, 10), (4, 70)]), 0.1)]
    runs += [
        at(_run('adamw+defaults', 'defaults', 0, [(0, 10), (4, 60)]), 0.1),
        at(
            _run('adamw+defaults', 'defaults', 1, [(0, 10), (1, 71), (4, 75)]),
            0.1,
        ),
    ]
    # Muon alone has no defaults run: no row.
    runs += [at(_run('muon', None, 0, [(0, 10), (4, 70)]), 0.1)]
    rows = {
        r['optimizer']: r
        for r in analysis.defaults_check(runs, higher_is_better=True)
    }
    assert set(rows) == {'sgd', 'adamw'}
    sgd = rows['sgd']
    assert (sgd['lr'], sgd['alone_median'], sgd['kfac_median']) == (
        0.1,
        82,
        79.5,
    )
    assert (sgd['alone_spread'], sgd['kfac_spread'], sgd['allowed']) == (
        4,
        1,
        4,
    )
    assert sgd['no_worse']
    # SGD reaches 82 at step 4 on seeds 1 and 2; K-FAC never does.
    assert (sgd['alone_steps'], sgd['kfac_steps']) == (4, math.inf)
    assert sgd['time_ratio'] == math.inf
    adamw = rows['adamw']
    assert adamw['no_worse'] and adamw['allowed'] == 15
    # K-FAC: step 1 on seed 1, never on seed 0: the median of (1, inf).
    assert adamw['kfac_steps'] == math.inf
    # One point further below the allowance is worse.
    worse = [
        {**r, 'final': 77.0, 'evals': [(0, 0.0, 10.0, 0.0), (4, 4.0, 77.0, 2)]}
        if r['kfac'] == 'defaults' and r['optimizer'] == 'sgd'
        else r
        for r in runs
    ]
    checked = analysis.defaults_check(worse, higher_is_better=True)
    assert not checked[0]['no_worse']
    text = analysis.markdown_defaults(checked, 'accuracy')
    assert text.splitlines()[2] == (
        '| sgd lr=0.1 | 82 (4), 3 | 77 (0), 3 | **no** | 4 / never '
        '| 2 / never | never | 500.0 / 500.0 |'
    )
    # Lower is better: a loss of 1.0 against 1.1 alone is no worse.
    low = [
        at(_run('adamw', None, 0, [(0, 3.0), (4, 1.1)]), 0.1),
        at(_run('adamw+defaults', 'defaults', 0, [(0, 3.0), (2, 1.0)]), 0.1),
    ]
    (row,) = analysis.defaults_check(low, higher_is_better=False)
    assert row['no_worse'] and row['time_ratio'] == 2 / 4


def test_lower_is_better_and_no_baseline() -> None:
    runs = [
        _run('adamw lr=0.1', None, 0, [(0, 3.0), (5, 1.5)]),
        _run('adamw+kfac lr=0.1', 'kfac', 0, [(0, 3.0), (2, 1.4)]),
    ]
    summary = analysis.summarise(runs, higher_is_better=False)
    rows = {row['label']: row for row in summary['rows']}
    assert rows['adamw+kfac lr=0.1']['time_ratio'] == 2 / 5
    with pytest.raises(ValueError, match='no baseline'):
        analysis.summarise(runs[1:], higher_is_better=False)


def test_the_command_line_builds_up_a_study(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks, 'load', lambda name: TINY[name]())
    out = tmp_path / 'study.json'
    argv = ['--task', 'gpt', '--optimizers', 'adamw', '--lrs', '0.001']
    study.main([*argv, '--seeds', '0', '--out', str(out)])
    more = ['--seeds', '0', '1', '--kfac', 'kfac', '--baselines']
    study.main([*argv, *more, '--out', str(out)])
    document = json.loads(out.read_text())
    labels = [(r['label'], r['seed']) for r in document['runs']]
    assert labels == [
        ('adamw lr=0.001', 0),
        ('adamw+kfac lr=0.001', 0),
        ('adamw lr=0.001', 1),
        ('adamw+kfac lr=0.001', 1),
    ]
    assert len(document['sessions']) == 2
    assert out.with_suffix('.png').stat().st_size > 0
    summary = study.main(['--task', 'gpt', '--report', '--out', str(out)])
    assert summary['best_baseline'] == 'adamw lr=0.001'
    assert document['runs'][1]['kfac_kwargs'] == variants.BASE_KFAC
    # the defaults against the optimizer alone: a table and a plot
    study.main(
        [*argv, '--seeds', '0', '--kfac', 'defaults', '--out', str(out)]
    )
    assert out.with_name('study_defaults.png').stat().st_size > 0
    # `--no-plot` (a GPU machine may lack matplotlib): the tables only
    plain = tmp_path / 'plain.json'
    more = ['--seeds', '0', '--kfac', 'defaults', '--baselines']
    study.main(
        [*argv, *more, '--device', 'cpu', '--no-plot', '--out', str(plain)]
    )
    assert [r['label'] for r in json.loads(plain.read_text())['runs']] == [
        'adamw lr=0.001',
        'adamw+defaults lr=0.001',
    ]
    assert json.loads(plain.read_text())['sessions'][0]['device'] == 'cpu'
    assert not list(tmp_path.glob('plain*.png'))


def test_the_defaults_variant_sets_nothing() -> None:
    argv = ['--task', 'cnn', '--optimizers', 'sgd', '--lrs', '0.1']
    args = study.parse_args([*argv, '--kfac', 'defaults', 'ekfac'])
    defaults, ekfac = study.configs(args)
    assert defaults.settings() == {}
    assert ekfac.settings() == {
        **variants.BASE_KFAC,
        'compute_method': 'ekfac',
    }


def _changed(settings: dict[str, Any]) -> set[str]:
    """The preconditioner's keywords that the configuration `settings`
    (described flat) sets to other than their defaults: a group (the
    method's config, the statistics, the Fisher) counts as one keyword.
    """
    defaults: dict[str, Any] = {
        name: parameter.default
        for name, parameter in inspect.signature(
            KFACPreconditioner
        ).parameters.items()
    }
    defaults.update(
        compute_method=InverseConfig(),
        relative_clip=1.0,
        statistics=StatisticsConfig(),
        fisher=FisherConfig(),
    )
    return {
        key
        for key, value in variants.keywords(settings).items()
        if defaults[key] != value
    }


def _keywords_of(change: dict[str, Any]) -> set[str]:
    """The keywords a flat change of `VARIANTS` lands in."""
    groups = {
        'factor_rank': 'compute_method',
        'damping_mode': 'compute_method',
        'basis_refresh': 'compute_method',
        'max_factor_dim': 'statistics',
        'position_sample': 'statistics',
        'fisher_type': 'fisher',
    }
    return {groups.get(key, key) for key in change}


@pytest.mark.parametrize('variant', sorted(variants.OVER_DEFAULTS))
def test_variants_over_the_defaults_change_one_thing(variant: str) -> None:
    """`defaults+X` sets the library's defaults explicitly and changes
    what `X` changes; the methods and the eigenbasis refresh have none.
    """
    change = variant.removeprefix('defaults+')
    task = variants.TASK_VARIANTS.get(change, 'gpt')
    argv = ['--task', task, '--optimizers', 'adamw', '--lrs', '0.005']
    (config,) = study.configs(study.parse_args([*argv, '--kfac', variant]))
    assert config.label == f'adamw+{variant} lr=0.005'
    change_of = variants.VARIANTS[change]
    assert _changed(config.settings()) == _keywords_of(change_of)
    for name in ('kfac', 'inverse', 'ekfac', 'qr', 'ekfac-qr'):
        assert f'defaults+{name}' not in variants.OVER_DEFAULTS


@pytest.mark.parametrize('variant', sorted(variants.VARIANTS))
def test_every_variant_trains(variant: str) -> None:
    """Each variant builds its preconditioner over `BASE_KFAC` and trains
    a few steps on the GPT (embeddings, a tied head, sequences) or on the
    task whose modules it names; one the library refuses fails here.
    """
    task = variants.TASK_VARIANTS.get(variant, 'gpt')
    settings = {**variants.BASE_KFAC, **variants.VARIANTS[variant]}
    config = runner.kfac_config('sgd', 0.01, variant, settings)
    record = runner.run(TINY[task](), config, seed=0)
    assert record['steps'] == 3 and not record['diverged']
    assert all(math.isfinite(e[2]) for e in record['evals'])


def test_the_inverse_variant_is_the_library_defaults() -> None:
    """The defaults' evidence (docs/study.md, "The defaults") ran as the
    variant `inverse`: it sets exactly the constructor's defaults, and a
    run with nothing set repeats its numbers bit for bit.
    """
    settings = {**variants.BASE_KFAC, **variants.VARIANTS['inverse']}
    assert _changed(settings) == set()
    task = TINY['gpt']()
    explicit = runner.run(
        task, runner.kfac_config('adamw', 0.001, 'inverse', settings), 0
    )
    defaults = runner.run(
        task, runner.kfac_config('adamw', 0.001, variants.DEFAULTS, {}), 0
    )
    assert [e[2] for e in explicit['evals']] == [
        e[2] for e in defaults['evals']
    ]


@pytest.mark.parametrize('name', [None, *step_cost.KFAC, 'sample0.5'])
def test_step_cost_trains_each_configuration(name: str | None) -> None:
    settings = None if name is None else variants.settings(name)
    ms = step_cost.cost(TINY['gpt'](), 'adamw', 0.001, settings, steps=2)
    assert math.isfinite(ms) and ms > 0


def test_step_cost_measures_eigen_and_inverse_with_the_defaults() -> None:
    """Its default configurations, `kfac` and `defaults`, are the
    library's defaults under EIGEN and under INVERSE (docs/study.md's
    measurement).
    """
    args = step_cost.parse_args(
        ['--task', 'gpt', '--optimizer', 'adamw', '--lr', '0.0015']
    )
    eigen, inverse = (variants.settings(n) for n in args.kfac)
    assert inverse == {}
    assert _changed(eigen) == {'compute_method'}
    assert eigen['compute_method'] == 'eigen'


def _grid_file(task: str, name: str) -> pathlib.Path:
    suffix = study.GRID_FILES.get(name)
    tail = '' if suffix is None else f'_{suffix}'
    return study.RESULTS / f'study_{task}{tail}.json'


def _constant_rate_runs(
    task: str, name: str
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """`name`'s committed constant-rate runs on `task` by label (none
    where its grid has no file yet), and the sign that makes a larger
    final metric better.
    """
    path = _grid_file(task, name)
    document: dict[str, Any] = (
        json.loads(path.read_text())
        if path.exists()
        else {'runs': [], 'higher_is_better': True}
    )
    grouped = analysis.groups(
        r
        for r in document['runs']
        if r['optimizer'] == name
        and r['kfac'] is None
        and r.get('schedule') is None
    )
    return grouped, 1.0 if document['higher_is_better'] else -1.0


def _median(rows: list[dict[str, Any]], sign: float) -> float:
    """The median final metric of `rows`, times `sign`."""
    return statistics.median(sign * analysis._final(r, sign > 0) for r in rows)


def test_the_committed_schedule_keeps_its_rules() -> None:
    """The scheduled GPT (`study_gpt_cosine.json`) keeps the study's grid
    rules around the constant rate: each baseline ran at learning rates a
    factor of 2 apart that include its best constant rate and both that
    rate's neighbours in its grid (read from the committed grids, not
    written here), seeds 0, 1 and 2 at each rate; and its best scheduled
    rate (the lowest median final) is at neither end of them.
    """
    path = study.RESULTS / 'study_gpt_cosine.json'
    document: dict[str, Any] = json.loads(path.read_text())
    assert {r['schedule'] for r in document['runs']} == {'cosine'}
    scheduled = analysis.groups(
        r for r in document['runs'] if r['kfac'] is None
    )
    for name, grid in study.GRIDS['gpt'].items():
        grouped, sign = _constant_rate_runs('gpt', name)
        best = max(
            grid, key=lambda lr: _median(grouped[f'{name} lr={lr:g}'], sign)
        )
        at = grid.index(best)
        rates = sorted(
            r['lr']
            for r in document['runs']
            if r['optimizer'] == name and r['kfac'] is None and r['seed'] == 0
        )
        assert {grid[at - 1], best, grid[at + 1]} <= set(rates), name
        assert all(
            math.isclose(b / a, 2.0) for a, b in itertools.pairwise(rates)
        ), (name, rates)
        medians = []
        for lr in rates:
            rows = scheduled[f'{name} lr={lr:g} cosine']
            assert {r['seed'] for r in rows} == {0, 1, 2}, (name, lr)
            medians.append(_median(rows, sign))
        top = medians.index(max(medians))
        assert 0 < top < len(rates) - 1, (name, rates[top])


@pytest.mark.parametrize('task', sorted(study.GRIDS))
def test_the_committed_grids_keep_the_studys_rules(task: str) -> None:
    """Each optimizer's grid: at least 4 learning rates a factor of 2
    apart; in the committed results (`study_TASK.json`, or the file
    `GRID_FILES` names) every grid point has 3 seeds, or exactly the
    number `SEEDS_RUN` declares for a grid still short of them, and the
    best median final metric is not at an edge of the grid. A grid with no
    committed run (a grid declared before its runs) is held to the first
    rule only, and may not be declared in `SEEDS_RUN`.
    """
    for name, grid in study.GRIDS[task].items():
        assert len(grid) >= 4
        assert all(
            math.isclose(b / a, 2.0) for a, b in itertools.pairwise(grid)
        ), name
        grouped, sign = _constant_rate_runs(task, name)
        declared = study.SEEDS_RUN.get((task, name))
        if not grouped:
            assert declared is None, (task, name)
            continue
        medians = []
        for lr in grid:
            rows = grouped[f'{name} lr={lr:g}']
            seeds = len({r['seed'] for r in rows})
            if declared is None:
                assert seeds >= 3, (name, lr)
            else:
                assert seeds == declared, (name, lr)
            medians.append(_median(rows, sign))
        best = medians.index(max(medians))
        assert 0 < best < len(grid) - 1, (name, grid[best])
