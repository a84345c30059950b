"""The README's usage snippet runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


def test_usage_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.DOTALL)
    assert blocks, 'README has no python block'
    exec(compile(blocks[0], str(README), 'exec'), {'__name__': 'readme'})
    out = capsys.readouterr().out
    match = re.search(r'loss after 20 steps: (\d+\.\d+)', out)
    assert match is not None
    assert float(match.group(1)) < 1.0
