"""``python -m benchmarks``: run the benchmarks, write JSON, print Markdown.

See ``benchmarks/README.md`` for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.compiled import MODES
from benchmarks.compiled import run_compiled
from benchmarks.machine import calibrate_linalg
from benchmarks.machine import machine_info
from benchmarks.machine import measure_rates
from benchmarks.models import MODELS
from benchmarks.overlap import overlap
from benchmarks.report import markdown
from benchmarks.scaling import scaling
from benchmarks.summary import run_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m benchmarks')
    parser.add_argument(
        '--models', nargs='+', default=list(MODELS), choices=list(MODELS)
    )
    parser.add_argument(
        '--threads',
        type=int,
        default=1,
        help='torch.set_num_threads (default 1: see README)',
    )
    parser.add_argument('--device', default='cpu')
    parser.add_argument(
        '--steps',
        type=int,
        default=50,
        help='timed steps of SGD and 10/100 configs (composed cycle)',
    )
    parser.add_argument(
        '--fi-steps', type=int, default=3, help='timed steps of 1/1 configs'
    )
    parser.add_argument(
        '--full-cycle',
        nargs='*',
        default=['mlp'],
        help='models whose 10/100 cycle is measured in full (steps 1-100)',
    )
    parser.add_argument(
        '--out', type=pathlib.Path, default=pathlib.Path('build/bench.json')
    )
    parser.add_argument(
        '--compiled-models',
        nargs='*',
        default=['mlp', 'transformer'],
        choices=list(MODELS),
        help='models also run compiled (torch.compile); none: skip',
    )
    parser.add_argument(
        '--compiled-steps',
        type=int,
        default=30,
        help='timed steps of the compiled study (SGD and 10/100)',
    )
    parser.add_argument(
        '--autotune-models',
        nargs='*',
        default=['mlp'],
        choices=list(MODELS),
        help="models also run compiled with mode='max-autotune-no-cudagraphs'",
    )
    parser.add_argument('--no-scaling', action='store_true')
    parser.add_argument('--no-bytecheck', action='store_true')
    parser.add_argument(
        '--no-overlap',
        action='store_true',
        help='skip the probe of factor allreduce overlap (2 gloo ranks)',
    )
    return parser


def bytecheck(world_sizes: Sequence[int] = (2, 3, 4)) -> dict[str, Any]:
    """Run :func:`benchmarks.bytecheck.check_rank` in gloo groups."""
    from benchmarks.bytecheck import check_rank
    from testing.distributed import run_distributed

    summary: dict[str, Any] = {}
    for world in world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp)
            run_distributed(
                check_rank, world, world, tmp, tmp_path=path, timeout=300
            )
            results = [
                r
                for rank in range(world)
                for r in json.loads((path / f'rank{rank}.json').read_text())
            ]
        matched = sum(bool(r['match']) for r in results)
        summary[str(world)] = {
            'cases': len(results) // world,
            'ranks': world,
            'matched': matched,
            'mismatched': len(results) - matched,
        }
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Run what the arguments ask; write the JSON; print the report."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    start = time.perf_counter()
    rates = measure_rates(device)
    result: dict[str, Any] = {
        'machine': machine_info(device),
        'rates': rates.as_dict(),
        'linalg': calibrate_linalg(rates, device),
        'settings': {k: str(v) for k, v in vars(args).items()},
        'models': {},
    }
    for name in args.models:
        print(f'benchmarking {name} ...', file=sys.stderr, flush=True)
        result['models'][name] = run_model(
            name,
            device=device,
            steps=args.steps,
            fi_steps=args.fi_steps,
            full_cycle=name in args.full_cycle,
        )
    result['compiled'] = {}
    studies = [(name, MODES[0]) for name in args.compiled_models]
    studies += [(name, MODES[1]) for name in args.autotune_models]
    for name, mode in studies:
        print(f'compiling {name} ({mode}) ...', file=sys.stderr, flush=True)
        key = name if mode == MODES[0] else f'{name} ({mode})'
        result['compiled'][key] = run_compiled(
            name,
            device=device,
            steps=args.compiled_steps,
            fi_steps=args.fi_steps,
            mode=mode,
        )
    if not args.no_scaling:
        result['scaling'] = scaling()
    if not args.no_bytecheck:
        result['bytecheck'] = bytecheck()
    if not args.no_overlap:
        result['overlap'] = overlap(list(args.models))
    result['seconds'] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f'wrote {args.out} in {result["seconds"]:.0f} s', file=sys.stderr)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
