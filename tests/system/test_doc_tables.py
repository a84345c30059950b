"""The documentation's tables and examples are held to the code.

* Every keyword argument of `KFACPreconditioner` has a row in the options
  tables of ``docs/guide/hyperparameters.md``, whose default column gives
  its real default.
* Every argument of `KFACPreconditioner` has a row in the constructor error
  table of ``docs/guide/troubleshooting.md``; each error (or warning) a row
  names comes with an example, ``` `TypeError` (`damping='x'`) ```, which
  the test passes to the constructor: it must raise exactly that.
* The phase list of ``docs/guide/how-kfac-works.md`` is
  `kfac.tracing.PHASES`, in order.
* The registration report shown on the troubleshooting page is what its
  code logs, character for character.
* Every ```python block of ``README.md`` runs (in order, one namespace)
  without a warning (`testing.snippets.strictly`), and a
  ``print(...)  # text`` prints ``text``; a block of the README or the
  docs fenced ```py (shown, not run) needs a process group, a distributed
  checkpoint or a GPU.
* No code block passes `lr=` to the preconditioner: the docs recommend
  `optimizer=` (`lr=` is kept for scripts written for the original).
* A code block shown but not run says in a comment what each name it
  reads but does not define is (``Net``, ``loader``: the reader's own).
* The README and the docs' first pages state pyproject.toml's torch floor.
* The checkpoints page gives `kfac.state`'s format version and the
  versions it loads.
"""

from __future__ import annotations

import ast
import builtins
import enum
import inspect
import io
import logging
import pathlib
import re
import tokenize
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from kfac.state import READABLE_VERSIONS
from kfac.state import STATE_VERSION
from kfac.tracing import PHASES
from testing.snippets import strictly

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / 'docs' / 'guide'
SIGNATURE = inspect.signature(KFACPreconditioner.__init__)
ARGUMENTS = [name for name in SIGNATURE.parameters if name != 'self']
KEYWORDS = [
    name
    for name, parameter in SIGNATURE.parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
]
#: What the documentation's code cells may name.
NAMESPACE = {'logging': logging, 'nn': nn, 'torch': torch}
#: ``ExceptionName`` followed by its example: `` `TypeError` (`lr='x'`) ``.
EXAMPLE = re.compile(r'`(\w+(?:Error|Warning))` \(`([^`]+)`\)')
NAMED = re.compile(r'`(\w+(?:Error|Warning))`')
#: The error table's column of errors, each with an example.
RAISES = 'raises (an example of each)'
FENCE = re.compile(r'^```(\w*)\n(.*?)^```', re.MULTILINE | re.DOTALL)
EXPECT = re.compile(r'^(\s*)print\((.*)\)\s+#\s*(.+?)\s*$')


