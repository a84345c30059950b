"""Preconditioner options the tests share.

The library's defaults update the factors every 10 steps and decompose
them every 100 (the time-to-target study's choice); a test of what one
step does needs both on every step.
"""

from __future__ import annotations

from typing import Any

EVERY_STEP: dict[str, Any] = {'factor_update_steps': 1, 'inv_update_steps': 1}
"""Update the factors and the decompositions on every step."""
