"""The documentation site is complete and its code runs as written.

* Every ```python block of a page under ``docs/`` runs (the blocks of one
  page in order, sharing a namespace) without a Python warning or a
  ``WARNING`` from a ``kfac`` logger (`testing.snippets.strictly`); a
  ``print(...)`` followed by a comment ``# text`` must print exactly
  ``text``. Blocks fenced as ```py
  are shown, not run (distributed launches, GPU-only code, fragments).
* Every public name of the design contract (DESIGN.md §2) is rendered by
  the API reference: its module has a ``::: module`` directive in
  ``docs/reference/`` and it has a docstring (mkdocstrings shows only
  documented objects).
* Every module of ``kfac/`` has a reference page.
* The reference index links every reference page and names every object
  ``import kfac`` offers (``kfac.__all__``, modules aside).
* Every warning the library logs is quoted on the troubleshooting page.

``make docs`` builds the site itself (``mkdocs build --strict``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import kfac
from kfac.preconditioner import KFACPreconditioner
from testing.snippets import strictly
from testing.torch_release import COMPILED
from testing.torch_release import MUON

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs'
PAGES = sorted(DOCS.rglob('*.md'))
FENCE = re.compile(r'^```python\n(.*?)^```', re.MULTILINE | re.DOTALL)
EXPECT = re.compile(r'^(\s*)print\((.*)\)\s+#\s*(.+?)\s*$')

#: DESIGN.md §2: the public names users of the original KAISA code know.
PUBLIC_NAMES = [
    'kfac.preconditioner.KFACPreconditioner',
    'kfac.base_preconditioner.BaseKFACPreconditioner',
    'kfac.layers.base.KFACBaseLayer',
    'kfac.layers.eigen.KFACEigenLayer',
    'kfac.layers.inverse.KFACInverseLayer',
    'kfac.layers.curvature.base.Curvature',
    'kfac.layers.curvature.base.CurvatureConfig',
    'kfac.layers.modules.ModuleHelper',
    'kfac.layers.modules.LinearModuleHelper',
    'kfac.layers.modules.Conv2dModuleHelper',
    'kfac.layers.register.register_modules',
    'kfac.assignment.WorkAssignment',
    'kfac.assignment.KAISAAssignment',
    'kfac.distributed.TorchDistributedCommunicator',
    'kfac.distributed.get_rank',
    'kfac.distributed.get_world_size',
    'kfac.distributed.get_triu',
    'kfac.distributed.fill_triu',
    'kfac.enums.AllreduceMethod',
    'kfac.enums.AssignmentStrategy',
    'kfac.enums.ComputeMethod',
    'kfac.enums.DistributedStrategy',
    'kfac.scheduler.LambdaParamScheduler',
    'kfac.hyperparams.Hyperparameters',
    'kfac.optimizer.KFACOptimizer',
]


def _runnable(text: str) -> list[str]:
    """The page's ```python blocks, with checked prints rewritten."""
    blocks = []
    for block in FENCE.findall(text):
        lines = []
        for line in block.splitlines():
            match = EXPECT.match(line)
            if match:
                indent, args, expected = match.groups()
                line = f'{indent}__expect({expected!r}, {args})'
            lines.append(line)
        blocks.append('\n'.join(lines) + '\n')
    return blocks


def _expect(expected: str, *args: Any) -> None:
    printed = ' '.join(str(arg) for arg in args)
    print(printed)
    assert printed == expected, (
        f'printed {printed!r}, the page says {expected!r}'
    )


NEEDS: dict[str, pytest.MarkDecorator] = {
    'guide/compile.md': COMPILED,
    'guide/muon.md': MUON,
}
"""What a page's code needs of torch, where it needs more than the floor."""


