"""The documentation's tables and examples are held to the code.

* Every keyword argument of `KFACPreconditioner` has a row in the options
  tables of ``docs/guide/hyperparameters.md``, whose default column gives
  its real default.
* Each option group (`StatisticsConfig`, `FisherConfig`,
  `ShardingConfig`, the fields of `KFACConfig` that are dataclasses) and
  each method's config (`EigenConfig` and the other `CurvatureConfig`s
  ``import kfac`` offers) has a table of its fields on that page,
  ``| `StatisticsConfig` field | default | ... |``, with every field and
  its real default; the per-module options table lists
  `kfac.layers.options.OPTION_NAMES`.
* Every argument of `KFACPreconditioner` has a row in the constructor error
  table of ``docs/guide/troubleshooting.md``; each error (or warning) a row
  names comes with an example, ``` `TypeError` (`damping='x'`) ```, which
  the test passes to the constructor (the example's keywords must be
  arguments of it): it must raise exactly that, with a message that names
  one of the example's keywords and, where the row quotes the message
  after the example (``: "..."``), contains the quote. The table of the
  option groups' errors holds every field of every group and method
  config the same way, each example building the object itself.
* The migration page's table of keywords gives, for each row, the
  spelling of commit ``1caa768`` and today's: today's are keywords of
  `KFACPreconditioner` that build a `KFACConfig` holding every moved
  option at the old value (and the old method), and together they name
  every field of every group and method config; of its tables of
  removed names, each old name no longer resolves and each new one does.
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
import dataclasses
import enum
import importlib
import inspect
import io
import logging
import pathlib
import re
import tokenize
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import kfac
from kfac.config import KFACConfig
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.options import OPTION_NAMES
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
NAMESPACE = {'kfac': kfac, 'logging': logging, 'nn': nn, 'torch': torch}
#: ``ExceptionName`` followed by its example: `` `TypeError` (`lr='x'`) ``.
EXAMPLE = re.compile(r'`(\w+(?:Error|Warning))` \(`([^`]+)`\)')
#: A message quoted after an example: ``: "the message"``.
QUOTE = re.compile(r'[^`;]*?: "([^"]+)"')
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


def _same(documented: object, actual: object) -> bool:
    """Whether a documented default is the code's: 25 for 25.0 is; True
    for 1, or None for anything else, is not.
    """
    return (
        documented == actual
        and (documented is None) == (actual is None)
        and isinstance(documented, bool) == isinstance(actual, bool)
    )


@pytest.mark.parametrize('name', KEYWORDS)
def test_option_row_gives_the_default(name: str) -> None:
    cell = _option_rows().get(name)
    if cell is None:
        pytest.fail(f'{name} has no row in the options tables')
    documented = _plain(eval(_first_code(cell), dict(NAMESPACE)))
    actual = _plain(SIGNATURE.parameters[name].default)
    assert _same(documented, actual), (
        f'{name}: the page says {documented!r}, the code {actual!r}'
    )


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


Example = tuple[str, str, str, str | None]
"""``(row, error name, example, quoted message or None)``."""


def _cell_examples(cell: str) -> Iterator[tuple[str, str, str | None]]:
    """``(error name, example, quoted message or None)`` of a cell."""
    for match in EXAMPLE.finditer(cell):
        quote = QUOTE.match(cell, match.end())
        yield match.group(1), match.group(2), quote.group(1) if quote else None


def _examples(rows: dict[str, str]) -> list[Example]:
    """Every example of the ``{row: raises cell}`` of a table."""
    return [
        (row, error, example, quote)
        for row, cell in rows.items()
        for error, example, quote in _cell_examples(cell)
    ]


def _ids(examples: list[Example]) -> list[str]:
    return [f'{error}:{example}' for _, error, example, _ in examples]


def _keywords(code: str) -> list[str]:
    """Every keyword argument ``code`` passes, at any depth."""
    return [
        keyword.arg
        for node in ast.walk(ast.parse(code, mode='eval'))
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg is not None
    ]


def _raises_as_shown(
    error: str, example: str, quote: str | None, run: Callable[[], object]
) -> None:
    """``run()`` raises (or warns) ``error`` with a message that names one
    of the keywords of ``example`` and contains ``quote``.
    """
    expected = getattr(builtins, error)
    if issubclass(expected, Warning):
        with pytest.warns(expected) as record:
            run()
        messages = [str(w.message) for w in record if w.category is expected]
    else:
        with pytest.raises(expected) as info:
            run()
        messages = [str(info.value)]
    names = _keywords(f'dict({example})')
    assert any(name in m for m in messages for name in names), (
        f'{example}: the message {messages} names none of {names}'
    )
    if quote is not None:
        assert any(quote in m for m in messages), (
            f'{example}: the page quotes {quote!r}, the code says {messages}'
        )


def test_every_argument_has_an_error_row() -> None:
    rows = _error_rows()
    assert sorted(rows) == sorted(ARGUMENTS), (
        f'missing: {sorted(set(ARGUMENTS) - set(rows))}; '
        f'not an argument: {sorted(set(rows) - set(ARGUMENTS))}'
    )


@pytest.mark.parametrize('table', ['constructor', 'groups'])
def test_every_named_error_has_an_example(table: str) -> None:
    rows = _error_rows() if table == 'constructor' else _group_error_rows()
    assert rows, f'no {table} error table with examples'
    for argument, cell in rows.items():
        named = set(NAMED.findall(cell))
        shown = {error for error, _ in EXAMPLE.findall(cell)}
        assert named, f'{argument}: the row names no error'
        assert named == shown, (
            f'{argument}: {sorted(named - shown)} named without an example'
        )


def _construct(example: str) -> None:
    kwargs: dict[str, Any] = eval(f'dict({example})', dict(NAMESPACE))
    model = kwargs.pop('model') if 'model' in kwargs else _model()
    KFACPreconditioner(model, **kwargs).remove()


@pytest.mark.parametrize(
    ('argument', 'error', 'example', 'quote'),
    _examples(_error_rows()),
    ids=_ids(_examples(_error_rows())),
)
def test_error_row_is_what_the_constructor_raises(
    argument: str, error: str, example: str, quote: str | None
) -> None:
    call = ast.parse(f'dict({example})', mode='eval').body
    assert isinstance(call, ast.Call)
    given = [keyword.arg for keyword in call.keywords]
    assert argument in given, f'the example {example!r} omits {argument}'
    unknown = sorted(str(name) for name in set(given) - set(ARGUMENTS))
    assert not unknown, (
        f'the example {example!r} passes {unknown}, which are not '
        'arguments of KFACPreconditioner'
    )
    _raises_as_shown(error, example, quote, lambda: _construct(example))


# -- the option groups -------------------------------------------------------


def _group_classes() -> dict[str, type[Any]]:
    """The option groups (the fields of `KFACConfig` that are dataclasses)
    and the methods' configs ``import kfac`` offers, by name.
    """
    groups: list[type[Any]] = []
    for field in dataclasses.fields(KFACConfig):
        factory = field.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            groups.append(factory)
    methods = [
        obj
        for name in kfac.__all__
        if isinstance(obj := getattr(kfac, name), type)
        and issubclass(obj, CurvatureConfig)
        and not inspect.isabstract(obj)
    ]
    return {kind.__name__: kind for kind in [*groups, *methods]}


def _fields(kind: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    return {field.name: field for field in dataclasses.fields(kind)}


def test_the_groups_are_found() -> None:
    # The tests below hold the docs to these; the scan must find them.
    groups = _group_classes()
    assert {'StatisticsConfig', 'FisherConfig', 'EigenConfig'} <= set(groups)
    assert all(_fields(kind) for kind in groups.values())


def _field_tables() -> dict[str, dict[str, str]]:
    """``{group: {field: default cell}}`` of the hyperparameters page's
    tables headed ``| `Group` field | default | ... |``.
    """
    tables: dict[str, dict[str, str]] = {}
    page = (GUIDE / 'hyperparameters.md').read_text()
    for header, body in _tables(page):
        match = re.fullmatch(r'`(\w+)` field', header[0])
        if match is None:
            continue
        group = match.group(1)
        assert group not in tables, f'{group} has two field tables'
        column = header.index('default')
        rows: dict[str, str] = {}
        for row in body:
            name = _first_code(row[0])
            assert name not in rows, f'{group}.{name} has two rows'
            rows[name] = row[column]
        tables[group] = rows
    return tables


def test_every_group_has_a_field_table() -> None:
    tables = _field_tables()
    groups = _group_classes()
    assert sorted(tables) == sorted(groups), (
        f'missing: {sorted(set(groups) - set(tables))}; '
        f'not a group: {sorted(set(tables) - set(groups))}'
    )


@pytest.mark.parametrize('group', sorted(_group_classes()))
def test_field_table_gives_every_field_and_its_default(group: str) -> None:
    rows = _field_tables().get(group)
    if rows is None:
        pytest.fail(f'{group} has no field table')
    fields = _fields(_group_classes()[group])
    assert sorted(rows) == sorted(fields), (
        f'{group}: missing {sorted(set(fields) - set(rows))}; '
        f'not a field {sorted(set(rows) - set(fields))}'
    )
    for name, cell in rows.items():
        documented = _plain(eval(_first_code(cell), dict(NAMESPACE)))
        actual = _plain(fields[name].default)
        assert _same(documented, actual), (
            f'{group}.{name}: the page says {documented!r}, '
            f'the code {actual!r}'
        )


def test_per_module_options_table_lists_the_options() -> None:
    page = (GUIDE / 'hyperparameters.md').read_text()
    listed = [
        _first_code(row[0])
        for header, body in _tables(page)
        if header[0] == 'per-module option'
        for row in body
    ]
    assert sorted(listed) == sorted(OPTION_NAMES)


def _group_error_rows() -> dict[str, str]:
    """``{Group.field: raises cell}`` of the option groups' error table."""
    section = _section(
        GUIDE / 'troubleshooting.md', '### Errors of the option groups'
    )
    header, body = next(_tables(section))
    assert RAISES in header, "the option groups' error table has no examples"
    column = header.index(RAISES)
    rows: dict[str, str] = {}
    for row in body:
        name = _first_code(row[0])
        assert name not in rows, f'{name} has two rows'
        rows[name] = row[column]
    return rows


