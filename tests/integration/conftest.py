"""Keep the slow ``integration`` tests out of the default run.

``make test`` (plain ``pytest``) deselects every test marked
``integration``; ``make integration`` (``pytest -m integration``), or any
explicit ``-m`` expression, selects them as usual.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker('integration')]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]
