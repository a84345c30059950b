"""``make gpu-check``: the library's CUDA and NCCL paths on this machine.

Usage::

    make gpu-check                           # the whole check, ~8 min at most
    python3 scripts/gpu_check.py --dry-run   # print the commands, run none
    python3 scripts/gpu_check.py --stages oracles ddp-nccl

It runs on the interpreter that starts it, with that interpreter's torch and
pytest: no virtual environment, nothing installed (a GPU machine may have
another Python and torch than ``make venv`` pins, and no package index).
``make gpu-check`` starts it with ``$(PYTHON)`` (``python3``) and puts the
checkout first on ``PYTHONPATH``. It imports only the standard library and
torch; the stages need pytest (hypothesis is not needed). Without torch or
without a CUDA device it prints ``SKIP`` and why, and exits 0: the CPU
suite (``make test``) never depends on it.

Stages, each a process group of its own with its own time limit (together
at most ``--budget``, 470 s unless told):

* ``oracles``: ``tests/system/test_oracles.py`` with ``KFAC_TEST_DEVICE=cuda``:
  the factors, preconditioned gradients, KL clip, running averages and
  accumulation against dense float64 references, in float64 and float32;
  ``torch.autocast`` with ``torch.amp.GradScaler('cuda')`` and with the
  deprecated ``torch.cuda.amp.GradScaler``.
* ``robustness``: ``tests/system/test_robustness.py`` on CUDA (non-finite
  statistics, failed decompositions, ``GradScaler`` overflow).
* ``host-syncs``: ``tests/system/test_host_syncs.py`` on CUDA: host reads
  counted in Python, and CUDA synchronisations counted by PyTorch's sync
  debug mode, per step, for 3 and 9 layers.
* ``ddp-nccl``: ``tests/system/test_ddp_oracle.py`` with NCCL, one rank per
  GPU: world size 1 and each of 2-4 the GPUs allow.
* ``bench-<model>``: ``python -m benchmarks --device cuda`` for the MLP,
  ResNet-20 and the transformer, 30 timed steps each (``make bench``
  without its CPU-only scaling study and gloo byte check).

The check ends with one summary: Python, torch, CUDA, cuDNN, NCCL and the
GPUs, then per stage PASS, FAIL, TIMEOUT or SKIP with its time, test counts,
the largest relative error of the oracles and, for the benchmarks, the
step time of SGD and K-FAC's 10/100 cost as a multiple of it. The logs,
JUnit XML, benchmark JSON and ``summary.json`` are in ``build/gpu-check/``.
The exit status is 1 when a stage failed, timed out or found no time left.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Seconds all stages together may take, unless ``--budget`` says.
BUDGET_S = 470.0
#: Seconds a stage's process group gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 10.0
#: Test stages: name, test file, time limit in seconds.
TEST_STAGES = (
    ('oracles', 'tests/system/test_oracles.py', 80.0),
    ('robustness', 'tests/system/test_robustness.py', 50.0),
    ('host-syncs', 'tests/system/test_host_syncs.py', 40.0),
    ('ddp-nccl', 'tests/system/test_ddp_oracle.py', 110.0),
)
#: Benchmarked models, timed steps per configuration, seconds per model.
BENCH_MODELS = ('mlp', 'resnet20', 'transformer')
BENCH_STEPS = 30
BENCH_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this interpreter offers; ``skip`` says why nothing can run."""

    python: str
    torch: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    gpus: tuple[str, ...] = ()
    pytest: str | None = None
    skip: str | None = None

    def lines(self) -> list[str]:
        """The machine part of the summary."""
        return [
            f'python  {self.python}',
            f'torch   {self.torch or "-"}, CUDA {self.cuda or "-"}, '
            f'cuDNN {self.cudnn or "-"}, NCCL {self.nccl or "-"}',
            f'GPUs    {len(self.gpus)}: {"; ".join(self.gpus) or "-"}',
            f'pytest  {self.pytest or "absent"}',
        ]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One command of the check."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    env: tuple[tuple[str, str], ...] = ()
    junit: pathlib.Path | None = None
    bench: pathlib.Path | None = None
    skip: str | None = None

    def shell(self) -> str:
        """The command as a shell line, its extra environment first."""
        env = [f'{k}={shlex.quote(v)}' for k, v in self.env]
        return ' '.join([*env, shlex.join(self.argv)])


