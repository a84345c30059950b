"""The README's usage snippet runs as written, without a warning."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from testing.snippets import strictly

README = pathlib.Path(__file__).resolve().parents[2] / 'README.md'


def test_usage_snippet_runs(
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    # One thread: on a busy machine OpenMP's barriers make small matrix
    # products with several threads far slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.manual_seed(0)  # the snippet draws its data and weights at random
    blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.DOTALL)
    assert blocks, 'README has no python block'
    with strictly('README.md'):
        exec(compile(blocks[0], str(README), 'exec'), {'__name__': 'readme'})
    out = capsys.readouterr().out
    match = re.search(r'loss after 20 steps: (\d+\.\d+)', out)
    assert match is not None
    assert float(match.group(1)) < 1.0


def _make_targets() -> set[str]:
    makefile = (README.parent / 'Makefile').read_text()
    return set(re.findall(r'^([\w-]+):', makefile, re.MULTILINE))


@pytest.mark.parametrize('document', ['README.md', 'CONTRIBUTING.md'])
def test_documented_make_commands_exist(document: str) -> None:
    text = (README.parent / document).read_text()
    commands = set(re.findall(r'`make ([\w-]+)`', text))
    assert {'test', 'docs'} <= commands
    missing = sorted(commands - _make_targets())
    assert not missing, f'{document} documents missing make targets {missing}'