@pytest.mark.parametrize(
    'page',
    [
        pytest.param(p, marks=NEEDS.get(str(p.relative_to(DOCS)), ()))
        for p in PAGES
        if _runnable(p.read_text())
    ],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_page_code_runs(
    page: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.chdir(tmp_path)
    # One thread: on a busy machine OpenMP's barriers make small matrix
    # products and eigh calls with several threads 100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    namespace: dict[str, Any] = {'__name__': 'docs', '__expect': _expect}
    with strictly(str(page.relative_to(DOCS))):
        for block in _runnable(page.read_text()):
            exec(compile(block, str(page), 'exec'), namespace)


def test_a_logged_warning_fails_the_page() -> None:
    # What the pages once did: a second preconditioner on hooked modules.
    model = nn.Linear(3, 2)
    first = KFACPreconditioner(model)
    hooks = 'already has the hooks'
    with pytest.raises(AssertionError, match=hooks), strictly('page'):
        KFACPreconditioner(model).remove()
    first.remove()


def test_a_python_warning_fails_the_page() -> None:
    # A snippet whose code warns (here, directly) fails its page.
    with (
        pytest.raises(UserWarning, match='a snippet warned'),
        strictly('page'),
    ):
        warnings.warn('a snippet warned', UserWarning, stacklevel=1)


def test_checked_prints_are_found() -> None:
    # The rewriting above must see the pages' checked prints at all.
    text = (DOCS / 'getting-started.md').read_text()
    assert any('__expect(' in block for block in _runnable(text))


def _reference_modules() -> set[str]:
    found = set()
    for page in (DOCS / 'reference').glob('*.md'):
        found.update(re.findall(r'^::: (kfac[\w.]*)', page.read_text(), re.M))
    return found


@pytest.mark.parametrize('path', PUBLIC_NAMES)
def test_public_name_is_in_the_api_reference(path: str) -> None:
    module_name, name = path.rsplit('.', 1)
    module = importlib.import_module(module_name)
    obj = getattr(module, name)
    assert module_name in _reference_modules(), (
        f'no page renders {module_name}'
    )
    assert inspect.getdoc(obj), f'{path} has no docstring, so no API entry'
    # Defined there, or re-exported in its __all__ (rendered there too).
    exported = name in getattr(module, '__all__', ())
    assert inspect.getmodule(obj) is module or exported, (
        f'{path} is defined elsewhere and not re-exported'
    )


def test_reference_index_links_every_page() -> None:
    index = (DOCS / 'reference' / 'index.md').read_text()
    linked = set(re.findall(r'\]\((\w+\.md)\)', index))
    pages = {p.name for p in (DOCS / 'reference').glob('*.md')}
    missing = sorted(pages - linked - {'index.md'})
    assert not missing, f'reference/index.md does not link {missing}'


def test_reference_index_names_the_top_level() -> None:
    index = (DOCS / 'reference' / 'index.md').read_text()
    named = set(re.findall(r'`(?:kfac\.)?(\w+)`', index))
    offered = {
        name
        for name in kfac.__all__
        if not name.startswith('__')
        and not inspect.ismodule(getattr(kfac, name))
    }
    assert offered, 'the scan must find what kfac offers'
    missing = sorted(offered - named)
    assert not missing, f'reference/index.md does not name {missing}'


def _modules() -> set[str]:
    modules = {
        '.'.join(p.relative_to(ROOT).with_suffix('').parts)
        for p in (ROOT / 'kfac').rglob('*.py')
    }
    return {m.removesuffix('.__init__') for m in modules} - {'kfac'}


def _private(module: str) -> bool:
    return any(part.startswith('_') for part in module.split('.'))


def test_every_public_module_has_a_reference_page() -> None:
    public = {m for m in _modules() if not _private(m)}
    missing = sorted(public - _reference_modules())
    assert not missing, f'modules without an API reference page: {missing}'


def test_no_private_module_has_a_reference_page() -> None:
    private = {m for m in _modules() if _private(m)}
    assert private, 'the scan must find the private modules'
    shown = sorted(private & _reference_modules())
    assert not shown, f'private modules with a reference page: {shown}'


def _logged_warnings() -> list[tuple[str, str]]:
    """``(file, message)`` of every warning kfac logs."""
    found = []
    for source in sorted((ROOT / 'kfac').rglob('*.py')):
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute):
                attr = func.attr
            elif isinstance(func, ast.Name):
                attr = func.id
            else:
                continue
            index = {
                'warning': 0,
                'error': 0,
                '_log_once': 2,
                'log_once': 2,
                'once': 2,
            }.get(attr)
            if index is None or len(node.args) <= index:
                continue
            message = node.args[index]
            if isinstance(message, ast.Constant) and isinstance(
                message.value, str
            ):
                found.append((source.name, message.value))
    return found


def _key_phrase(message: str) -> str:
    """The longest piece of ``message`` between %-placeholders."""
    pieces = re.split(r'%[-#0 +]*\d*(?:\.\d+)?[sdrfg]', message)
    return ' '.join(max(pieces, key=len).split())


def test_library_logs_warnings() -> None:
    # The scan must find the warnings it checks below.
    assert len(_logged_warnings()) >= 3


@pytest.mark.parametrize(
    'message',
    [m for _, m in _logged_warnings()],
    ids=lambda m: _key_phrase(m)[:40],
)
def test_warning_is_explained(message: str) -> None:
    page = ' '.join(
        (DOCS / 'guide' / 'troubleshooting.md').read_text().split()
    )
    phrase = _key_phrase(message)
    assert phrase in page, (
        f'docs/guide/troubleshooting.md does not quote the warning '
        f'{message!r} (looked for {phrase!r})'
    )


def _scaled_training(unscale_first: bool, **options: Any) -> torch.Tensor:
    """Ten steps of a GradScaler loop; the parameters at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0**10)
    preconditioner = KFACPreconditioner(
        model,
        optimizer=optimizer,
        grad_scaler=scaler,
        factor_update_steps=1,
        inv_update_steps=1,
        **options,
    )
    data = torch.Generator().manual_seed(1)
    for _ in range(10):
        x = torch.randn(32, 6, generator=data)
        y = torch.randint(0, 3, (32,), generator=data)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        preconditioner.step()
        scaler.step(optimizer)
        scaler.update()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    ('options', 'order_matters'),
    [
        ({}, False),
        ({'relative_clip': None}, False),
        ({'kl_clip': 0.001}, True),
    ],
    ids=['relative', 'no-clip', 'kl'],
)
def test_unscale_order_matters_only_with_the_kl_clip(
    options: dict[str, Any], order_matters: bool
) -> None:
    # guide/mixed-precision.md: under the default relative clip (or
    # without a clip) preconditioning before unscale_ gives the same
    # update; with a kl_clip the KL clip sees the loss scale.
    first = _scaled_training(True, **options)
    after = _scaled_training(False, **options)
    same = torch.allclose(first, after, rtol=1e-5, atol=1e-7)
    assert same is not order_matters, (
        f'{options}: the two orders differ by '
        f'{float((first - after).norm() / first.norm()):.2e} (relative)'
    )