@dataclasses.dataclass(frozen=True)
class Result:
    """How a stage ended: PASS, FAIL, TIMEOUT or SKIP."""

    name: str
    status: str
    seconds: float = 0.0
    details: str = ''

    @property
    def failed(self) -> bool:
        """Whether the stage counts against the check."""
        return self.status in ('FAIL', 'TIMEOUT')


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> Machine:
    """Import torch and describe Python, torch and the GPUs."""
    python = f'{sys.version.split()[0]} ({sys.executable})'
    pytest = _version('pytest')
    try:
        import torch
    except (ImportError, OSError) as err:
        why = f'no torch: {sys.executable} cannot import it ({err})'
        return Machine(python, pytest=pytest, skip=why)
    version, cuda = torch.__version__, torch.version.cuda
    if not torch.cuda.is_available():
        why = 'no CUDA device: ' + (
            f'torch {version} is a CPU-only build'
            if cuda is None
            else f'torch {version} (CUDA {cuda}) sees none (CUDA_VISIBLE_'
            f'DEVICES={os.environ.get("CUDA_VISIBLE_DEVICES")!r})'
        )
        return Machine(python, version, cuda, pytest=pytest, skip=why)
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            f'{props.name} ({props.total_memory / 2**30:.0f} GiB, '
            f'sm_{props.major}{props.minor})'
        )
    nccl = None
    if torch.distributed.is_available() and (
        torch.distributed.is_nccl_available()
    ):
        # (major, minor, patch); an int in older torch
        found = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        parts = found if isinstance(found, tuple) else (found,)
        nccl = '.'.join(str(p) for p in parts)
    cudnn = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]  # as above
    return Machine(python, version, cuda, cudnn, nccl, tuple(gpus), pytest)


def plan(
    machine: Machine, out_dir: pathlib.Path, python: str = sys.executable
) -> list[Stage]:
    """The stages for ``machine``, writing under ``out_dir``."""
    given = os.environ.get('PYTHONPATH', '').split(os.pathsep)
    path = os.pathsep.join(dict.fromkeys(p for p in (str(ROOT), *given) if p))
    stages = []
    for name, test_file, timeout in TEST_STAGES:
        skip = None if machine.pytest else f'{python} has no pytest'
        if skip is None and name == 'ddp-nccl' and machine.nccl is None:
            skip = 'this torch has no NCCL'
        junit = out_dir / f'{name}.xml'
        argv = [python, '-m', 'pytest', '-q', '-ra', '-p', 'no:cacheprovider']
        # addopts would add --doctest-modules and --strict-markers (the
        # timeout marker needs pytest-timeout, which may be absent)
        argv += ['-o', 'addopts=', f'--junitxml={junit}', test_file]
        env = (('PYTHONPATH', path), ('KFAC_TEST_DEVICE', 'cuda'))
        stages.append(
            Stage(name, tuple(argv), timeout, env, junit=junit, skip=skip)
        )
    for model in BENCH_MODELS:
        out = out_dir / f'bench-{model}.json'
        argv = [python, '-m', 'benchmarks', '--device', 'cuda']
        argv += ['--models', model, '--steps', str(BENCH_STEPS)]
        argv += ['--fi-steps', '3', '--full-cycle', '--no-scaling']
        argv += ['--no-bytecheck', '--out', str(out)]
        stages.append(
            Stage(
                f'bench-{model}',
                tuple(argv),
                BENCH_TIMEOUT_S,
                (('PYTHONPATH', path),),
                bench=out,
            )
        )
    return stages


