"""``scripts/check_imports.py`` (``make lint``): it finds cycles and
function-level imports, and the package has neither.
"""

from __future__ import annotations

import ast

from scripts import check_imports


def test_a_cycle_is_found_and_a_chain_is_not() -> None:
    chain = {'a': {'b'}, 'b': {'c'}, 'c': set()}
    assert check_imports.cycles(chain) == []
    looped = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
    assert check_imports.cycles(looped) == [['a', 'b', 'c']]
    assert check_imports.cycles({'a': {'a'}}) == [['a']]


def test_function_level_imports_of_kfac_are_found() -> None:
    source = (
        'import torch\n'
        'from kfac import math\n'
        'def f():\n'
        '    import kfac.layers\n'
        '    from kfac.state import parse_state\n'
        '    from torch import nn\n'
        'class C:\n'
        '    def g(self):\n'
        '        import kfac\n'
    )
    assert check_imports.function_level_imports(source) == [
        (4, 'kfac.layers'),
        (5, 'kfac.state'),
        (9, 'kfac'),
    ]


def test_kfac_keeps_the_rules() -> None:
    graph = check_imports.import_graph()
    assert 'kfac.base_preconditioner' in graph  # the scan sees the package
    assert check_imports.main() == 0


COLLECTIVES = {
    'all_reduce',
    'broadcast',
    'all_gather',
    'all_gather_into_tensor',
    'all_gather_object',
    'scatter',
    'reduce_scatter',
    'reduce_scatter_tensor',
    'barrier',
    'new_group',
    'new_subgroups',
    'all_to_all',
    'send',
    'recv',
    'isend',
    'irecv',
}
"""The communicating functions of `torch.distributed` (their async forms
are the same functions with `async_op=True`)."""

COMMUNICATOR_METHODS = {
    'allreduce',
    'allreduce_bucketed',
    'broadcast',
    'all_gather_rows',
    'scatter',
    'flush',
}
"""The collective methods of `TorchDistributedCommunicator`."""


def _collective_calls(source: str) -> list[tuple[int, str]]:
    """`(line, call)` of every `torch.distributed` collective and every
    collective method called on a communicator.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        ):
            continue
        receiver = ast.unparse(node.func.value)
        attr = node.func.attr
        if receiver in ('dist', 'torch.distributed') and attr in COLLECTIVES:
            found.append((node.lineno, f'{receiver}.{attr}'))
        if 'comm' in receiver.lower() and attr in COMMUNICATOR_METHODS:
            found.append((node.lineno, f'{receiver}.{attr}'))
    return found


def test_the_collective_scan_finds_both_kinds() -> None:
    source = (
        'dist.all_reduce(t)\n'
        'torch.distributed.barrier()\n'
        'self.communicator.allreduce(t)\n'
        'comm.scatter(out, chunks, src=0)\n'
        'held.scatter()\n'
        'dist.get_rank()\n'
    )
    assert [call for _, call in _collective_calls(source)] == [
        'dist.all_reduce',
        'torch.distributed.barrier',
        'self.communicator.allreduce',
        'comm.scatter',
    ]


def test_every_collective_is_issued_in_kfac_distributed() -> None:
    kfac = check_imports.ROOT / 'kfac'
    outside: list[str] = []
    inside = 0
    for path in sorted(kfac.rglob('*.py')):
        calls = _collective_calls(path.read_text())
        if path.is_relative_to(kfac / 'distributed'):
            inside += len(calls)
        elif path != kfac / 'checkpoint.py':  # DCP: the one exception
            outside.extend(f'{path.name}:{line}: {c}' for line, c in calls)
    assert inside >= 5, 'the scan must see the collectives where they are'
    assert not outside, f'collectives outside kfac.distributed: {outside}'
