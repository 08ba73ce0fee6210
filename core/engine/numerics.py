"""The model run teacher-forced under one numerical condition, the hidden states of every layer kept: the whole text in
one forward, in chunks of k through the KV cache (k = 1: one token a forward, as decoding runs), as one row of a
padded batch (left or right), and copies of the model in another dtype, attention implementation or device. Also a
forward with rounding-sized noise injected after every layer: how far this model carries a dtype's rounding, the
noise floor ``audit-numerics`` and the noise verdicts hold differences against.

Every call into transformers for these lives here (core/engine owns the model); analysis/numerics.py compares.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from .forward import cache_kwarg
from .runtime import Runtime

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class Forced:
    """One condition's outputs at every position of the text: raw logits [T, V] (float32; row i predicts token
    i + 1) and hidden states [L + 1, T, H] (float32; row 0 the embeddings, row l the output of layer l)."""

    logits: Tensor
    hidden: Tensor


def _hidden(out) -> Tensor:
    return torch.stack([h[0].float() for h in out.hidden_states])


@torch.inference_mode()
def whole(model, ids: list[int]) -> Forced:
    """The whole text in one forward, batch 1."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False, output_hidden_states=True)
    return Forced(out.logits[0].float().cpu(), _hidden(out).cpu())


@torch.inference_mode()
def chunked(model, ids: list[int], k: int) -> Forced:
    """The text fed k tokens a forward through the full KV cache (positions from the cache's seen count)."""
    runtime = Runtime.create(model, None, capacity=len(ids))
    device = runtime.device
    logits, hidden = [], []
    for start in range(0, len(ids), k):
        part = torch.tensor([ids[start:start + k]], device=device)
        n = part.shape[1]
        out = model(input_ids=part, use_cache=True, logits_to_keep=0, output_hidden_states=True,
                    position_ids=runtime.policy.positions(n), **{cache_kwarg(model): runtime.policy.model_cache})
        runtime.policy.after_forward(n)
        logits.append(out.logits[0].float().cpu())
        hidden.append(_hidden(out).cpu())
    return Forced(torch.cat(logits), torch.cat(hidden, dim=1))


@torch.inference_mode()
def batched(model, ids: list[int], others: list[list[int]], side: str, pad_id: int = 0) -> Forced:
    """The text as row 0 of a batch with ``others``, padded on ``side`` (left / right) to the longest row; attention
    mask and positions (cumulative count of real tokens) as a serving engine builds them. Row 0's real positions."""
    rows = [list(ids)] + [list(o) for o in others]
    width = max(len(r) for r in rows)
    batch, mask = [], []
    for r in rows:
        pad = [pad_id] * (width - len(r))
        batch.append(pad + r if side == "left" else r + pad)
        mask.append(([0] * len(pad) + [1] * len(r)) if side == "left" else ([1] * len(r) + [0] * len(pad)))
    device = next(model.parameters()).device
    ids_t, mask_t = torch.tensor(batch, device=device), torch.tensor(mask, device=device)
    positions = (mask_t.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids_t, attention_mask=mask_t, position_ids=positions, use_cache=False,
                output_hidden_states=True)
    real = slice(width - len(ids), width) if side == "left" else slice(0, len(ids))
    return Forced(out.logits[0, real].float().cpu(), torch.stack([h[0, real].float() for h in out.hidden_states]).cpu())


def copy_as(model, dtype: torch.dtype | None = None, attention: str | None = None, device=None):
    """A copy of the model in another dtype, attention implementation and/or device (the original is untouched)."""
    other = copy.deepcopy(model)
    if dtype is not None or device is not None:
        other = other.to(**{k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None})
    if attention is not None:
        other.set_attn_implementation(attention)
    return other.eval()


def flash_available() -> bool:
    """flash_attention_2 needs CUDA and the flash_attn package."""
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        return False
    return torch.cuda.is_available() and bool(is_flash_attn_2_available())


def layers_of(model) -> torch.nn.ModuleList:
    """The decoder layers: the ModuleList as long as the config's num_hidden_layers."""
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError("cannot find the model's decoder layers")


@torch.inference_mode()
def perturbed(model, ids: list[int], eps: float, seed: int = 0) -> Forced:
    """The whole-text forward with rounding-sized noise after the embeddings and after every layer: each element h
    becomes h (1 + eps u), u uniform in [-1, 1] (a round-to-nearest in a dtype of machine epsilon eps errs by at most
    eps / 2 relative; eps is the margin). Run in the model's own dtype, it shows how far the network carries such
    rounding to each layer and to the logits."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def noisy(h: Tensor) -> Tensor:
        u = torch.rand(h.shape, generator=g, device=h.device, dtype=torch.float32) * 2 - 1
        return (h.float() * (1 + eps * u)).to(h.dtype)

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (noisy(output[0]),) + tuple(output[1:])
        return noisy(output)

    handles = [layer.register_forward_hook(hook) for layer in layers_of(model)]
    handles.append(model.get_input_embeddings().register_forward_hook(hook))
    try:
        return whole(model, ids)
    finally:
        for h in handles:
            h.remove()
