"""K-FAC gradient preconditioning for PyTorch, distributed as in KAISA."""

from __future__ import annotations

__version__ = '0.1.0'
