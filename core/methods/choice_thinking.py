"""`score --choice` on a thinking model: the labels after a forced empty thinking block (``--empty-think``).

A thinking model's first token after the prompt is often START, not a label (ollama/ollama#18579: ``<think>`` among
the top-20 first tokens of a yes/no label), so "p(label | prompt)" mixes the answer with the choice to think. This
scores the one well-defined quantity decodelab can compute exactly: with the block closed empty,

    p(label | prompt + [START] + END)      START added unless the prompt already opened the block,

the probability that the model answers the label when it is made to skip thinking. It is not the marginal over
sampled thoughts, sum_r p(r | prompt) p(label | prompt, r), which would need sampling and carry its error. Beside it,
``p_start`` = P(START | prompt) (when the prompt opened no block): how much of the model's next-token mass goes to
starting a thought rather than answering. The block's ids are appended to the prompt's ids (not re-tokenized with
it), and the prompt's text for the labels' joint tokenizations gets the markers' text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.forward import forward
from ..errors import ConfigError
from ..sampling.thinking import answer_start, thinking_count
from ..sampling.tokens import Tokens, think_tags
from ..trace.reasoning import tag_texts


@dataclass(frozen=True)
class ThinkingChoice:
    mode: str  # "empty thinking block forced"
    appended: str  # the markers' text added after the prompt
    appended_ids: list[int]
    p_start: float | None  # P(START | prompt): null where the prompt already opened or closed the block

    def to_dict(self) -> dict:
        return {"mode": self.mode, "appended": self.appended, "appended_ids": self.appended_ids,
                "p_start": self.p_start,
                "note": "P(label | prompt, empty thinking block), not the marginal over sampled thoughts"}


def empty_block(lm, settings, prompt_text: str, prompt_ids: list[int]) -> tuple[str, list[int], dict]:
    """(prompt text, prompt ids, what was added) with the thinking block closed empty (module doc)."""
    texts = tag_texts(settings, lm.tokenizer)
    if texts is None:
        raise ConfigError("--empty-think: needs thinking markers: give --think-tags START,END (the tokenizer's chat "
                          "template has no <think>)")
    tags = think_tags(settings, Tokens.of(lm))
    if answer_start(prompt_ids, len(prompt_ids), tags) == len(prompt_ids):
        return prompt_text, list(prompt_ids), {"mode": "the prompt already closed the thinking block", "appended": "",
                                               "appended_ids": [], "p_start": None}
    if thinking_count(prompt_ids, tags) is not None:
        text, ids, p_start = texts[1], list(tags.end), None
    else:
        text, ids = texts[0] + texts[1], list(tags.start) + list(tags.end)
        p_start = start_probability(lm, prompt_ids, tags.start)
    info = ThinkingChoice("empty thinking block forced", text, ids, p_start)
    return prompt_text + text, list(prompt_ids) + ids, info.to_dict()


def start_probability(lm, prompt_ids: list[int], start: tuple[int, ...]) -> float:
    """P(START | prompt): the product of START's tokens' conditionals (one forward of prompt + START)."""
    ids = torch.tensor([list(prompt_ids) + list(start)], device=lm.device)
    logp = torch.log_softmax(forward(lm.model, ids, logits_to_keep=len(start) + 1)[0, :-1].double(), dim=-1)
    return float(logp.gather(-1, torch.tensor([list(start)], device=lm.device).T).sum().exp())
