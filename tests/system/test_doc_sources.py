"""What the documentation quotes from elsewhere is held to its source.

* Every version of kfac-pytorch that ``README.md`` or a page under
  ``docs/`` names ("the default since 0.5.0") is a release of
  ``CHANGELOG.md`` (a heading ``## [X.Y.Z]``) or the upcoming one, which
  the unreleased heading names: ``## [Unreleased] (X.Y.Z)``; and
  ``kfac.__version__`` is that upcoming version, or the newest release
  when the unreleased heading names none. Versions of
  torch (``torch 2.13.0``, ``torch==2.13.0+cpu``) are told apart as the
  versions written after ``torch`` somewhere in those pages.
* The section "When K-FAC is not worth it" of ``README.md`` and
  ``docs/index.md`` quotes measurements: each paragraph or item of it
  that has a number links where it comes from (a section of the study or
  of the benchmark results), and every number in it appears in a section
  it links (the whole page for a link without an anchor), so a rerun that
  changes the figures fails here until the section follows.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import kfac

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
CHANGELOG = (ROOT / 'CHANGELOG.md').read_text()
VERSION = re.compile(r'(?<![\w.])(\d+\.\d+\.\d+)(?![\w.]*\d)')
TORCH = re.compile(r'torch ?(?:==|>=)? ?(\d+\.\d+\.\d+)')


def _released() -> set[str]:
    return set(re.findall(r'^## \[(\d+\.\d+\.\d+)\]', CHANGELOG, re.M))


def _upcoming() -> str | None:
    """The version the unreleased heading names, if it names one."""
    found: list[str | None] = [
        version or None
        for version in re.findall(
            r'^## \[Unreleased\](?: \((\d+\.\d+\.\d+)\))?$', CHANGELOG, re.M
        )
    ]
    assert len(found) == 1, (
        'CHANGELOG.md has one unreleased heading: "## [Unreleased]", or '
        '"## [Unreleased] (X.Y.Z)" while X.Y.Z is being prepared'
    )
    return found[0]


def _key(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split('.')))


def test_upcoming_version_follows_the_releases() -> None:
    released = _released()
    assert released, 'the scan must find the released versions'
    upcoming = _upcoming()
    if upcoming is not None:
        assert _key(upcoming) > max(map(_key, released))


def test_package_version_is_the_newest_release_or_the_upcoming() -> None:
    upcoming = _upcoming()
    newest = max(_released(), key=_key)
    expected = newest if upcoming is None else upcoming
    assert kfac.__version__ == expected, (
        f'kfac.__version__ is {kfac.__version__}; CHANGELOG.md names '
        f'{expected} ({"upcoming" if upcoming else "its newest release"})'
    )


def _named_versions() -> list[tuple[str, str]]:
    """``(page, version)`` of every version the pages name, torch's aside."""
    texts = {str(page.relative_to(ROOT)): page.read_text() for page in PAGES}
    torch = {v for text in texts.values() for v in TORCH.findall(text)}
    return [
        (page, version)
        for page, text in texts.items()
        for version in VERSION.findall(text)
        if version not in torch
    ]


def test_named_versions_are_released_or_upcoming() -> None:
    named = _named_versions()
    assert named, 'the scan must find the versions the docs name'
    upcoming = _upcoming()
    known = _released() | ({upcoming} if upcoming else set())
    unknown = sorted({(p, v) for p, v in named if v not in known})
    assert not unknown, (
        f'versions neither released in CHANGELOG.md nor upcoming '
        f'({upcoming}): {unknown}'
    )


NOT_WORTH_IT = '## When K-FAC is not worth it'
LINK = re.compile(r'\]\(([^)#]+\.md)(?:#([^)]*))?\)')
#: A number, alone or as a ratio (``1.9x``), not part of a word or a hash.
NUMBER = re.compile(r'(?<![\w.])\d+(?:\.\d+)?(?=x\b|(?!\w|\.\d))')
HEADING = re.compile(r'^(#+) (.+)$', re.M)


def _section(page: pathlib.Path, heading: str) -> str:
    text = page.read_text()
    assert f'\n{heading}\n' in text, f'{page.name} has no {heading!r}'
    body = text.split(f'\n{heading}\n', 1)[1]
    return re.split(r'^## ', body, maxsplit=1, flags=re.M)[0]


def _slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc)."""
    words = re.sub(r'[^\w\s-]', '', heading).strip().lower()
    return re.sub(r'[-\s]+', '-', words)


def _anchored(page: pathlib.Path, anchor: str) -> str:
    """The text under the heading of `anchor`, up to the next heading of
    its level or above (the whole page without an anchor)."""
    text = page.read_text()
    if not anchor:
        return text
    for match in HEADING.finditer(text):
        if _slug(match.group(2)) == anchor:
            level = len(match.group(1))
            end = re.compile(rf'^#{{1,{level}}} ', re.M)
            stop = end.search(text, match.end())
            return text[match.end() : stop.start() if stop else len(text)]
    raise AssertionError(f'{page.name} has no heading #{anchor}')


def _numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


@pytest.mark.parametrize('name', ['README.md', 'docs/index.md'])
def test_not_worth_it_quotes_its_sources(name: str) -> None:
    page = ROOT / name
    parts = re.split(r'\n\s*\n|\n(?=\* )', _section(page, NOT_WORTH_IT))
    quoted = 0
    for part in parts:
        sources = LINK.findall(part)
        figures = _numbers(LINK.sub(']', part))
        if not figures:
            continue
        assert sources, f'{name}: figures without a source: {part!r}'
        found: set[str] = set()
        for source, anchor in sources:
            found |= _numbers(_anchored(page.parent / source, anchor))
        missing = sorted(figures - found, key=float)
        assert not missing, (
            f'{name}: {missing} are not in {sources}, which this part '
            f'of "When K-FAC is not worth it" cites:\n{part}'
        )
        quoted += len(figures)
    assert quoted >= 10, 'the scan must find the figures of the section'
