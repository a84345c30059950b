from __future__ import annotations

import pytest

from testing.asserts import WORST


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if WORST:
        terminalreporter.section('largest relative error per oracle')
        for label, err in sorted(WORST.items()):
            terminalreporter.write_line(f'{label:40s} {err:.3e}')
        worst = max(WORST.values())
        terminalreporter.write_line(f'{"overall":40s} {worst:.3e}')