def test_every_group_field_has_an_error_row() -> None:
    expected = {
        f'{group}.{name}'
        for group, kind in _group_classes().items()
        for name in _fields(kind)
    }
    rows = _group_error_rows()
    assert sorted(rows) == sorted(expected), (
        f'missing: {sorted(expected - set(rows))}; '
        f'not a field: {sorted(set(rows) - expected)}'
    )


@pytest.mark.parametrize(
    ('field', 'error', 'example', 'quote'),
    _examples(_group_error_rows()),
    ids=_ids(_examples(_group_error_rows())),
)
def test_group_error_row_is_what_the_object_raises(
    field: str, error: str, example: str, quote: str | None
) -> None:
    group, name = field.split('.')
    call = ast.parse(example, mode='eval').body
    builds = (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == group
    )
    assert builds, f'the example {example!r} does not build a {group}'
    assert name in _keywords(example), f'the example {example!r} omits {name}'
    # An option the group does not have: the row quotes the refusal.
    assert isinstance(call, ast.Call)
    fields = _fields(_group_classes()[group])
    foreign = [k.arg for k in call.keywords if k.arg not in fields]
    assert not foreign or (quote and all(str(k) in quote for k in foreign)), (
        f'the example {example!r} passes {foreign}, not fields of {group}, '
        'without quoting the error that names them'
    )
    _raises_as_shown(
        error, example, quote, lambda: eval(example, dict(NAMESPACE))
    )


