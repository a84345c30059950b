"""Test utilities: launcher, tiny models, dense references (not shipped)."""
