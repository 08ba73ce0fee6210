"""Delta re-rotation of cached keys: move a key rotated at position p to position p - d without recomputing it.

RoPE rotates each pair (x_i, x_{i + r/2}) of the first r = rotary_dim dims of a head by the angle p * inv_freq[i]
(transformers' ``rotate_half`` layout: k' = k cos + rotate_half(k) sin, rotate_half(x1, x2) = (-x2, x1)), and
some rope types multiply cos and sin by a constant ``attention_scaling`` s. Rotations compose, so

    s R(p - d) k = R(-d) (s R(p) k):

rotating the cached key by -d * inv_freq (no scaling: the cached key already carries s once) gives exactly the key
the model would have computed at position p - d. Only the rotary dims move; dims past rotary_dim are untouched.

This is exact only when inv_freq does not depend on the sequence (it does for dynamic NTK scaling and longrope,
which switch frequencies with the length), and when the model uses this layout (Cohere and GPT-J interleave the
pairs). :func:`shiftable` refuses everything else with one line instead of computing wrong numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .protocol import ModelInfo, Rotary

# rope types whose inv_freq is fixed at load time (linear, llama3 and yarn rescale it once; yarn also sets s)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# model types whose attention applies rotate_half to the first rotary_dim dims of q and k (tests/test_stream_policies.py
# checks each against a fresh forward)
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


def model_type(info: ModelInfo) -> str:
    cfg = info.config.get_text_config() if hasattr(info.config, "get_text_config") else info.config
    return str(getattr(cfg, "model_type", "?"))


def shiftable(info: ModelInfo, option: str) -> Rotary:
    """The model's rotary parameters if its cached keys can be moved exactly, else ConfigError saying why."""
    kind = model_type(info)
    rotary = info.rotary
    if rotary is None:
        raise ConfigError(f"{option}: {kind} has no rotary position embedding (absolute positions are added to the "
                          "input, so a cached key cannot be moved to another position); use positions=keep or "
                          "--cache recompute:size=W")
    if rotary.rope_type not in STATIC_ROPE_TYPES:
        raise ConfigError(f"{option}: rope type {rotary.rope_type!r} of {kind} cannot be shifted exactly (its "
                          f"frequencies depend on the sequence length or are unverified; shiftable: "
                          f"{', '.join(STATIC_ROPE_TYPES)}); use positions=keep or --cache recompute:size=W")
    if kind not in VERIFIED_MODEL_TYPES:
        raise ConfigError(f"{option}: re-rotation is verified only for {', '.join(VERIFIED_MODEL_TYPES)} (the "
                          f"rotate_half layout), not {kind}; use positions=keep or --cache recompute:size=W")
    if rotary.rotary_dim > rotary.head_dim or rotary.rotary_dim % 2:
        raise ConfigError(f"{option}: rotary_dim {rotary.rotary_dim} does not fit head_dim {rotary.head_dim}")
    return rotary


class Shifter:
    """Rotates cached keys [B, H, T, head_dim] back by d positions; cos/sin per d are memoised (d is usually 1)."""

    def __init__(self, rotary: Rotary, device: torch.device):
        self.rotary = rotary
        self.inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
        self._memo: dict[int, tuple[Tensor, Tensor]] = {}

    def _cos_sin(self, d: int) -> tuple[Tensor, Tensor]:
        pair = self._memo.get(d)
        if pair is None:
            angle = -float(d) * self.inv_freq  # R(-d): angle -d * inv_freq[i] for pair i
            pair = self._memo[d] = (torch.cos(angle), torch.sin(angle))
            if len(self._memo) > 64:
                self._memo.pop(next(iter(self._memo)))
        return pair

    def shift(self, keys: Tensor, d: int) -> Tensor:
        """R(-d) on the rotary part of every key (computed in float32, returned in the keys' dtype)."""
        if d == 0 or keys.shape[-2] == 0:
            return keys
        cos, sin = self._cos_sin(d)
        half = self.rotary.rotary_dim // 2
        x = keys.float()
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        # rotate_half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if 2 * half < keys.shape[-1]:
            parts.append(x[..., 2 * half :])
        return torch.cat(parts, dim=-1).to(keys.dtype)