# -- the migration page ------------------------------------------------------

MIGRATING = GUIDE / 'migrating.md'


def _migration_rows() -> list[tuple[str, str]]:
    """``(spelling at 1caa768, spelling now)`` of the keyword table."""
    section = _section(MIGRATING, '## Keyword arguments')
    header, body = next(_tables(section))
    assert header == ['at commit `1caa768`', 'now'], header
    return [(_first_code(row[0]), _first_code(row[1])) for row in body]


def _group_fields() -> set[str]:
    return {
        name for kind in _group_classes().values() for name in _fields(kind)
    }


@pytest.mark.parametrize(
    ('before', 'now'), _migration_rows(), ids=[n for _, n in _migration_rows()]
)
def test_migration_row_holds_the_old_value(before: str, now: str) -> None:
    old: dict[str, Any] = eval(f'dict({before})', dict(NAMESPACE))
    new: dict[str, Any] = eval(f'dict({now})', dict(NAMESPACE))
    unknown = sorted(set(new) - set(KEYWORDS))
    assert not unknown, f'{now}: {unknown} are not keywords'
    held = {field.name for field in dataclasses.fields(KFACConfig)}
    config = KFACConfig(**{k: v for k, v in new.items() if k in held})
    default = SIGNATURE.parameters['compute_method'].default
    method = old.get('compute_method', default)
    assert config.curvature().name == _plain(method), (
        f'{before} ran {method!r}; {now} runs {config.curvature().name!r}'
    )
    holders = [
        config.statistics,
        config.fisher,
        config.sharding,
        config.curvature(),
    ]
    for name, value in old.items():
        if name in KEYWORDS or name not in _group_fields():
            continue  # a keyword still, or an option that is gone
        found = [getattr(h, name) for h in holders if name in _fields(type(h))]
        assert found, f'{now} has no {name}'
        assert _same(_plain(found[0]), _plain(value)), (
            f'{before} set {name}={value!r}; {now} sets {found[0]!r}'
        )


