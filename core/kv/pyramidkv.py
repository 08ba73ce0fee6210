"""``pyramidkv``: SnapKV's selection under per-layer budgets that shrink arithmetically with depth (Cai et al. 2024).

With B the mean budget per layer (size, or floor(ratio * T), at least the window w), L layers and beta >= 1:

    top    = B / beta              the last layer's budget
    bottom = 2 B - top             the first layer's (so the mean over layers is B)
    if bottom > T: bottom = T, top = 2 B - T         (no layer can keep more than the prompt)
    B_l    = round(bottom - l (bottom - top) / (L - 1))     l = 0 .. L - 1, exact arithmetic, ties to even

If top < w (a budget below the window) every layer keeps B, as SnapKV (kvpress and the authors' code fall back the
same way). Each layer then keeps its window plus its B_l - w best-scored prefix tokens (see :mod:`.snapkv`).
Layers of different lengths take one token a forward after the prompt (see :mod:`.press`).
"""

from __future__ import annotations

from fractions import Fraction

from .protocol import ModelInfo, choice, positive_int, register
from .press import Ratio, budget_params, check_budget, odd_int
from .snapkv import POOLS, WindowScored


def pyramid_budgets(mean: int, tokens: int, window: int, beta: int, layers: int) -> list[int]:
    """Per-layer budgets as above (mean = B already clipped to [window, tokens])."""
    if layers == 1:
        return [mean]
    top = Fraction(mean, beta)
    bottom = 2 * mean - top
    if bottom > tokens:
        bottom, top = Fraction(tokens), Fraction(2 * mean - tokens)
    if top < window:
        return [mean] * layers
    step = (bottom - top) / (layers - 1)
    return [round(bottom - layer * step) for layer in range(layers)]


@register
class PyramidKVPolicy(WindowScored):
    name = "pyramidkv"
    summary = ("snapkv with per-layer budgets decreasing with depth (beta=N: the last layer keeps 1/N of the mean "
               "budget); ratio=R or size=S (the mean), window=W, kernel=K, pool=max|avg")
    params = {**budget_params(("prefill",)), "window": positive_int, "kernel": odd_int, "pool": choice(*POOLS),
              "beta": positive_int}

    @staticmethod
    def check_options(values: dict) -> dict:
        values = {"window": 32, "kernel": 5, "pool": "max", "beta": 20, **check_budget("pyramidkv", values, None)}
        if "size" in values and values["size"] < values["window"]:
            raise ValueError(f"size={values['size']} is less than window={values['window']} (the window is kept)")
        return values

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, window: int = 32, kernel: int = 5,
                 pool: str = "max", beta: int = 20):
        self.beta = beta
        super().__init__(info, capacity, needs, ratio=ratio, size=size, window=window, kernel=kernel, pool=pool)

    def spec_options(self) -> dict:
        return {**super().spec_options(), "beta": self.beta}

    def layer_budgets(self, tokens: int) -> list[int]:
        return pyramid_budgets(self.first_budget(tokens), tokens, self.window, self.beta, len(self.pos))
