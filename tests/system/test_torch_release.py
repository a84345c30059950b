"""The floor release and its tools: `testing.torch_release` (a skip names
the release a test needs) and `make test-torch` (the suite on another
release, in a venv of its own).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from testing import torch_release
from testing.torch_release import parse_release
from testing.torch_release import requires_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ('running', 'skipped'),
    [('2.8.1', True), ('2.9.0', False), ('2.10.0+cpu', False)],
)
def test_requires_torch_skips_older_releases_naming_the_needed_one(
    monkeypatch: pytest.MonkeyPatch, running: str, skipped: bool
) -> None:
    monkeypatch.setattr(torch, '__version__', running)
    mark = requires_torch('2.9', 'torch.optim.Muon').mark
    assert mark.name == 'skipif'
    assert mark.args == (skipped,)
    assert mark.kwargs['reason'] == (
        f'needs torch>=2.9 (torch.optim.Muon); this is torch {running}'
    )


def test_the_marks_name_a_release_above_the_floor() -> None:
    """Every mark of `testing.torch_release` names a release above the
    floor of pyproject.toml (a mark at or below it would skip nothing).
    """
    pyproject = (ROOT / 'pyproject.toml').read_text()
    (floor,) = re.findall(r"'torch>=([\d.]+)'", pyproject)
    marks = (
        torch_release.COMPILED,
        torch_release.MUON,
        torch_release.FSDP2_ON_CPU,
        torch_release.HSDP_ON_CPU,
    )
    for decorator in marks:
        needed = re.match(r'needs torch>=([\d.]+)', decorator.kwargs['reason'])
        assert needed is not None
        assert parse_release(needed[1]) > parse_release(floor)


def _dry_run(spec: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which('make')
    if make is None:
        pytest.fail('make is not installed')
    # as if typed at a shell, also when the tests run under make (`make
    # test-torch` itself)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith('MAKE') and k != 'MFLAGS'
    }
    options = [f'TORCH_SPEC={spec}', 'TORCH_INDEX=', 'PYTEST_ARGS=']
    return subprocess.run(
        [make, '-n', '-B', '--no-print-directory', 'test-torch', *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_make_test_torch_installs_the_release_in_a_venv_of_its_own() -> None:
    done = _dry_run('torch==2.6.0')
    assert done.returncode == 0, done.stderr
    venv = '.venv-torch-2.6.0/bin/python'
    lines = done.stdout.splitlines()
    assert f"{venv} -m pip install --quiet  'torch==2.6.0'" in lines
    assert (
        f"{venv} -m pip install --quiet -r requirements-dev.txt 'torch==2.6.0'"
    ) in lines
    assert lines[-1].strip() == f'{venv} -m pytest -q -p no:cacheprovider'
    assert not any('lint' in line or 'mypy' in line for line in lines)
    ignored = (ROOT / '.gitignore').read_text().splitlines()
    assert '.venv-torch-*/' in ignored


def test_make_test_torch_wants_one_release() -> None:
    done = _dry_run('torch>=2.6')
    assert done.returncode != 0
    assert "name one release, e.g. TORCH_SPEC='torch==2.6.0'" in done.stderr
