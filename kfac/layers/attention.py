"""`nn.MultiheadAttention` with projections K-FAC can see.

`nn.MultiheadAttention` applies its query, key and value projections
(rows of the packed `in_proj_weight`, or `q_proj_weight`,
`k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ) and its
`out_proj` inside one functional kernel, so no module hook sees their
inputs and output gradients.
[`convert_attention`][kfac.layers.attention.convert_attention] turns each
instance, in place, into a
[`KFACMultiheadAttention`][kfac.layers.attention.KFACMultiheadAttention]:
the same object with the same parameter objects and `state_dict` keys,
whose forward calls three parameterless projection modules and
`out_proj` as modules, so each gets its own K-FAC factors (one pair per
projection: q, k and v see different inputs in cross-attention, and each
is an ordinary Linear of `E` outputs).

The outputs are those of `nn.MultiheadAttention` (the attention itself is
`F.multi_head_attention_forward` with identity projections, exact in
floating point); the extra identity products cost about as much as the
projections. Convert before `torch.compile` captures the model (the
preconditioner converts the model it is given, and a `DistributedDataParallel`
or `fully_shard` wrapper is unaffected: parameters do not change).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.helper import Grads
from kfac.layers.helper import read_grad
from kfac.layers.helper import write_rows
from kfac.layers.modules import LinearModuleHelper

_NAMES = ('q_proj', 'k_proj', 'v_proj')
_SEPARATE = ('q_proj_weight', 'k_proj_weight', 'v_proj_weight')


class AttentionProjection(nn.Module):
    """The query, key or value projection of a converted attention module.

    It holds no parameter: its forward is `F.linear(x, weight, bias)` with
    the rows of its attention module's parameters it is given, so its
    hooks see the projection's input and output.

    Args:
        attention: the module it belongs to (held weakly).
        index: 0, 1 or 2 for the query, key or value projection.
    """

    def __init__(self, attention: nn.MultiheadAttention, index: int) -> None:
        super().__init__()
        self.index = index
        # Weakly, and not as a submodule: the parent owns this module.
        self._attention = weakref.ref(attention)

    @property
    def attention(self) -> nn.MultiheadAttention:
        """The attention module this projection belongs to."""
        attention = self._attention()
        if attention is None:
            raise RuntimeError('the attention module no longer exists')
        return attention

    def parameters_slices(
        self,
    ) -> tuple[torch.Tensor, slice, torch.Tensor | None]:
        """The weight parameter, the rows it uses, and the bias parameter
        (None without a bias); rows of the bias as of the weight.
        """
        attention = self.attention
        e = attention.embed_dim
        if attention._qkv_same_embed_dim:
            weight = attention.in_proj_weight
            rows = slice(self.index * e, (self.index + 1) * e)
        else:
            weight = getattr(attention, _SEPARATE[self.index])
            rows = slice(0, e)
        bias = attention.in_proj_bias
        return weight, rows, bias

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)`."""
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:  # noqa: D102
        return f'index={self.index}'


