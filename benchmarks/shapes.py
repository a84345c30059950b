"""Layer shapes of ResNet-50 and BERT-Large, for the scaling model.

Written from the architectures, not from a model zoo:

* ResNet-50 (He et al., 2016; torchvision's v1.5 layout, stride on the
  3x3 convolution): a 7x7 stem, four stages of bottleneck blocks
  ``(width, blocks) = (64, 3), (128, 4), (256, 6), (512, 3)`` with
  expansion 4, a 1x1 projection shortcut on each stage's first block, and a
  1000-way classifier. Convolutions have no bias (batch norm follows).
* BERT-Large (Devlin et al., 2019): 24 encoder layers of width 1024 with
  the ``query``, ``key``, ``value`` and attention-output projections, a
  4096-wide feed-forward pair, and the pooler. The embeddings (not Linear)
  and the pre-training heads are left out, as KAISA's BERT runs skip them
  (the tied vocabulary decoder alone would have a ``30522²`` ``G``).
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.floor import LayerShape

__all__ = ['SCALING_MODELS', 'bert_large_shapes', 'resnet50_shapes']


def _conv(name: str, c_in: int, c_out: int, kernel: int) -> LayerShape:
    return LayerShape(name, c_in * kernel * kernel, c_out)


def _bottleneck(
    name: str, c_in: int, width: int, project: bool
) -> list[LayerShape]:
    layers = [
        _conv(f'{name}.conv1', c_in, width, 1),
        _conv(f'{name}.conv2', width, width, 3),
        _conv(f'{name}.conv3', width, 4 * width, 1),
    ]
    if project:
        layers.append(_conv(f'{name}.downsample.0', c_in, 4 * width, 1))
    return layers


def resnet50_shapes(classes: int = 1000) -> list[LayerShape]:
    """The 53 convolutions and the classifier of ResNet-50, in order."""
    layers = [_conv('conv1', 3, 64, 7)]
    c_in = 64
    stages = ((64, 3), (128, 4), (256, 6), (512, 3))
    for stage, (width, blocks) in enumerate(stages, start=1):
        for block in range(blocks):
            name = f'layer{stage}.{block}'
            layers += _bottleneck(name, c_in, width, project=block == 0)
            c_in = 4 * width
    layers.append(LayerShape('fc', c_in + 1, classes))
    return layers


def bert_large_shapes(
    layers: int = 24,
    hidden: int = 1024,
    intermediate: int = 4096,
) -> list[LayerShape]:
    """The Linear layers of the BERT-Large encoder and pooler, in order."""
    shapes = []
    for i in range(layers):
        prefix = f'encoder.layer.{i}'
        for proj in ('query', 'key', 'value'):
            shapes.append(
                LayerShape(
                    f'{prefix}.attention.self.{proj}', hidden + 1, hidden
                )
            )
        shapes += [
            LayerShape(f'{prefix}.attention.output.dense', hidden + 1, hidden),
            LayerShape(
                f'{prefix}.intermediate.dense', hidden + 1, intermediate
            ),
            LayerShape(f'{prefix}.output.dense', intermediate + 1, hidden),
        ]
    shapes.append(LayerShape('pooler.dense', hidden + 1, hidden))
    return shapes


#: Scaling model name -> its layer shapes.
SCALING_MODELS: dict[str, Callable[[], list[LayerShape]]] = {
    'resnet50': resnet50_shapes,
    'bert_large': bert_large_shapes,
}
