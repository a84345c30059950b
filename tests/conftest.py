"""Fixtures shared by the tests, and the device the device-aware tests use.

``KFAC_TEST_DEVICE`` (default ``cpu``) names the device of the tests that
take the ``device`` fixture (the oracles, the robustness tests, the host
syncs and the DDP oracle); ``make gpu-check`` sets it to ``cuda``. A CUDA
device asked for on a machine without one stops the run with a usage error
rather than testing the CPU again.

On CUDA, tests that take ``oracle_dtype`` run in float64 and float32 (on
the CPU, in float64 only: float32 there adds time and no kernel the float64
run does not exercise), and cuDNN's TF32 convolutions are turned off: they
round the model's float32 convolutions to 10-bit mantissas, so a float64
reference recomputing the model (the per-example Fisher) would differ from
the model by ~1e-3 whatever the library does. The library's own arithmetic
is matrix products, where PyTorch's default is full float32 already.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from testing.asserts import WORST

#: The environment variable naming the device of the device-aware tests.
DEVICE_ENV = 'KFAC_TEST_DEVICE'


@functools.cache
def selected_device() -> torch.device:
    """The device named by ``KFAC_TEST_DEVICE`` (``cuda`` means ``cuda:0``).

    Raises:
        pytest.UsageError: not a CPU or CUDA device, or CUDA without one.
    """
    name = os.environ.get(DEVICE_ENV, 'cpu')
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise pytest.UsageError(f'{DEVICE_ENV}={name!r}: {err}') from err
    if device.type == 'cpu':
        return device
    if device.type != 'cuda':
        raise pytest.UsageError(
            f'{DEVICE_ENV}={name!r}: the tests run on cpu or cuda devices'
        )
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f'{DEVICE_ENV}={name!r} but torch.cuda.is_available() is False '
            f'(torch {torch.__version__})'
        )
    return torch.device('cuda', 0 if device.index is None else device.index)


def pytest_configure(config: pytest.Config) -> None:
    if selected_device().type == 'cuda':
        torch.backends.cudnn.allow_tf32 = False


def pytest_report_header(config: pytest.Config) -> str:
    return f'device-aware tests on {selected_device()} ({DEVICE_ENV})'


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if 'oracle_dtype' in metafunc.fixturenames and (
        selected_device().type == 'cuda'
    ):
        metafunc.parametrize(
            'oracle_dtype',
            [torch.float64, torch.float32],
            ids=['float64', 'float32'],
        )


@pytest.fixture(scope='session')
def device() -> torch.device:
    """Where the device-aware tests put models and data."""
    return selected_device()


@pytest.fixture
def oracle_dtype() -> torch.dtype:
    """The dtype of an oracle test: float64 (and float32 on CUDA, through
    :func:`pytest_generate_tests`).
    """
    return torch.float64


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if WORST:
        terminalreporter.section('largest relative error per oracle')
        for label, err in sorted(WORST.items()):
            terminalreporter.write_line(f'{label:40s} {err:.3e}')
        worst = max(WORST.values())
        terminalreporter.write_line(f'{"overall":40s} {worst:.3e}')
