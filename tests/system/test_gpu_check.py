"""``scripts/gpu_check.py`` (``make gpu-check``) without a GPU: its plan,
its skip, its dry run, how it judges and reports stages, and that a stage
past its time limit is stopped with every process it started.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap
import time

import pytest
import torch

from scripts import gpu_check
from scripts.gpu_check import Machine
from scripts.gpu_check import Result
from scripts.gpu_check import Stage

CUDA_MACHINE = Machine(
    python='3.12.3 (/usr/bin/python3)',
    torch='2.11.0+cu128',
    cuda='12.8',
    cudnn='91002',
    nccl='2.27.3',
    gpus=('NVIDIA H200 (140 GiB, sm_90)',),
    pytest='8.3.5',
)


def test_plan_runs_the_tests_on_cuda_and_the_benchmarks_on_the_gpu(
    tmp_path: pathlib.Path,
) -> None:
    stages = gpu_check.plan(CUDA_MACHINE, tmp_path, python='python3')
    by_name = {stage.name: stage for stage in stages}
    assert list(by_name) == [
        'oracles',
        'robustness',
        'host-syncs',
        'ddp-nccl',
        'bench-mlp',
        'bench-resnet20',
        'bench-transformer',
    ]
    assert all(stage.skip is None for stage in stages)
    assert sum(s.timeout_s for s in stages) <= gpu_check.BUDGET_S <= 8 * 60
    for stage in stages:
        env = dict(stage.env)
        assert env['PYTHONPATH'].split(os.pathsep)[0] == str(gpu_check.ROOT)
        assert stage.argv[0] == 'python3'
        if stage.junit is not None:
            assert env['KFAC_TEST_DEVICE'] == 'cuda'
            assert stage.argv[1:3] == ('-m', 'pytest')
            assert (gpu_check.ROOT / stage.argv[-1]).is_file()
            assert stage.junit.parent == tmp_path
        else:
            assert stage.bench == tmp_path / f'{stage.name}.json'
            assert stage.argv[stage.argv.index('--device') + 1] == 'cuda'
            assert '--no-scaling' in stage.argv


def test_plan_skips_what_the_machine_lacks(tmp_path: pathlib.Path) -> None:
    machine = Machine(python='3.12', torch='2.11', cuda='12.8', pytest='8')
    skips = {s.name: s.skip for s in gpu_check.plan(machine, tmp_path)}
    assert skips['ddp-nccl'] == 'this torch has no NCCL'
    assert skips['oracles'] is None
    machine = Machine(python='3.12', torch='2.11', cuda='12.8', nccl='2')
    skips = {s.name: s.skip for s in gpu_check.plan(machine, tmp_path)}
    assert skips['oracles'] is not None and 'no pytest' in skips['oracles']
    assert skips['bench-mlp'] is None


def test_the_probe_skips_exactly_when_torch_sees_no_gpu() -> None:
    machine = gpu_check.probe()
    assert (machine.skip is None) == torch.cuda.is_available()
    assert machine.torch == torch.__version__


def refuse(stage: Stage, log: pathlib.Path, timeout_s: float) -> Result:
    raise AssertionError(f'{stage.name} must not run')


def test_without_cuda_the_check_says_why_and_succeeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    why = 'no CUDA device: torch 2.13.0+cpu is a CPU-only build'
    monkeypatch.setattr(gpu_check, 'probe', lambda: Machine('3', skip=why))
    monkeypatch.setattr(gpu_check, 'execute', refuse)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.startswith(f'gpu-check: SKIP: {why}')


def test_dry_run_prints_every_command_and_runs_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check, 'probe', lambda: CUDA_MACHINE)
    monkeypatch.setattr(gpu_check, 'execute', refuse)
    argv = ['--dry-run', '--stages', 'oracles', 'bench-mlp']
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert '[oracles] run, at most 80 s' in out
    assert 'KFAC_TEST_DEVICE=cuda ' in out
    assert 'tests/system/test_oracles.py' in out
    assert '-m benchmarks --device cuda --models mlp' in out
    assert 'ddp-nccl' not in out


def write_junit(path: pathlib.Path, cases: dict[str, str]) -> None:
    body = {
        'passed': '',
        'failed': '<failure message="boom"/>',
        'skipped': '<skipped message="no"/>',
    }
    rows = ''.join(
        f'<testcase classname="t" name="{name}">{body[outcome]}</testcase>'
        for name, outcome in cases.items()
    )
    path.write_text(f'<testsuites><testsuite>{rows}</testsuite></testsuites>')


def test_judge_counts_the_junit_outcomes_and_reads_the_worst_error(
    tmp_path: pathlib.Path,
) -> None:
    junit, log = tmp_path / 'o.xml', tmp_path / 'o.log'
    write_junit(junit, {'a': 'passed', 'b[1]': 'failed', 'c': 'skipped'})
    log.write_text('...\noverall                   4.147e-05\n1 failed\n')
    stage = Stage('oracles', ('x',), 1.0, junit=junit)
    result = gpu_check.judge(stage, 1, 2.0, log)
    assert result == Result(
        'oracles',
        'FAIL',
        2.0,
        '1 passed; 1 failed; 1 skipped; worst relative error 4.147e-05; '
        'failing: b[1]',
    )
    write_junit(junit, {'a': 'skipped'})
    assert gpu_check.judge(stage, 0, 1.0, log).status == 'SKIP'
    write_junit(junit, {'a': 'passed'})
    assert gpu_check.judge(stage, 0, 1.0, log).status == 'PASS'


def test_judge_names_the_nccl_world_sizes(tmp_path: pathlib.Path) -> None:
    junit, log = tmp_path / 'd.xml', tmp_path / 'd.log'
    write_junit(
        junit,
        {f't[{w}]': 'passed' if w == 1 else 'skipped' for w in (1, 2, 3, 4)},
    )
    log.write_text('')
    stage = Stage('ddp-nccl', ('x',), 1.0, junit=junit)
    result = gpu_check.judge(stage, 0, 1.0, log)
    assert result.status == 'PASS'
    assert result.details.endswith(
        'NCCL world sizes run: 1 (skipped: 2, 3, 4)'
    )


def test_judge_reads_the_benchmark_headline(tmp_path: pathlib.Path) -> None:
    out = tmp_path / 'bench-mlp.json'
    stage = Stage('bench-mlp', ('x',), 1.0, bench=out)
    assert gpu_check.judge(stage, 0, 1.0, out).status == 'FAIL'  # no JSON
    cycle = {'cycle': {'ratio_to_sgd': 1.234}}
    configs = {'SGD': {}, 'eigen 10/100': cycle, 'inverse 10/100': cycle}
    model = {'sgd_seconds': {'median': 0.002}, 'configs': configs}
    out.write_text(json.dumps({'models': {'mlp': model}}))
    assert gpu_check.judge(stage, 0, 1.0, out) == Result(
        'bench-mlp',
        'PASS',
        1.0,
        'mlp: SGD 2.00 ms, eigen 1.23x, inverse 1.23x',
    )
    assert gpu_check.judge(stage, 1, 1.0, out).status == 'FAIL'


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(')', 1)[1].split()[0] != 'Z'


@pytest.mark.skipif(sys.platform != 'linux', reason='reads /proc')
def test_a_run_reports_every_stage_and_fails_on_a_timeout(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    test_file = tmp_path / 'test_tiny.py'
    test_file.write_text(
        textwrap.dedent(
            """
            import pytest

            def test_passes():
                pass

            def test_skips():
                pytest.skip('not here')
            """
        )
    )
    pid_file = tmp_path / 'grandchild.pid'
    hang = (
        'import subprocess, sys, time\n'
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)'])\n"
        f'open({str(pid_file)!r}, "w").write(str(child.pid))\n'
        'time.sleep(60)\n'
    )
    junit = tmp_path / 'tiny.xml'
    tiny = (
        *(sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider'),
        *(f'--junitxml={junit}', str(test_file)),
    )
    stages = [
        Stage('tiny', tiny, 60.0, junit=junit),
        Stage('hang', (sys.executable, '-c', hang), 1.0),
    ]
    monkeypatch.setattr(gpu_check, 'probe', lambda: CUDA_MACHINE)
    monkeypatch.setattr(gpu_check, 'plan', lambda *args: stages)
    start = time.monotonic()
    assert gpu_check.main(['--out-dir', str(tmp_path / 'out')]) == 1
    assert time.monotonic() - start < 30
    out = capsys.readouterr().out
    assert 'NVIDIA H200' in out
    assert '1 passed; 1 skipped' in out
    assert 'hang              TIMEOUT' in out
    assert 'result  FAIL (hang): 1 of 2 stages passed or skipped' in out
    assert not alive(int(pid_file.read_text()))
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert [s['status'] for s in summary['stages']] == ['PASS', 'TIMEOUT']


def test_a_spent_budget_fails_the_stages_left(
    tmp_path: pathlib.Path,
) -> None:
    stage = Stage('late', (sys.executable, '-c', 'pass'), 10.0)
    (result,) = gpu_check.run([stage], tmp_path, budget_s=1.0)
    assert result.status == 'FAIL'
    assert result.details == 'not run: the 1 s budget is spent'
