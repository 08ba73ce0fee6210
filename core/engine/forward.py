"""The forward call: every call into a transformers model goes through :func:`forward`, so an API rename
(transformers 5 calls the cache argument ``cache=`` and returns ``outputs.cache``; 4.x used ``past_key_values``) is
handled here once. Also what a KV policy is told about the model (:func:`model_info`, :func:`rotary_parameters`) and
the attention weights of an eager forward (:func:`attention_weights`).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from ..kv import ModelInfo, Rotary
from ..kv.attention import own_implementation


def cache_kwarg(model) -> str:
    """The name of the KV-cache argument of this model's forward: 'cache' (transformers 5) or 'past_key_values'."""
    name = getattr(model, "_decodelab_cache_kwarg", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._decodelab_cache_kwarg = name
    return name


def forward(
    model,
    ids: Tensor,
    cache=None,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    logits_to_keep: int = 1,
    inference: bool = True,
) -> Tensor:
    """Run the model on ``ids`` [B, T] appending to ``cache``; returns float32 logits [B, logits_to_keep, V].

    ``logits_to_keep=0`` returns logits for all T positions. The cache object is updated in place.
    ``inference=False`` runs under no_grad instead of inference_mode: a cache that torch.compile mutates must not
    hold inference tensors.
    """
    with torch.inference_mode() if inference else torch.no_grad():
        return _forward(model, ids, cache, position_ids, attention_mask, logits_to_keep)


def _forward(model, ids, cache, position_ids, attention_mask, logits_to_keep) -> Tensor:
    kwargs = {cache_kwarg(model): cache, "use_cache": cache is not None, "logits_to_keep": logits_to_keep}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    out = model(input_ids=ids, **kwargs)
    return out.logits.float()


def forward_attending(
    model,
    ids: Tensor,
    cache,
    position_ids: Tensor,
    attention_mask: Tensor | None = None,
    logits_to_keep: int = 1,
) -> tuple[Tensor, tuple]:
    """:func:`forward` that also returns each layer's attention probabilities [B, H, T, cached + T] (for a KV
    policy that scores tokens by attention). Fused kernels return no weights, so the call runs under eager
    attention and the model's own implementation is restored afterwards; a model that still returns none gives
    ``None`` entries (the policy refuses it with one line)."""
    previous = own_implementation(model)
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": logits_to_keep,
                      "position_ids": position_ids, "output_attentions": True}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            out = model(input_ids=ids, **kwargs)
    finally:
        if previous not in (None, "eager"):
            model.set_attn_implementation(previous)
    return out.logits.float(), tuple(out.attentions or ())


def query_projections(model) -> list:
    """Each attention layer's query projection (``q_proj``), in layer order; empty for a model without one (GPT-2's
    fused ``c_attn``). A layer that normalises its queries after the projection (``q_norm``: Qwen3, Gemma 3) gives
    None: its projection's output is not the query."""
    out = []
    for module in model.modules():
        if hasattr(module, "q_proj") and isinstance(module.q_proj, torch.nn.Module):
            out.append(None if getattr(module, "q_norm", None) is not None else module.q_proj)
    return out


def forward_with_queries(model, ids: Tensor, cache, position_ids: Tensor, attention_mask: Tensor | None = None,
                         logits_to_keep: int = 1) -> tuple[Tensor, tuple]:
    """:func:`forward` that also returns each layer's queries before RoPE [B, H, T, D] (the output of its query
    projection, caught by a forward hook for this call only); None for a layer whose projection is not the query
    (see :func:`query_projections`); an empty tuple for a model without query projections."""
    projections = query_projections(model)
    caught: list[Tensor | None] = [None] * len(projections)
    head_dim = model_info(model).head_dim

    def catch(i: int):
        def hook(module, args, output):
            caught[i] = output.detach().unflatten(-1, (-1, head_dim)).transpose(1, 2).float()  # [B, H, T, D]
        return hook

    handles = [p.register_forward_hook(catch(i)) for i, p in enumerate(projections) if p is not None]
    try:
        logits = forward(model, ids, cache, position_ids, attention_mask=attention_mask,
                         logits_to_keep=logits_to_keep)
    finally:
        for handle in handles:
            handle.remove()
    return logits, tuple(caught)


@torch.inference_mode()
def attention_weights(model, ids: Tensor) -> list[Tensor]:
    """Per-layer attention weights [B, H, T, T] of one causal forward over ``ids`` without a cache (eager attention
    for this call, since fused kernels do not return weights; the model's own implementation is restored)."""
    previous = own_implementation(model)
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    finally:
        if previous not in (None, "eager"):
            model.set_attn_implementation(previous)
    return [a for a in out.attentions if a is not None]


def rotary_parameters(model) -> "Rotary | None":
    """The model's RoPE as a KV policy needs it (inv_freq, rope type, rotary dims), or None without RoPE."""

    emb = None
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            emb = module
            break
    if emb is None:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = emb.inv_freq.detach().float()
    return Rotary(inv_freq=inv_freq, rope_type=str(emb.rope_type), rotary_dim=2 * int(inv_freq.shape[-1]),
                  head_dim=int(head_dim), attention_scaling=float(getattr(emb, "attention_scaling", 1.0)))


def model_info(model) -> "ModelInfo":
    """What a KV policy is told about the model: config, device, dtype, layer and head shapes, rotary parameters."""

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    param = next(model.parameters())
    return ModelInfo(config=model.config, device=param.device, dtype=param.dtype, rotary=rotary_parameters(model),
                     num_layers=int(layers), kv_heads=int(kv_heads), head_dim=int(head_dim))