class KFACMultiheadAttention(nn.MultiheadAttention):
    """`nn.MultiheadAttention` calling its projections as modules.

    Made by [`convert_attention`][kfac.layers.attention.convert_attention],
    never constructed directly; its outputs equal those of
    `nn.MultiheadAttention`.
    """

    q_proj: AttentionProjection
    k_proj: AttentionProjection
    v_proj: AttentionProjection

    def _project(self, index: int, x: torch.Tensor) -> torch.Tensor:
        projection: AttentionProjection = getattr(self, _NAMES[index])
        weight, rows, bias = projection.parameters_slices()
        e = self.embed_dim
        b = None if bias is None else bias[index * e : (index + 1) * e]
        out: torch.Tensor = projection(x, weight[rows], b)
        return out

    def forward(  # noqa: D102
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        is_batched = query.dim() == 3
        q, k, v = (
            self._project(i, x) for i, x in enumerate((query, key, value))
        )
        # As nn.MultiheadAttention.forward: masks in the query's dtype.
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name='key_padding_mask',
            other_type=F._none_or_dtype(attn_mask),
            other_name='attn_mask',
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name='attn_mask',
            other_type=None,
            other_name='',
            target_type=query.dtype,
            check_other=False,
        )
        if self.batch_first and is_batched:
            q, k, v = (x.transpose(1, 0) for x in (q, k, v))
        eye = torch.eye(self.embed_dim, dtype=q.dtype, device=q.device)
        out, weights = F.multi_head_attention_forward(
            q,
            k,
            v,
            self.embed_dim,
            self.num_heads,
            None,
            None,
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            self.dropout,
            eye,
            None,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        if self.batch_first and is_batched:
            out = out.transpose(1, 0)
        return self.out_proj(out), weights


def convert_attention(model: nn.Module) -> list[str]:
    """Make every `nn.MultiheadAttention` of `model` a
    [`KFACMultiheadAttention`][kfac.layers.attention.KFACMultiheadAttention],
    in place.

    The modules keep their identity, parameters, buffers and `state_dict`
    keys (the projections added hold no parameter); an instance already
    converted is left as it is.

    Returns:
        The dotted names of the modules converted.
    """
    converted = []
    for name, module in model.named_modules():
        if type(module) is not nn.MultiheadAttention:
            continue
        module.__class__ = KFACMultiheadAttention
        for index, child in enumerate(_NAMES):
            module.add_module(child, AttentionProjection(module, index))
        converted.append(name)
    return converted


class AttentionProjectionHelper(LinearModuleHelper):
    """K-FAC's view of an attention projection: a Linear of `E` outputs
    whose weight is rows of a packed parameter (see
    [`AttentionProjection`][kfac.layers.attention.AttentionProjection]).

    Args:
        module: the projection.
    """

    module: AttentionProjection

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, AttentionProjection):
            raise TypeError(
                'AttentionProjectionHelper needs an AttentionProjection; got '
                f'{type(module).__name__}',
            )
        self.module = module

    def _parts(self) -> tuple[torch.Tensor, slice, torch.Tensor | None]:
        return self.module.parameters_slices()

    @property
    def weight(self) -> torch.Tensor:
        """The parameter holding the projection's weight (its rows are
        [`rows`][kfac.layers.attention.AttentionProjectionHelper.rows]).
        """
        return self._parts()[0]

    @property
    def rows(self) -> slice:
        """The rows of `weight` (and of the bias) this projection uses."""
        return self._parts()[1]

    @property
    def bias(self) -> torch.Tensor | None:
        """The packed bias parameter if it exists and is trained."""
        bias = self._parts()[2]
        return bias if bias is not None and bias.requires_grad else None

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """`(E, E)`."""
        e = self.module.attention.embed_dim
        return (e, e)

    @property
    def in_features(self) -> int:
        """The projection's input size (`E`, `kdim` or `vdim`)."""
        return self.weight.shape[1]

    def get_grad(  # noqa: D102
        self, grads: Grads | None = None
    ) -> torch.Tensor | None:
        wgrad = read_grad(self.weight, grads)
        if wgrad is None:
            return None
        v = wgrad[self.rows]
        bias = self.bias
        if bias is not None:
            bgrad = read_grad(bias, grads)
            part = (
                torch.zeros_like(v[:, 0])
                if bgrad is None
                else bgrad[self._bias_rows()]
            )
            v = torch.cat([v, part[:, None]], dim=1)
        return v

    def _bias_rows(self) -> slice:
        e = self.module.attention.embed_dim
        index = self.module.index
        return slice(index * e, (index + 1) * e)

    def set_grad(  # noqa: D102
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        weight_part = grad if self.bias is None else grad[:, :-1]
        write_rows(self.weight, self.rows, weight_part, scale, grads)
        bias = self.bias
        if bias is not None:
            write_rows(bias, self._bias_rows(), grad[:, -1], scale, grads)