NEW_SINCE_1CAA768 = {
    'accumulation_divisor',
    'max_decomposition_failures',
    'max_nonfinite_statistics',
}
"""Group fields that did not exist at `1caa768`: nothing to migrate."""
ADDED_SINCE_1CAA768 = ('EigenAdamConfig', 'OneSidedConfig')
"""Methods added after commit 1caa768: nothing of theirs had a spelling
there, so the migration table does not name their fields."""


def test_migration_table_names_every_field_of_the_groups() -> None:
    named = {
        name
        for _, now in _migration_rows()
        for name in _keywords(f'dict({now})')
    }
    assert _group_fields() >= NEW_SINCE_1CAA768
    older = {
        name
        for group, kind in _group_classes().items()
        if group not in ADDED_SINCE_1CAA768
        for name in _fields(kind)
    }
    missing = sorted(older - named - NEW_SINCE_1CAA768)
    assert not missing, f'the migration table never names {missing}'


def _resolves(path: str) -> bool:
    """Whether the dotted ``path`` names a module or an object in one."""
    parts = path.split('.')
    for end in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module('.'.join(parts[:end]))
        except ImportError:
            continue
        for attribute in parts[end:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_removed_names_are_gone_and_their_replacements_exist() -> None:
    rows = [
        (_first_code(row[0]), _first_code(row[1]))
        for header, body in _tables(MIGRATING.read_text())
        if header == ['removed', 'now']
        for row in body
    ]
    assert len(rows) > 10, 'the scan must find the tables of removed names'
    for old, new in rows:
        assert not _resolves(old), f'{old} is said to be removed, but exists'
        assert _resolves(new), f'{new} (for {old}) does not exist'


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