def _section(path: pathlib.Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level."""
    text = path.read_text()
    level = heading.split(' ', 1)[0]
    start = text.index(f'\n{heading}\n') + len(heading) + 2
    stop = re.compile(rf'^#{{1,{len(level)}}} ', re.MULTILINE)
    match = stop.search(text, start)
    return text[start : match.start() if match else len(text)]


def _tables(text: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Each Markdown table of ``text``: its header and its rows."""
    for block in re.findall(r'(?:^\|.*\|\n)+', text, re.MULTILINE):
        lines = [
            [cell.strip() for cell in line.strip()[1:-1].split(' | ')]
            for line in block.splitlines()
        ]
        yield lines[0], lines[2:]


def _first_code(cell: str) -> str:
    match = re.search(r'`([^`]+)`', cell)
    assert match is not None, f'no `code` in the cell {cell!r}'
    return match.group(1)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# -- the options tables of the hyperparameters page -------------------------


def _option_rows() -> dict[str, str]:
    """``{keyword: default cell}`` of the hyperparameters page's tables."""
    rows: dict[str, str] = {}
    page = (GUIDE / 'hyperparameters.md').read_text()
    for header, body in _tables(page):
        if header[0] not in ('knob', 'option'):
            continue
        column = header.index('default')
        for row in body:
            name = _first_code(row[0])
            assert name not in rows, f'{name} has two rows'
            rows[name] = row[column]
    return rows


def test_every_keyword_has_an_option_row() -> None:
    rows = _option_rows()
    assert sorted(rows) == sorted(KEYWORDS), (
        f'missing: {sorted(set(KEYWORDS) - set(rows))}; '
        f'not a keyword: {sorted(set(rows) - set(KEYWORDS))}'
    )


def _plain(value: object) -> object:
    """An enum member's value (`'comm_opt'`, a sentinel's `'batch'`)."""
    return value.value if isinstance(value, enum.Enum) else value


@pytest.mark.parametrize('name', KEYWORDS)
def test_option_row_gives_the_default(name: str) -> None:
    cell = _option_rows().get(name)
    if cell is None:
        pytest.fail(f'{name} has no row in the options tables')
    documented = _plain(eval(_first_code(cell), dict(NAMESPACE)))
    actual = _plain(SIGNATURE.parameters[name].default)
    # 25 for 25.0 is fine; True for 1, or None for anything else, is not.
    same = (
        documented == actual
        and (documented is None) == (actual is None)
        and isinstance(documented, bool) == isinstance(actual, bool)
    )
    assert same, f'{name}: the page says {documented!r}, the code {actual!r}'


# -- the constructor error table of the troubleshooting page ----------------


def _error_rows() -> dict[str, str]:
    """``{argument: raises cell}`` of the constructor error table."""
    section = _section(
        GUIDE / 'troubleshooting.md',
        '## Errors when constructing the preconditioner',
    )
    header, body = next(_tables(section))
    if RAISES not in header:
        return {}  # the tests below then say what is missing
    column = header.index(RAISES)
    rows: dict[str, str] = {}
    for row in body:
        name = _first_code(row[0])
        assert name not in rows, f'{name} has two rows'
        rows[name] = row[column]
    return rows


def _examples() -> list[tuple[str, str, str]]:
    """``(argument, error name, example)`` of every example in the table."""
    return [
        (argument, error, example)
        for argument, cell in _error_rows().items()
        for error, example in EXAMPLE.findall(cell)
    ]


def test_every_argument_has_an_error_row() -> None:
    rows = _error_rows()
    assert sorted(rows) == sorted(ARGUMENTS), (
        f'missing: {sorted(set(ARGUMENTS) - set(rows))}; '
        f'not an argument: {sorted(set(rows) - set(ARGUMENTS))}'
    )


def test_every_named_error_has_an_example() -> None:
    rows = _error_rows()
    assert rows, 'no constructor error table with examples'
    for argument, cell in rows.items():
        named = set(NAMED.findall(cell))
        shown = {error for error, _ in EXAMPLE.findall(cell)}
        assert named, f'{argument}: the row names no error'
        assert named == shown, (
            f'{argument}: {sorted(named - shown)} named without an example'
        )


@pytest.mark.parametrize(
    ('argument', 'error', 'example'),
    _examples(),
    ids=[f'{error}:{example}' for _, error, example in _examples()],
)
def test_error_row_is_what_the_constructor_raises(
    argument: str, error: str, example: str
) -> None:
    kwargs: dict[str, Any] = eval(f'dict({example})', dict(NAMESPACE))
    assert argument in kwargs, f'the example {example!r} omits {argument}'
    model = kwargs.pop('model') if 'model' in kwargs else _model()
    expected = getattr(builtins, error)
    if issubclass(expected, Warning):
        with pytest.warns(expected):
            KFACPreconditioner(model, **kwargs).remove()
        return
    with pytest.raises(expected):
        KFACPreconditioner(model, **kwargs)


# -- the phases of one step --------------------------------------------------


def test_phase_list_is_the_timers() -> None:
    section = _section(GUIDE / 'how-kfac-works.md', '## One step, in order')
    listed = re.findall(r'^\d+\. `(\w+)`', section, re.MULTILINE)
    assert tuple(listed) == PHASES


# -- the registration report -------------------------------------------------


def test_registration_report_is_what_the_code_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    section = _section(
        GUIDE / 'troubleshooting.md',
        '### What is preconditioned: the registration report',
    )
    blocks = FENCE.findall(section)
    code = [body for kind, body in blocks if kind == 'python']
    shown = [body for kind, body in blocks if kind == 'text']
    assert len(code) == 1 and len(shown) == 1, 'one python and one text block'
    caplog.set_level(logging.INFO, logger='kfac')
    with strictly('the registration report'):
        exec(
            compile(code[0], 'troubleshooting.md', 'exec'), {'__name__': 'doc'}
        )
    logged = [
        record.getMessage()
        for record in caplog.records
        if record.getMessage().startswith('K-FAC preconditions')
    ]
    assert len(logged) == 1
    assert logged[0] == shown[0].rstrip('\n')


# -- code shown but not run ---------------------------------------------------

#: What a block fenced ```py (shown, not run) must need: a process group,
#: a distributed checkpoint or a GPU, which one test process does not have.
UNRUNNABLE = ('init_process_group', 'dcp.', "'cuda'")


def test_only_code_that_cannot_run_here_is_not_run() -> None:
    pages = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
    for page in pages:
        for kind, body in FENCE.findall(page.read_text()):
            if kind != 'py':
                continue
            assert any(need in body for need in UNRUNNABLE), (
                f'{page.relative_to(ROOT)}: a ```py block (not run) that '
                f'could run as ```python:\n{body}'
            )


def _code_blocks() -> Iterator[tuple[str, str]]:
    """``(page, code)`` of every ```python and ```py block, in page order."""
    for page in [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]:
        for kind, body in FENCE.findall(page.read_text()):
            if kind in ('py', 'python'):
                yield str(page.relative_to(ROOT)), body


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def test_code_gives_the_preconditioner_the_optimizer_not_lr() -> None:
    calls = 0
    for page, code in _code_blocks():
        for node in ast.walk(ast.parse(code)):
            if not (
                isinstance(node, ast.Call)
                and _called(node) == 'KFACPreconditioner'
            ):
                continue
            calls += 1
            keywords = {keyword.arg for keyword in node.keywords}
            assert 'lr' not in keywords, (
                f'{page}:{node.lineno} of its block passes lr= to '
                f'KFACPreconditioner; show optimizer=optimizer instead'
            )
    assert calls > 10, 'the scan must find the preconditioners of the docs'


def _bound_and_read(code: str) -> tuple[set[str], set[str]]:
    """The names ``code`` binds (anywhere) and the names it reads."""
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            loaded = isinstance(node.ctx, ast.Load)
            (read if loaded else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update(
                (alias.asname or alias.name).split('.')[0]
                for alias in node.names
            )
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read


def _comments(code: str) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return ' '.join(t.string for t in tokens if t.type == tokenize.COMMENT)


def test_code_says_where_the_names_it_does_not_define_come_from() -> None:
    # A name a block reads must be defined in it, in an earlier block of
    # its page (not for a block that starts a process group: a whole
    # script), or named in one of its comments as the reader's own.
    pages: dict[str, set[str]] = {}
    blocks = 0
    for page, code in _code_blocks():
        blocks += 1
        earlier = pages.setdefault(page, set(dir(builtins)))
        bound, read = _bound_and_read(code)
        known = set(dir(builtins)) if UNRUNNABLE[0] in code else earlier
        comments = _comments(code)
        unexplained = sorted(
            name
            for name in read - bound - known
            if not re.search(rf'\b{name}\b', comments)
        )
        assert not unexplained, (
            f'{page}: a block reads {unexplained}, defined neither in it nor '
            f'before it, and no comment of it says what they are:\n{code}'
        )
        earlier |= bound
    assert blocks > 30, 'the scan must find the code of the docs'


# -- the torch requirement ----------------------------------------------------


def test_stated_torch_floor_is_the_packages() -> None:
    pyproject = (ROOT / 'pyproject.toml').read_text()
    floors = re.findall(r"'torch>=([\d.]+)'", pyproject)
    assert len(floors) == 1, 'pyproject.toml names one torch floor'
    for name in ('README.md', 'docs/index.md', 'docs/getting-started.md'):
        stated = re.findall(r'torch>=([\d.]+)', (ROOT / name).read_text())
        assert stated, f'{name} states no torch requirement'
        assert set(stated) == set(floors), (
            f'{name} says torch>={stated}, pyproject.toml {floors[0]}'
        )


# -- the checkpoint format ---------------------------------------------------


def test_checkpoints_page_gives_the_state_versions() -> None:
    page = ' '.join((GUIDE / 'checkpoints.md').read_text().split())
    current = re.findall(r'format `version` \((\d+) today', page)
    assert current == [str(STATE_VERSION)], (
        f'checkpoints.md says format version {current}, '
        f'kfac.state.STATE_VERSION is {STATE_VERSION}'
    )
    loaded = re.findall(r'versions (\d+) to (\d+) load', page)
    assert len(loaded) == 1, 'one sentence "versions A to B load"'
    first, last = map(int, loaded[0])
    assert tuple(range(first, last + 1)) == READABLE_VERSIONS, (
        f'checkpoints.md says versions {first} to {last} load, '
        f'kfac.state.READABLE_VERSIONS is {READABLE_VERSIONS}'
    )


# -- the README's code -------------------------------------------------------


def _checked(block: str) -> str:
    """``block`` with each ``print(x)  # text`` turned into a check."""
    lines = []
    for line in block.splitlines():
        match = EXPECT.match(line)
        if match:
            indent, args, expected = match.groups()
            line = f'{indent}__expect({expected!r}, {args})'
        lines.append(line)
    return '\n'.join(lines) + '\n'


def _expect(expected: str, *args: object) -> None:
    printed = ' '.join(str(arg) for arg in args)
    print(printed)
    assert printed == expected, (
        f'printed {printed!r}, README says {expected!r}'
    )


def test_readme_python_blocks_run(request: pytest.FixtureRequest) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    readme = ROOT / 'README.md'
    blocks = [
        b for kind, b in FENCE.findall(readme.read_text()) if kind == 'python'
    ]
    assert blocks, 'README has no python block'
    namespace: dict[str, Any] = {'__name__': 'readme', '__expect': _expect}
    with strictly('README.md'):
        for block in blocks:
            exec(compile(_checked(block), str(readme), 'exec'), namespace)
