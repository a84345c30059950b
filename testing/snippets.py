"""Run the documentation's code as a reader would, and let nothing pass.

A snippet that works but warns teaches the reader to ignore warnings (or
to write the mistake the warning names), so the tests that run the code of
``README.md`` and ``docs/`` run it under :func:`strictly`: every Python
warning is an error, and a ``WARNING`` (or worse) record from a ``kfac``
logger fails the snippet once it has run.

The one exception is :data:`THIRD_PARTY`: warnings that torch or a trainer
library issues about its own code, which no snippet can avoid. Each names
its message and the reason; any other warning fails.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

#: The library's loggers all sit under this one.
LOGGER = 'kfac'

#: ``(category, message regex)`` of the warnings other libraries issue
#: about their own code, whatever the snippet does.
THIRD_PARTY: tuple[tuple[type[Warning], str], ...] = (
    # torch.utils.mkldnn decorates its classes with torch.jit.script_method,
    # and the first torch.compile imports it (through torch._inductor).
    (DeprecationWarning, r'`torch\.jit\.script_method` is deprecated'),
    # Dynamo (torch 2.13) instantiates torch.autograd.Function itself when
    # it traces the apply of any custom Function (K-FAC's taps, too).
    (
        DeprecationWarning,
        r"<class 'torch\.autograd\.function\.Function'> should not be "
        r'instantiated',
    ),
    # Lightning 2.6's pytree helper builds torch's deprecated LeafSpec on
    # every Trainer.fit.
    (FutureWarning, r'`isinstance\(treespec, LeafSpec\)` is deprecated'),
)


class _Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def strictly(what: str) -> Iterator[None]:
    """Fail `what` (a page or a block, for the message) if it warns.

    Python warnings raise where they are issued; ``kfac``'s warnings
    (logged, not raised) are collected and fail the run at the end, all
    of them named.

    Raises:
        AssertionError: a ``kfac`` logger logged at ``WARNING`` or above.
    """
    logger = logging.getLogger(LOGGER)
    records = _Records()
    level = logger.level
    # Records below the logger's level are never created; make sure a
    # warning is, whatever level the root logger has (a page may call
    # logging.basicConfig).
    logger.setLevel(
        logging.WARNING
        if logger.getEffectiveLevel() > logging.WARNING
        else level
    )
    logger.addHandler(records)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            for category, message in THIRD_PARTY:
                warnings.filterwarnings('ignore', message, category)
            yield
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    logged = [
        f'{record.name}: {record.getMessage()}' for record in records.records
    ]
    assert not logged, f'{what} logged warnings: {logged}'
