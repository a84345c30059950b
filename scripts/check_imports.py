"""Import rules that `lint-imports` cannot express; run by `make lint`.

1. No cycle among the modules of `kfac` (imports under `if TYPE_CHECKING:`
   do not count: they are not executed).
2. No function-level import of a `kfac` module (a function that imports
   `kfac` hides a dependency from the layering checked by `lint-imports`).

Exits with status 1 and names every cycle and function-level import found.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterable
from collections.abc import Mapping

import grimp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one
    module (or a module importing itself), each sorted (Tarjan).
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def function_level_imports(source: str) -> list[tuple[int, str]]:
    """`(line, module)` of every import of `kfac` inside a function."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom) and inner.module:
                names = [inner.module]
            else:
                continue
            found.extend(
                (inner.lineno, name)
                for name in names
                if name == 'kfac' or name.startswith('kfac.')
            )
    return sorted(set(found))


def import_graph() -> dict[str, set[str]]:
    """`kfac`'s runtime import graph: module -> modules it imports."""
    graph = grimp.build_graph('kfac', exclude_type_checking_imports=True)
    return {
        module: set(graph.find_modules_directly_imported_by(module))
        for module in graph.modules
    }


def main() -> int:
    """Check both rules; print what breaks them."""
    problems = [
        'import cycle: ' + ' <-> '.join(component)
        for component in cycles(import_graph())
    ]
    for path in sorted((ROOT / 'kfac').rglob('*.py')):
        for line, module in function_level_imports(path.read_text()):
            where = path.relative_to(ROOT)
            problems.append(
                f'{where}:{line}: function-level import of {module}'
            )
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print('import rules: no cycle, no function-level import of kfac')
    return 0


if __name__ == '__main__':
    sys.exit(main())