def _kill_group(leader: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group of ``leader``, then SIGKILL what is left.

    The group outlives its leader while a member (a rank, a stray child)
    runs; the leader is reaped here, so its own zombie does not keep the
    group alive.
    """
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 0)):
        try:
            os.killpg(leader.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            leader.poll()
            try:
                os.killpg(leader.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def execute(stage: Stage, log: pathlib.Path, timeout_s: float) -> Result:
    """Run ``stage`` in a new process group; kill the group at the end."""
    start = time.monotonic()
    env = {**os.environ, **dict(stage.env)}
    with log.open('w') as out:
        process = subprocess.Popen(
            stage.argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # ranks or a hung child: none outlives the stage
            _kill_group(process)
            process.wait()
    seconds = time.monotonic() - start
    if code is None:
        return Result(stage.name, 'TIMEOUT', seconds, f'over {timeout_s:g} s')
    return judge(stage, code, seconds, log)


def judge(
    stage: Stage, code: int, seconds: float, log: pathlib.Path
) -> Result:
    """The result of a stage that exited with ``code``."""
    if stage.bench is not None:
        if code != 0 or not stage.bench.exists():
            return Result(stage.name, 'FAIL', seconds, f'exit code {code}')
        return Result(stage.name, 'PASS', seconds, bench_headline(stage.bench))
    counts, cases = junit_cases(stage.junit) if stage.junit else ({}, [])
    parts = [f'{n} {what}' for what, n in counts.items() if n]
    worst = re.findall(r'^overall\s+(\S+)$', log.read_text(), re.MULTILINE)
    if worst:
        parts.append(f'worst relative error {worst[-1]}')
    failing = [
        name for name, outcome in cases if outcome in ('failed', 'error')
    ]
    if failing:
        parts.append('failing: ' + ', '.join(failing[:4]))
    if stage.name == 'ddp-nccl':
        parts.append(world_sizes(cases))
    details = '; '.join(parts) or f'exit code {code}'
    if code != 0:
        return Result(stage.name, 'FAIL', seconds, details)
    status = 'PASS' if counts.get('passed') else 'SKIP'
    return Result(stage.name, status, seconds, details)


def junit_cases(
    path: pathlib.Path,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Outcome counts and ``(test id, outcome)`` from a JUnit XML file."""
    if not path.exists():
        return {}, []
    cases = []
    for case in ET.parse(path).getroot().iter('testcase'):
        outcome = 'passed'
        for child in case:
            if child.tag in ('failure', 'error', 'skipped'):
                outcome = {'failure': 'failed'}.get(child.tag, child.tag)
        cases.append((case.get('name', '?'), outcome))
    counts = dict.fromkeys(('passed', 'failed', 'error', 'skipped'), 0)
    for _, outcome in cases:
        counts[outcome] += 1
    return counts, cases


def world_sizes(cases: Sequence[tuple[str, str]]) -> str:
    """Which world sizes of the DDP oracle ran and which were skipped."""
    by_outcome: dict[str, list[str]] = {}
    for name, outcome in cases:
        size = re.search(r'\[(\d+)\]$', name)
        if size:
            by_outcome.setdefault(outcome, []).append(size.group(1))
    ran = [
        s for o, sizes in by_outcome.items() if o != 'skipped' for s in sizes
    ]
    skipped = by_outcome.get('skipped', [])
    return (
        f'NCCL world sizes run: {", ".join(sorted(ran)) or "none"}'
        f' (skipped: {", ".join(sorted(skipped)) or "none"})'
    )


def bench_headline(path: pathlib.Path) -> str:
    """SGD's step time and K-FAC's 10/100 cost as a multiple of it."""
    result: dict[str, Any] = json.loads(path.read_text())
    parts = []
    for model, data in result.get('models', {}).items():
        configs = data.get('configs', {})
        sgd_ms = 1e3 * data.get('sgd_seconds', {}).get('median', 0.0)
        ratios = [
            f'{method} {configs[key]["cycle"]["ratio_to_sgd"]:.2f}x'
            for method in ('eigen', 'inverse')
            if (key := f'{method} 10/100') in configs
        ]
        parts.append(f'{model}: SGD {sgd_ms:.2f} ms, ' + ', '.join(ratios))
    return '; '.join(parts) or 'no model in the JSON'


def run(
    stages: Sequence[Stage], out_dir: pathlib.Path, budget_s: float
) -> list[Result]:
    """Run ``stages`` in turn within ``budget_s`` seconds in all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    results = []
    for stage in stages:
        left = deadline - time.monotonic()
        if stage.skip is not None:
            result = Result(stage.name, 'SKIP', details=stage.skip)
        elif left < 5:
            why = f'not run: the {budget_s:g} s budget is spent'
            result = Result(stage.name, 'FAIL', details=why)
        else:
            timeout = min(stage.timeout_s, left)
            print(f'[{stage.name}] {stage.shell()}', flush=True)
            result = execute(stage, out_dir / f'{stage.name}.log', timeout)
        print(f'[{stage.name}] {result.status} {result.details}', flush=True)
        results.append(result)
    return results


def summary(
    machine: Machine, results: Sequence[Result], out_dir: pathlib.Path
) -> str:
    """The block printed at the end."""
    rule = '=' * 79
    lines = [f'{" gpu-check summary ":=^79}', *machine.lines(), '']
    lines.append(f'{"stage":<18}{"result":<9}{"seconds":>8}  details')
    for r in results:
        lines.append(
            f'{r.name:<18}{r.status:<9}{r.seconds:>8.1f}  {r.details}'
        )
    failed = [r.name for r in results if r.failed]
    verdict = f'FAIL ({", ".join(failed)})' if failed else 'PASS'
    total = sum(r.seconds for r in results)
    lines += [
        '',
        f'result  {verdict}: {len(results) - len(failed)} of {len(results)} '
        f'stages passed or skipped, {total:.0f} s; logs in {out_dir}',
        rule,
    ]
    return '\n'.join(lines)


def _parser() -> argparse.ArgumentParser:
    names = [name for name, _, _ in TEST_STAGES]
    names += [f'bench-{model}' for model in BENCH_MODELS]
    parser = argparse.ArgumentParser(
        prog='scripts/gpu_check.py',
        description='The CUDA and NCCL paths here (make gpu-check).',
    )
    parser.add_argument(
        '--dry-run',
        action='store_true',
        help='print the commands of each stage and run none',
    )
    parser.add_argument(
        '--stages', nargs='+', choices=names, help='run only these stages'
    )
    parser.add_argument(
        '--budget',
        type=float,
        default=BUDGET_S,
        help='seconds all stages together may take (default %(default)g)',
    )
    parser.add_argument(
        '--out-dir', type=pathlib.Path, default=ROOT / 'build' / 'gpu-check'
    )
    return parser


def dry_run(machine: Machine, stages: Sequence[Stage]) -> None:
    """Print what a run would do on ``machine``."""
    if machine.skip is not None:
        print(f'gpu-check: {machine.skip}; a run on one GPU would be:')
    for stage in stages:
        state = f'skip: {stage.skip}' if stage.skip else 'run'
        print(f'[{stage.name}] {state}, at most {stage.timeout_s:g} s')
        print(f'    {stage.shell()}')


def main(argv: Sequence[str] | None = None) -> int:
    """Probe the machine, then skip, print the plan, or run the check."""
    args = _parser().parse_args(argv)
    machine = probe()
    if machine.skip is not None and not args.dry_run:
        print(f'gpu-check: SKIP: {machine.skip}; python {machine.python}')
        return 0
    # a dry run without CUDA shows what a CUDA build (with NCCL) would run
    assumed = machine.nccl or ('(assumed)' if machine.skip else None)
    stages = plan(dataclasses.replace(machine, nccl=assumed), args.out_dir)
    if args.stages:
        stages = [s for s in stages if s.name in args.stages]
    if args.dry_run:
        dry_run(machine, stages)
        return 0
    results = run(stages, args.out_dir, args.budget)
    report = summary(machine, results, args.out_dir)
    print(report)
    (args.out_dir / 'summary.json').write_text(
        json.dumps(
            {
                'machine': dataclasses.asdict(machine),
                'stages': [dataclasses.asdict(r) for r in results],
            },
            indent=1,
        )
    )
    return 1 if any(r.failed for r in results) else 0


if __name__ == '__main__':
    raise SystemExit(main())
