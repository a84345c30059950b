"""The time-to-target study: K-FAC against SGD, AdamW and Muon.

The repository's one time-to-target harness. Three tasks (`tasks.py`,
the one definition of their models), each trained for a fixed budget of
steps by every optimizer over a learning-rate grid and by K-FAC over each
base optimizer (`runner.py`) in the configurations of `variants.py`;
`analysis.py` picks the best baseline (best median final metric over the
seeds) and reports, for every run configuration, steps, training seconds,
cost per step and the time at which it first reaches the best baseline's
final metric. `step_cost.py` measures the cost per step of any
configuration, interleaved in one process.

    python -m benchmarks.study --task cnn --seeds 0 1 2

Not run by the test suite (tens of minutes of CPU per task);
`tests/system/test_study.py` runs the harness on tiny tasks.
"""
