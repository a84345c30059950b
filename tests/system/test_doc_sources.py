"""What the documentation quotes from elsewhere is held to its source.

* Every version of kfac-pytorch that ``README.md`` or a page under
  ``docs/`` names ("the default since 0.5.0") is a release of
  ``CHANGELOG.md`` (a heading ``## [X.Y.Z]``) or the upcoming one, which
  the unreleased heading names: ``## [Unreleased] (X.Y.Z)``. Versions of
  torch (``torch 2.13.0``, ``torch==2.13.0+cpu``) are told apart as the
  versions written after ``torch`` somewhere in those pages.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
CHANGELOG = (ROOT / 'CHANGELOG.md').read_text()
VERSION = re.compile(r'(?<![\w.])(\d+\.\d+\.\d+)(?![\w.]*\d)')
TORCH = re.compile(r'torch ?(?:==|>=)? ?(\d+\.\d+\.\d+)')


def _released() -> set[str]:
    return set(re.findall(r'^## \[(\d+\.\d+\.\d+)\]', CHANGELOG, re.M))


def _upcoming() -> str:
    found = re.findall(
        r'^## \[Unreleased\] \((\d+\.\d+\.\d+)\)$', CHANGELOG, re.M
    )
    assert len(found) == 1, (
        'CHANGELOG.md names the upcoming release in its unreleased '
        'heading: "## [Unreleased] (X.Y.Z)"'
    )
    return found[0]


def _key(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split('.')))


def test_upcoming_version_follows_the_releases() -> None:
    released = _released()
    assert released, 'the scan must find the released versions'
    assert _key(_upcoming()) > max(map(_key, released))


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
    known = _released() | {_upcoming()}
    unknown = sorted({(p, v) for p, v in named if v not in known})
    assert not unknown, (
        f'versions neither released in CHANGELOG.md nor upcoming '
        f'({_upcoming()}): {unknown}'
    )
