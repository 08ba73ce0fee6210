"""What ``speculate --predict`` and ``--predict-only`` call: the continuation to predict over (the run's output, a
plain target continuation, or a given text), the measured cost ratio, and the prediction with its policy replay
(:mod:`.predict`, :mod:`.policies`)."""

from __future__ import annotations

from ...engine.stopping import stop_rules
from ...errors import ConfigError
from ...inputs import check_text
from ...sampling.chain import Chain
from ...sampling.semantics import plan as semantics_plan
from ..sample import decode_tokens
from .policies import replay
from .predict import Prediction, predict, teacher_forced
from .timing import time_plain_decoding


DEFAULT_GAMMAS = (1, 2, 3, 4, 6, 8)
COST_TOKENS = 16  # plain decoding steps timed per model for the cost ratio (after one warm-up run each)


def require_model_draft(draft, spec: str = "") -> None:
    if "," in spec:
        raise ConfigError(f"--predict: --draft {spec!r} is a chain; predict with one draft model (--draft tiny-draft "
                          "or a folder)")
    if draft is None:
        raise ConfigError("--predict: needs a draft model (--draft tiny-draft or a folder); the n-gram proposer's "
                          "draft depends on where its round starts, not on the position alone")


def gammas_for(settings) -> list[int]:
    """The sweep's gammas when given, else 1, 2, 3, 4, 6, 8 and --gamma."""
    if settings.sweep_gamma:
        return [int(g) for g in settings.sweep_gamma]
    return sorted(set(DEFAULT_GAMMAS) | {settings.gamma})


def is_greedy(settings) -> bool:
    return semantics_plan(settings).selector == "greedy"


def plain_continuation(lm, settings, prompt_ids: list[int], chain: Chain) -> list[int]:
    """The target alone under the same settings, seed and stop rules: the text a speculative run would emit (in
    distribution; token for token when greedy)."""
    chain.reset(len(prompt_ids))
    selector = semantics_plan(settings).make_selector(settings.seed, lm.device)
    return [o.token_id for o in decode_tokens(lm.model, prompt_ids, chain, selector, stop_rules(lm, settings),
                                              cache=settings.cache_spec)]


def text_continuation(lm, text: str) -> list[int]:
    check_text("--predict-text", text)
    return list(lm.tokenizer.encode(text, add_special_tokens=False))


def measured_cost_ratio(lm, draft, settings, prompt_ids: list[int], chain: Chain) -> float:
    """c = one plain decoding step of the draft / one of the target: each decodes COST_TOKENS tokens twice (the
    first run a warm-up, not counted); a measurement on this machine, as noisy as it is."""
    def step(model, context) -> float:
        timed = None
        for _ in range(2):
            chain.reset(len(prompt_ids))
            selector = semantics_plan(settings).make_selector(settings.seed, lm.device)
            timed = time_plain_decoding(model, prompt_ids, chain, selector, COST_TOKENS, context,
                                        cache=settings.cache_spec)
        return timed.step_seconds

    return step(draft.model, draft.context_length) / step(lm.model, lm.context_length)


def prediction_for(lm, draft, settings, prompt_ids: list[int], chain: Chain, new_ids: list[int], source: str,
                   cost_ratio: float | None, rounds=None) -> Prediction:
    """Teacher-forced alphas over ``new_ids`` and a plan per gamma; with ``rounds`` (the executed run over the same
    text), measured against alpha on its judged drafts."""
    greedy = is_greedy(settings)
    rows = teacher_forced(lm.model, draft.model, chain, prompt_ids, new_ids, greedy)
    out = predict(rows, gammas_for(settings), cost_ratio, source, greedy, rounds, len(prompt_ids))
    if not greedy and new_ids:  # at temperature 0 every policy is greedy verification
        out.policies, out.policies_gamma = replay(rows.p, rows.q, settings.gamma, cost_ratio), settings.gamma
    return out
