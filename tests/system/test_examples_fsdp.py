"""`examples/train_fsdp.py` trains under FSDP2 and resumes exactly.

At W = 2 (gloo), for COMM-OPT with SGD and MEM-OPT with AdamW: six steps
straight, against three steps with a DCP checkpoint then a resume from it
for the last three. The checkpoint falls between two decomposition updates
(every 5 steps), so the resumed steps 3 and 4 precondition with the saved
decompositions. The resumed run must end with bitwise the same parameters
and report bitwise the same losses; the loss must have decreased.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples import train_fsdp
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU

SMALL = [
    '--vocab', '32', '--width', '32', '--depth', '2', '--heads', '2',
    '--seq-len', '12', '--batch-size', '8', '--inv-update-steps', '5',
]  # fmt: skip
CASES = {
    'comm_opt sgd': ['--strategy', 'comm_opt'],
    'mem_opt adamw': ['--strategy', 'mem_opt', '--optimizer', 'adamw'],
}


def _whole(run: train_fsdp.Run) -> torch.Tensor:
    parts = [
        p.full_tensor() if isinstance(p, DTensor) else p
        for p in run.model.parameters()
    ]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _body(out_dir: str) -> None:
    results = {}
    for label, options in CASES.items():
        directory = str(pathlib.Path(out_dir) / label.replace(' ', '-'))
        argv = [*SMALL, *options]
        straight = train_fsdp.train(
            train_fsdp.parse_args([*argv, '--steps', '6'])
        )
        first = train_fsdp.train(
            train_fsdp.parse_args(
                [*argv, '--steps', '3', '--checkpoint', directory]
            )
        )
        resumed = train_fsdp.train(
            train_fsdp.parse_args(
                [*argv, '--steps', '6', '--checkpoint', directory, '--resume']
            )
        )
        results[label] = {
            'straight': straight.losses,
            'first': first.losses,
            'resumed': resumed.losses,
            'start': resumed.start,
            'equal': torch.equal(_whole(straight), _whole(resumed)),
            'moved': not torch.equal(_whole(straight), _whole(first)),
        }
    if dist.get_rank() == 0:
        (pathlib.Path(out_dir) / 'results.json').write_text(
            json.dumps(results)
        )


@FSDP2_ON_CPU
@pytest.mark.timeout(120)
def test_train_fsdp_resumes_exactly(tmp_path: pathlib.Path) -> None:
    run_distributed(_body, 2, str(tmp_path), tmp_path=tmp_path, timeout=110)
    results = json.loads((tmp_path / 'results.json').read_text())
    assert set(results) == set(CASES)
    for label, result in results.items():
        straight = result['straight']
        assert len(straight) == 6, label
        assert result['start'] == 3, label
        assert result['first'] == straight[:3], label
        assert result['resumed'] == straight[3:], label
        assert result['equal'], label
        assert result['moved'], label  # steps 3-5 changed the parameters
        assert straight[-1] < straight[0] - 0.1, (label, straight)
