"""Attention in a rotated space: rotate the query, never the stored keys (rotated ``quant`` layouts and ``turbo``).

A rotated layout stores codes of x R (R orthogonal). Giving attention deq(codes) R^T back costs a D x D product per
stored token, layer and forward: O(n D^2). The same attention, exactly:

* keys: (q R) . (k R)^T = q k^T, so the query is rotated (O(D^2) per query token) and the stored keys are read as
  they are, in the rotated space;
* values: softmax(...) (V R) = (softmax(...) V) R, so attention runs over the rotated values and its output is
  rotated back by R^T (O(D^2) per query token);
* ``turbo`` keys with the QJL residual (``keys=prod``): the key estimate is n (y + ||r|| c S^T s) P^T (c =
  sqrt(pi/2) / D, s the signs of S r), so q . k_hat = n (q P) . y + n ||r|| c (S (q P)) . s. One attention call
  gives both terms over a doubled head dim: q' = [q P, c S (q P)], k' = [n y, n ||r|| s] (exact tokens:
  [k P, 0]), with the softmax scale the model's own (1/sqrt(D), not 1/sqrt(2D): ``scaling`` is passed explicitly).

The model computes attention itself after the cache's ``update``, so the rotation of the query and of the output is
done by wrapping the model's own attention function (sdpa or eager: Gemma 2's softcap and sliding windows stay the
model's) through transformers' public attention registry (``AttentionInterface.register`` and
``model.set_attn_implementation``). A runtime whose policy attends in a rotated space (:class:`AttentionSpace`)
installs the wrapper on its model (:class:`Installed`) and restores the model's own implementation when the last such
runtime on that model is gone. The wrapper is transparent outside the forwards of a rotated cache (another runtime's
full cache on the same model attends as before), and a rotated cache whose forward is not wrapped (a model whose
attention is neither sdpa nor eager, or a call outside a runtime) gives attention the keys and values rotated back,
as before: the same attention, slower.
"""

from __future__ import annotations

import sys
import weakref
from contextvars import ContextVar

import torch.nn.functional as F
from torch import Tensor

PREFIX = "decodelab_kv_space_"  # the wrapper of the model's own ``X`` is registered as PREFIX + X
WRAPPABLE = ("sdpa", "eager")  # the model's own implementations the wrapper can call
_active: ContextVar[AttentionSpace | None] = ContextVar("decodelab_kv_space", default=None)
_installs: dict[int, list] = {}  # id(model) -> [holders, the model's own implementation]


class AttentionSpace:
    """A policy's attention space: ``keys`` and ``values`` are its layouts (each gives ``query_to_space`` /
    ``output_from_space``); ``on`` while a wrapped forward runs, so that the cache's layers give attention the
    stored tokens in the space (and the exact ones rotated into it) instead of rotated back."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.on = False

    def __enter__(self) -> AttentionSpace:
        self.on, self._token = True, _active.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.reset(self._token)
        self.on = False


def inner_function(module, implementation: str):
    """The model's own attention function: transformers' sdpa from the registry, or the eager function of the
    attention module's own modeling file (the default the module hands the registry when it asks for eager)."""
    from transformers import AttentionInterface

    if implementation == "sdpa":
        return AttentionInterface()["sdpa"]
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward")


def wrapper_of(implementation: str):
    """The registered wrapper of the model's own ``implementation``: q -> q R (the query into the keys' space), the
    model's own attention over the cache's keys and values as they are, its output o -> o R^T (out of the values'
    space). Outside a rotated cache's forward: the model's own attention, untouched."""

    inner_of: dict[type, object] = {}  # attention module class -> the model's own function (looked up once)

    def space_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, **kwargs):
        inner = inner_of.get(type(module))
        if inner is None:
            inner = inner_of[type(module)] = inner_function(module, implementation)
        space = _active.get()
        if space is None:
            return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if scaling is None:  # sdpa's and eager's default, from the head dim before any widening (turbo's prod keys)
            scaling = query.shape[-1] ** -0.5
        width = value.shape[-1]
        if implementation == "sdpa" and key.shape[-1] != width:  # turbo's prod keys: torch's fused kernels want
            value = F.pad(value, (0, key.shape[-1] - width))  # one head dim (zeros: the output's extra dims are 0)
        out, weights = inner(module, space.keys.query_to_space(query), key, value, attention_mask, scaling=scaling,
                             **kwargs)
        if out.shape[-1] != width:  # the padded value dims (zero) dropped
            out = out[..., :width]
        return space.values.output_from_space(out), weights

    return space_attention


def registered(implementation: str) -> str:
    """The wrapper's name for the model's own ``implementation``, registered (once) with the model's own attention
    mask function: the masks transformers builds for it are the ones the model builds for itself."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = PREFIX + implementation
    if name not in AttentionInterface():
        AttentionInterface.register(name, wrapper_of(implementation))
        AttentionMaskInterface.register(name, AttentionMaskInterface()[implementation])
    return name


def own_implementation(model) -> str | None:
    """The model's attention implementation as its config names it (None for a stand-in without a config); transformers
    5.25 has no public getter, so this is the one place that reads the config's ``_attn_implementation``."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def can_wrap(model) -> bool:
    """Whether the model's own attention is one the wrapper can call (sdpa or eager), through the registry (not
    GPT-2's reordered-and-upcast eager variant, which the model runs outside it; not a stand-in without
    ``set_attn_implementation``)."""
    own = _installs[id(model)][1] if id(model) in _installs else own_implementation(model)
    return own in WRAPPABLE and hasattr(model, "set_attn_implementation") and \
        not getattr(model.config, "reorder_and_upcast_attn", False) and (own == "sdpa" or eager_findable(model))


def eager_findable(model) -> bool:
    """Every attention layer's modeling file defines the eager function the wrapper would call."""
    files = {type(m).__module__ for m in model.modules() if hasattr(m, "layer_idx")}
    return bool(files) and all(hasattr(sys.modules.get(name), "eager_attention_forward") for name in files)


class Installed:
    """The wrapper installed on ``model`` for as long as this object lives (one per runtime whose policy attends
    in a space); the model's own implementation is set back when the last one on the model is gone."""

    def __init__(self, model):
        key = id(model)
        if key not in _installs:
            own = own_implementation(model)
            model.set_attn_implementation(registered(own))
            _installs[key] = [0, own]
        _installs[key][0] += 1
        weakref.finalize(self, release, weakref.ref(model), key)


def release(model_ref, key: int) -> None:
    """One holder gone; the last one sets the model's own implementation back (unless something else set another
    one meanwhile)."""
    entry = _installs.get(key)
    if entry is None:
        return
    entry[0] -= 1
    if entry[0] > 0:
        return
    del _installs[key]
    model = model_ref()
    if model is not None and own_implementation(model) == PREFIX + entry[1]:
        model.set_attn_implementation(entry[1])


def install_for(model, space: AttentionSpace | None) -> Installed | None:
    """What a runtime holds: the wrapper installed for a policy with an attention space on a model it can wrap,
    else None (the policy's layers then rotate back, as without the wrapper)."""
    if space is None or not can_wrap(model):
        return None
    return Installed(model)
