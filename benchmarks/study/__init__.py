"""The time-to-target study: K-FAC against SGD, AdamW and Muon.

Three tasks (`tasks.py`), each trained for a fixed budget of steps by
every optimizer over a learning-rate grid and by K-FAC over each base
optimizer (`optimizers.py`, `runner.py`); `analysis.py` picks the best
baseline (best median final metric over the seeds) and reports, for every
run configuration, steps, training seconds, cost per step and the time at
which it first reaches the best baseline's final metric.

    python -m benchmarks.study --task cnn --seeds 0 1 2

Not run by the test suite (tens of minutes of CPU per task);
`tests/system/test_study.py` runs the harness on tiny tasks.
"""
