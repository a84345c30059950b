"""Does the factor allreduce start while the backward pass still runs?

With `update_factors_in_hook=True` a layer's running average is updated,
and its factor allreduce handed to the communicator, as soon as the layer
has all its gradients (capture issue: a layer completes early when every
forward call of the pass has received its gradient, else at the end of the
pass). Whether the collective itself starts then depends on bucketing: a
bucket starts when it is full (25 MiB by default) or at `step()`'s flush.

This probe runs one factor step of a benchmark model on each rank of a
gloo group and records, for every factor allreduce, when the communicator
started it, against the moment `loss.backward()` returned.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.models import build
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.config import EngineOptions
from kfac.config import StatisticsConfig
from kfac.distributed import TorchDistributedCommunicator
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.preconditioner import KFACPreconditioner


class _Stamping(TorchDistributedCommunicator):
    """Records `(time, bytes)` of every allreduce it starts."""

    def __init__(self, bucket_cap_mb: float) -> None:
        super().__init__(bucket_cap_mb=bucket_cap_mb)
        self.stamps: list[tuple[float, int]] = []

    def _record(self, kind: str, buffer: torch.Tensor) -> None:
        super()._record(kind, buffer)
        # The one-element allreduce is the count of non-finite statistics.
        if kind == 'allreduce' and buffer.numel() > 1:
            nbytes = buffer.numel() * buffer.element_size()
            self.stamps.append((time.perf_counter(), nbytes))


def _probe(name: str, bucket_cap_mb: float) -> dict[str, Any]:
    bench = build(name)
    model = bench.model
    # The layers and placement of the full preconditioner, run by an engine
    # with the probe's communicator.
    # The original defaults (updates every step, damping and the 'kl' clip
    # at 0.001) unless the benchmark's options say otherwise, as before
    # they changed.
    full = KFACPreconditioner(
        model,
        lr=0.01,
        skip_layers=bench.skip_layers,
        statistics=StatisticsConfig(loss_average=bench.loss_average),
        **{**ORIGINAL_DEFAULTS, **bench.kfac_options},
    )
    full.remove()
    comm = _Stamping(bucket_cap_mb)
    precon = BaseKFACPreconditioner(
        dict(full.layers),
        assignment=full.assignment,
        hyperparameters=full.hyperparameters,
        communicator=comm,
        options=EngineOptions(bucketed=bucket_cap_mb > 0),
    )
    loss = bench.loss(model(bench.inputs[0]), bench.target[0])
    loss.backward()
    backward_end = time.perf_counter()
    precon.step()
    stamps = comm.stamps
    during = [nbytes for when, nbytes in stamps if when <= backward_end]
    return {
        'model': name,
        'bucket_cap_mb': bucket_cap_mb,
        'layers': len(precon.layers),
        'collectives': len(stamps),
        'collectives_during_backward': len(during),
        'bytes': sum(nbytes for _, nbytes in stamps),
        'bytes_during_backward': sum(during),
    }


def probe_rank(models: list[str], out_dir: str) -> None:
    """Run the probe for each model and bucket cap; rank 0 writes JSON."""
    torch.set_num_threads(1)
    results = [
        _probe(name, cap) for name in models for cap in (25.0, 1.0, 0.0)
    ]
    if dist.get_rank() == 0:
        (pathlib.Path(out_dir) / 'overlap.json').write_text(
            json.dumps(results)
        )


def overlap(models: list[str], world_size: int = 2) -> list[dict[str, Any]]:
    """The probe at `world_size` gloo ranks (see the module docstring)."""
    from testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp)
        run_distributed(
            probe_rank, world_size, models, tmp, tmp_path=path, timeout=600
        )
        result: list[dict[str, Any]] = json.loads(
            (path / 'overlap.json').read_text()
        )
    return result


def overlap_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the probe's results."""
    lines = [
        '| model | bucket cap MiB | factor allreduces started during '
        'backward | bytes started during backward |',
        '| --- | --- | --- | --- |',
    ]
    for row in rows:
        share = row['bytes_during_backward'] / max(row['bytes'], 1)
        lines.append(
            f'| {row["model"]} | {row["bucket_cap_mb"]:g} | '
            f'{row["collectives_during_backward"]} of {row["collectives"]} | '
            f'{share:.0%} of {row["bytes"] / 2**20:.1f} MiB |'
        )
    return '\n'.join(lines)
