"""Parameters shared by several modules: one layer, or none.

A weight (or bias) used by several modules gets one set of factors or is
left to the optimizer, never preconditioned twice nor with the factors of
one use alone:

* modules sharing their parameters *in the same role* (helpers of one
  type, gradient shape, weight, bias and
  [`call_settings`][kfac.layers.helper.ModuleHelper.call_settings]; for a
  grouped convolution, group by group) are the first one's layers, whose
  calls are every sharer's calls (further weight-sharing positions of
  the same examples);
* an embedding tied to a bias-free Linear head is one
  [`TiedHelper`][kfac.layers.tied.TiedHelper] layer, the first one's,
  combining both uses (see [`kfac.layers.tied`][kfac.layers.tied]);
* any other sharing (a module that is not preconditioned, a head with a
  bias, a convolution with another stride, a sharer with other per-module
  options) leaves every module involved to the optimizer, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from kfac.layers.attention import AttentionProjectionHelper
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.helper import ModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.tied import TiedHelper

__all__ = ['tie']


def tie(
    modules: Mapping[str, nn.Module], helpers: dict[str, ModuleHelper]
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Group the modules that share parameters (`helpers` in place: the
    other sharers' helpers are removed, a tied pair's replaced).

    Args:
        modules: every module of the model by dotted name, in model order.
        helpers: the registered helpers by layer name, in model order.

    Returns:
        `{layer name: the other sharers' module names}` (whose calls are
            the layer's calls), and `(module name, reason)` for each
            module left to the optimizer.
    """
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        for _, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    names = {id(module): name for name, module in modules.items()}
    layers: dict[str, list[str]] = {}
    for key, helper in helpers.items():
        if not isinstance(helper, AttentionProjectionHelper):
            layers.setdefault(names[id(helper.module)], []).append(key)
    aliases: dict[str, list[str]] = {}
    skipped: list[tuple[str, str]] = []
    for keys in layers.values():
        if keys[0] not in helpers:
            continue  # one of an earlier module's sharers
        helper = helpers[keys[0]]
        params = [p for p in (helper.weight, helper.bias) if p is not None]
        sharing = {user for p in params for user in owners.get(id(p), [])}
        users = [name for name in modules if name in sharing]
        if len(users) == 1:
            continue
        first, *others = users
        tied = _transposed(helpers, users)
        held = {
            user: [helpers[k] for k in layers.get(user, []) if k in helpers]
            for user in users
        }
        differences = (_difference(held[first], held[u]) for u in others)
        difference = next((d for d in differences if d), None)
        if tied is not None or difference is None:
            if tied is not None:
                helpers[first] = tied
            for key in layers[first]:
                aliases[key] = others
            for user in others:
                for key in layers.get(user, []):
                    del helpers[key]
            continue
        what = 'weight' if len(owners[id(helper.weight)]) > 1 else 'bias'
        for user in users:
            removed = [helpers.pop(k, None) for k in layers.get(user, [])]
            if any(removed):
                shared = ', '.join(u for u in users if u != user)
                skipped.append(
                    (
                        user,
                        f'{what} shared with {shared} {difference}: left to '
                        'the optimizer',
                    )
                )
    return aliases, skipped


def _difference(
    firsts: list[ModuleHelper], others: list[ModuleHelper]
) -> str | None:
    """How another module's layers differ from the first module's (None:
    they are the same layers in the same role).
    """
    if not firsts or len(others) != len(firsts):
        return 'in another role'
    for first, other in zip(firsts, others):
        if not (
            type(first) is type(other)
            and first.grad_shape == other.grad_shape
            and first.weight is other.weight
            and first.bias is other.bias
        ):
            return 'in another role'
        mine, theirs = first.call_settings, other.call_settings
        differ = [key for key in mine if mine[key] != theirs[key]]
        if differ:
            return f'called with another {", ".join(differ)}'
    return None


def _transposed(
    helpers: Mapping[str, ModuleHelper], users: list[str]
) -> TiedHelper | None:
    """The tied helper of an embedding and a bias-free Linear head sharing
    its weight, or None for any other set of users.
    """
    if len(users) != 2:
        return None
    by_kind = {type(helpers.get(user)): user for user in users}
    emb_name = by_kind.get(EmbeddingModuleHelper)
    head_name = by_kind.get(LinearModuleHelper)
    if emb_name is None or head_name is None:
        return None
    embedding, head = helpers[emb_name], helpers[head_name]
    if head.bias is not None:
        return None
    return TiedHelper(embedding, head, (emb_name, head_name))
