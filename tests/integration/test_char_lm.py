"""K-FAC against AdamW on a character language model (``make integration``).

Trains the GPT of ``make demo-lm`` (token and position embeddings, 4
pre-norm blocks with causal ``nn.MultiheadAttention``, a head tied to the
token embedding) on the committed King James text twice, with AdamW and
with AdamW + K-FAC (``loss_average='batch+sequence'``), from the same
initial weights on the same batches with the same learning-rate schedule,
for the demo's number of steps, and requires K-FAC to reach AdamW's final
validation loss at an earlier evaluation than AdamW's last.
``examples/README.md`` records the measured numbers.
"""

from __future__ import annotations

import pytest

from examples import char_lm

pytestmark = pytest.mark.integration


@pytest.mark.timeout(3600)
def test_kfac_reaches_adamw_loss_in_fewer_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    histories = char_lm.main(['--seed', '0', '--no-plot'])
    adamw, kfac = histories['adamw'], histories['kfac']
    assert adamw.steps == kfac.steps  # the same budget and evaluations
    target = adamw.val_loss[-1]
    with capsys.disabled():
        print('\n' + char_lm.format_summary([adamw, kfac], target))
    reached = kfac.reaching(target)
    assert reached is not None, (
        f'K-FAC ended at validation loss {kfac.val_loss[-1]:.4f}, above '
        f"AdamW's final {target:.4f}"
    )
    assert reached[0] < adamw.steps[-1], (
        f"K-FAC reached AdamW's final validation loss {target:.4f} at step "
        f'{reached[0]}, AdamW at step {adamw.steps[-1]}'
    )
