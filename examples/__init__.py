"""Example training scripts, importable by the smoke tests."""
