"""kfac.layers.curvature.base: the interface's defaults, and how a method
object is given and refused.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import ClassVar

import pytest
import torch
from torch import nn

from kfac.config import KFACConfig
from kfac.config import StatisticsConfig
from kfac.enums import AssignmentStrategy
from kfac.enums import BasisRefresh
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature import Curvature
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import Decomposed
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import EKFACConfig
from kfac.layers.curvature import InverseConfig
from kfac.layers.curvature.base import Layout
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.factory import make_layer
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.options import ModuleOptions
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP


class Identity(Curvature):
    """Preconditions with the identity: only the required methods."""

    format = 'identity'

    def layout(self, name: str) -> Layout:
        return (((1,), False),)

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        return Decomposed((torch.ones(1, dtype=dtype),), None)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        return grad


@dataclasses.dataclass(frozen=True)
class IdentityConfig(CurvatureConfig):
    name: ClassVar[str] = 'identity'

    def make(self, layer: KFACBaseLayer) -> Identity:
        return Identity(layer)


def test_defaults_of_the_interface() -> None:
    """A curvature with only the required methods holds no statistics of
    its own, is costed as KAISA costs a factor, and finalizes as given.
    """
    layer = KFACBaseLayer(
        EmbeddingModuleHelper(nn.Embedding(6, 4)), curvature=IdentityConfig()
    )
    curvature = layer.curvature
    assert repr(curvature) == 'Identity()'
    assert repr(layer).endswith(', identity)')
    assert not curvature.bases_everywhere and not curvature.keeps_examples
    assert not curvature.reduces_statistics
    assert curvature.batch_statistics() == {}
    curvature.update_statistics({}, 0.9, 0.1, preconditions=True)
    curvature.restart()
    curvature.follow()
    curvature.load_statistics({}, restored=False)
    assert curvature.statistic_shapes() == {}
    assert curvature.saved_statistics() == {}
    assert curvature.memory_usage() == {}
    ones = (torch.ones(1),)
    assert curvature.finalize('A', ones, 0.1) is ones
    compute, memory = AssignmentStrategy.COMPUTE, AssignmentStrategy.MEMORY
    assert curvature.cost('A', compute) == 6.0  # diagonal: its length
    assert curvature.cost('G', compute) == 64.0
    assert curvature.cost('G', memory) == 16.0
    assert layer.statistics.examples is None


def test_layer_refuses_what_is_not_a_curvature_config() -> None:
    helper = LinearModuleHelper(nn.Linear(2, 2))
    with pytest.raises(TypeError, match='curvature must be'):
        KFACBaseLayer(helper, curvature='eigen')  # type: ignore[arg-type]
    assert type(KFACBaseLayer(helper).curvature).__name__ == (
        'InverseCurvature'
    )


@dataclasses.dataclass(frozen=True)
class WideOnlyConfig(CurvatureConfig):
    """A method that refuses layers narrower than 4 inputs."""

    name: ClassVar[str] = 'wide-only'

    def make(self, layer: KFACBaseLayer) -> Identity:
        if layer.helper.in_features < 4:
            raise ValueError('needs at least 4 inputs')
        return Identity(layer)


class Colour(enum.Enum):
    RED = 'red'
    BLUE = 'blue'


@dataclasses.dataclass(frozen=True)
class ColourConfig(IdentityConfig):
    """A method with an enum option of its own (a plain `enum.Enum`)."""

    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'colour': Colour,
        'refresh': BasisRefresh,
    }
    colour: Colour | str = Colour.RED
    refresh: BasisRefresh | str = BasisRefresh.EIGH


def test_the_options_named_in_enums_are_parsed() -> None:
    config = ColourConfig(colour='blue', refresh='QR')
    assert config.colour is Colour.BLUE
    assert config.refresh is BasisRefresh.QR
    # a plain enum matches its values exactly; the library's ignore case
    with pytest.raises(ValueError, match=r"is not a Colour; allowed: 'red'"):
        ColourConfig(colour='Blue')
    with pytest.raises(TypeError, match='colour'):
        ColourConfig(colour=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r'allowed \(case-insensitive\)'):
        ColourConfig(refresh='lanczos')


def test_a_method_refusing_a_module_names_it() -> None:
    helper = LinearModuleHelper(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="^module 'm': needs at least 4"):
        make_layer('m', helper, method=WideOnlyConfig())


def test_config_takes_a_method_object() -> None:
    config = KFACConfig(compute_method=IdentityConfig())
    assert config.curvature() == IdentityConfig()
    layer = config.make_layer(
        'fc1', LinearModuleHelper(TinyMLP().fc1), ModuleOptions()
    )
    assert isinstance(layer.curvature, Identity)
    given = EigenConfig(basis_refresh='qr')
    assert KFACConfig(compute_method=given).curvature() is given


@pytest.mark.parametrize(
    ('options', 'match'),
    [
        (
            {
                'compute_method': EigenConfig(),
                'compute_eigenvalue_outer_product': False,
            },
            'compute_eigenvalue_outer_product=False beside compute_method=',
        ),
        (
            {'compute_method': EigenConfig(), 'colocate_factors': False},
            'compute_eigenvalue_outer_product=True needs colocate',
        ),
    ],
)
def test_config_refuses_what_contradicts_the_method_object(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        KFACConfig(**options)  # type: ignore[arg-type]  # the options above
    prediv_off = EigenConfig(prediv_eigenvalues=False)
    assert not KFACConfig(
        compute_method=prediv_off, colocate_factors=False
    ).colocate_factors


def test_a_module_takes_its_own_method() -> None:
    """`module_options` carries a method object per module; the report
    names its source.
    """
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model,
        compute_method=EigenConfig(factor_rank=2),
        module_options={'fc2': {'compute_method': InverseConfig()}},
    )
    assert precon.layers['fc1'].decomposition_format == 'eigen_lowrank'
    assert precon.layers['fc2'].decomposition_format == 'inverse'
    report = {e['name']: e for e in precon.describe()['preconditioned']}
    source = report['fc2']['options']['compute_method']['source']
    assert source == "module_options['fc2']"


def test_whole_config_or_keywords_not_both() -> None:
    config = KFACConfig(compute_method='eigen')
    precon = KFACPreconditioner(TinyMLP(), config=config, damping=0.1)
    assert precon.config is config and precon.damping == 0.1
    with pytest.raises(ValueError, match='colocate_factors=False beside'):
        KFACPreconditioner(TinyMLP(), config=config, colocate_factors=False)
    with pytest.raises(ValueError, match='statistics=StatisticsConfig'):
        KFACPreconditioner(
            TinyMLP(), config=config, statistics=StatisticsConfig()
        )
    with pytest.raises(TypeError, match='config must be None or a'):
        KFACPreconditioner(TinyMLP(), config={'compute_method': 'eigen'})  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(TypeError, match='statistics must be a'):
        KFACConfig(statistics={'batch_first': False})  # type: ignore[arg-type]  # wrong on purpose


def test_library_curvatures_name_their_options() -> None:
    """Each curvature's repr shows its method's config; an EKFAC layer
    moved before its scaling exists moves nothing of it.
    """
    helper = LinearModuleHelper(nn.Linear(4, 3).double())
    for config in (EigenConfig(), InverseConfig(), EKFACConfig()):
        layer = KFACBaseLayer(helper, curvature=config)
        assert repr(layer.curvature) == (
            f'{type(layer.curvature).__name__}({config})'
        )
    ekfac = KFACBaseLayer(helper, curvature=EKFACConfig())
    helper.module.float()
    assert ekfac.follow_module()
    assert ekfac.curvature.saved_statistics() == {}
