"""What the machine can do: matmul rate, memory bandwidth, linalg constants.

Measured in the benchmark's own process, with its thread setting, so the
floors of :mod:`benchmarks.floor` are on the same footing as the phase
times they are compared with.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from kfac.math import subspace_iteration

__all__ = [
    'LINALG_OPS',
    'RateProbe',
    'Rates',
    'calibrate_linalg',
    'machine_info',
    'measure_rates',
    'median_seconds',
]


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device,
    warmup: int = 1,
) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Rates:
    """The matmul rate (flop/s) and copy bandwidth (byte/s) of a device.

    Args:
        flops_per_s: rate of a large float32 ``torch.mm``.
        bytes_per_s: bytes read plus written per second by a large copy.

    """

    def __init__(self, flops_per_s: float, bytes_per_s: float) -> None:
        self.flops_per_s = flops_per_s
        self.bytes_per_s = bytes_per_s

    def as_dict(self) -> dict[str, float]:
        """``{'matmul_gflops': ..., 'copy_gbytes_per_s': ...}``."""
        return {
            'matmul_gflops': self.flops_per_s / 1e9,
            'copy_gbytes_per_s': self.bytes_per_s / 1e9,
        }


def measure_rates(
    device: torch.device,
    n: int = 2048,
    copy_mib: int = 128,
    repeats: int = 5,
) -> Rates:
    """Time an ``n x n`` float32 matmul and a ``copy_mib`` MiB copy."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device)
    b = torch.randn(n, n, generator=gen, device=device)
    seconds = median_seconds(lambda: torch.mm(a, b), repeats, device)
    flops = 2.0 * n**3 / seconds
    elements = copy_mib * 2**20 // 4
    src = torch.randn(elements, generator=gen, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats, device)
    return Rates(flops, 2.0 * elements * 4 / seconds)


class RateProbe:
    """Samples the matmul rate and copy bandwidth between benchmark steps.

    Each :meth:`sample` times one ``n x n`` float32 matmul and one copy of
    ``copy_mib`` MiB, so the rates see the same load as the steps around
    them; :meth:`rates` is the median of the samples.
    """

    def __init__(
        self, device: torch.device, n: int = 1024, copy_mib: int = 32
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(1)
        self.device = device
        self._a = torch.randn(n, n, generator=gen, device=device)
        self._b = torch.randn(n, n, generator=gen, device=device)
        self._src = torch.randn(copy_mib * 2**18, generator=gen, device=device)
        self._dst = torch.empty_like(self._src)
        self.flops: list[float] = []
        self.bandwidths: list[float] = []

    def sample(self) -> None:
        """Time one matmul and one copy."""
        n = self._a.shape[0]
        seconds = median_seconds(
            lambda: torch.mm(self._a, self._b), 1, self.device, warmup=0
        )
        self.flops.append(2.0 * n**3 / seconds)
        seconds = median_seconds(
            lambda: self._dst.copy_(self._src), 1, self.device, warmup=0
        )
        self.bandwidths.append(2.0 * self._src.numel() * 4 / seconds)

    def rates(self) -> Rates:
        """Median rates of the samples so far (at least one is taken)."""
        if not self.flops:
            self.sample()
        return Rates(
            statistics.median(self.flops), statistics.median(self.bandwidths)
        )

    def as_dict(self) -> dict[str, float]:
        """Median, min and max of the sampled rates, in G/s."""
        return {
            'samples': float(len(self.flops)),
            'matmul_gflops_median': statistics.median(self.flops) / 1e9,
            'matmul_gflops_min': min(self.flops) / 1e9,
            'matmul_gflops_max': max(self.flops) / 1e9,
            'copy_gbytes_per_s_median': statistics.median(self.bandwidths)
            / 1e9,
        }


def _spd(n: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(4 * n, n, generator=gen, device=device)
    return x.T @ x / (4 * n)


LINALG_OPS = ('eigh', 'inv', 'cholesky_inverse', 'qr_step')
"""The operations `calibrate_linalg` times."""


def _linalg_ops(m: torch.Tensor) -> dict[str, Callable[[], object]]:
    _, basis = torch.linalg.eigh(m)
    ops: dict[str, Callable[[], object]] = {
        'eigh': lambda: torch.linalg.eigh(m),
        'inv': lambda: torch.linalg.inv(m),
        'cholesky_inverse': lambda: torch.cholesky_inverse(
            torch.linalg.cholesky(m)
        ),
        # the warm start (`basis_refresh='qr'`) per step of orthogonal
        # iteration from a previous basis
        'qr_step': lambda: subspace_iteration(m, basis, 1),
    }
    return ops


def calibrate_linalg(
    rates: Rates,
    device: torch.device,
    sizes: tuple[int, ...] = (128, 512, 1024),
) -> list[dict[str, float]]:
    """Effective flop constants of ``eigh`` and inverses on this machine.

    For each ``n``, the time of ``torch.linalg.eigh``, ``torch.linalg.inv``,
    ``torch.cholesky_inverse(torch.linalg.cholesky(.))`` and one step of
    the warm start (:func:`kfac.math.subspace_iteration`, one QR step from
    an eigenbasis) on a random SPD matrix, and ``c = time × matmul rate /
    n³``: the number of matmul-rate flops per ``n³`` the operation
    effectively costs.
    """
    rows = []
    for n in sizes:
        ops = _linalg_ops(_spd(n, device))
        row: dict[str, float] = {'n': float(n)}
        for name, op in ops.items():
            seconds = median_seconds(op, 3, device)
            row[f'{name}_ms'] = seconds * 1e3
            row[f'{name}_c'] = seconds * rates.flops_per_s / n**3
        rows.append(row)
    return rows


def _cpu_model() -> str:
    try:
        out = subprocess.run(
            ['lscpu'], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or 'unknown'
    for line in out.splitlines():
        if line.startswith('Model name:'):
            return line.split(':', 1)[1].strip()
    return 'unknown'


def machine_info(device: torch.device) -> dict[str, object]:
    """CPU model, core count, threads, torch and Python versions, device."""
    info: dict[str, object] = {
        'cpu_model': _cpu_model(),
        'cpu_cores': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'torch': torch.__version__,
        'python': platform.python_version(),
        'device': str(device),
    }
    if device.type == 'cuda':
        info['gpu'] = torch.cuda.get_device_name(device)
    return info
