"""Benchmarks of kfac-pytorch: cost against SGD, against the arithmetic
floor of each phase, and communication at scale (see ``README.md``).

Run ``make bench`` (or ``python -m benchmarks``).
"""
