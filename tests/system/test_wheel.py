"""The wheel holds the package and nothing else of the repository.

The wheel is built as ``make dist`` builds it, but with the venv's
setuptools (no build isolation, so nothing is downloaded) and from a copy
of the checkout without what git ignores, so that the build's ``build/``
and ``*.egg-info`` stay out of the working tree. Its files are compared
with the package's files in the checkout: every module of ``kfac/`` and
``py.typed``, and no test, test utility, benchmark, example or result.
"""

from __future__ import annotations

import email.parser
import pathlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest

import kfac

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What git ignores (``.gitignore``) and ``.git`` itself.
IGNORED = shutil.ignore_patterns(
    '.git',
    '.venv*',
    '__pycache__',
    '*.pyc',
    '.coverage*',
    'htmlcov',
    '.mypy_cache',
    '.ruff_cache',
    '.pytest_cache',
    '.hypothesis',
    '*.egg-info',
    'build',
    'dist',
    'site',
    '.tox',
)
#: Folders of the repository that must not ship.
NOT_SHIPPED = ('tests', 'testing', 'benchmarks', 'examples', 'docs', 'scripts')


@pytest.fixture(scope='module')
def wheel(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp('wheel')
    source = tmp / 'source'
    shutil.copytree(ROOT, source, ignore=IGNORED)
    subprocess.run(
        [
            *(sys.executable, '-m', 'pip', 'wheel', '--no-deps'),
            *('--no-build-isolation', '--quiet', '--wheel-dir', str(tmp)),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = tmp.glob('*.whl')
    with zipfile.ZipFile(built) as archive:
        yield archive


def _package_files() -> set[str]:
    """The files of ``kfac/`` in the checkout that a wheel must hold."""
    files = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / 'kfac').rglob('*.py')
    }
    return files | {'kfac/py.typed'}


def test_wheel_holds_the_package_and_py_typed(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    package = {name for name in names if name.startswith('kfac/')}
    assert 'kfac/py.typed' in package
    assert package == _package_files()


def test_wheel_holds_nothing_else(wheel: zipfile.ZipFile) -> None:
    metadata = f'kfac_pytorch-{kfac.__version__}.dist-info/'
    others = sorted(
        name
        for name in wheel.namelist()
        if not name.startswith(('kfac/', metadata))
    )
    assert not others, f'the wheel holds files outside kfac/: {others}'
    top = {name.split('/', 1)[0] for name in wheel.namelist()}
    assert not top & set(NOT_SHIPPED)
    results = [name for name in wheel.namelist() if 'results' in name]
    assert not results, f'the wheel holds results: {results}'


def test_wheel_metadata_reads_the_one_version(wheel: zipfile.ZipFile) -> None:
    (name,) = [
        n for n in wheel.namelist() if n.endswith('.dist-info/METADATA')
    ]
    metadata = email.parser.Parser().parsestr(wheel.read(name).decode())
    assert metadata['Name'] == 'kfac-pytorch'
    assert metadata['Version'] == kfac.__version__
    requires = metadata.get_all('Requires-Dist') or []
    assert [r for r in requires if r.startswith('torch')], requires
    assert metadata['License-Expression'] == 'MIT'
    licence = f'kfac_pytorch-{kfac.__version__}.dist-info/licenses/LICENSE'
    assert 'Permission is hereby granted' in wheel.read(licence).decode()
