"""vLLM's OpenAI-compatible ``/v1/completions``: token ids in (``return_tokens_as_token_ids``) and out, prompt
logprobs for scoring, ``/tokenize``, and the prefix-cache counters at ``/metrics``."""

from __future__ import annotations

from collections.abc import Sequence

from ..backend import Capabilities
from .adapter import Adapter, register
from .transport import EngineError, Transport, prometheus_sum, repeated_keys
from .wire import (LOGPROB_KINDS, RAW, RAW_LOGITS, VLLM_MODES, Position, SamplingSettings, order_defect, rank_in_top,
                   read_value, sorted_top)

VLLM_MASKED = -9999.0  # vLLM writes -inf (a token the processors removed) as -9999.0: JSON has no -inf
VLLM_MIN_TEMPERATURE = 0.01  # vllm/sampling_params.py _MAX_TEMP: 0 < t < 0.01 is silently raised to 0.01
VLLM_MAX_BIAS = 100.0  # vllm/sampling_params.py from_optional: each logit bias is clamped to [-100, 100]


@register
class VllmAdapter(Adapter):
    """vLLM's /v1/completions (vllm/entrypoints/openai/completion/protocol.py CompletionRequest)."""

    kind = "vllm"
    owned_by = ("vllm",)
    default_mode = "raw_logprobs"
    answers_model = True  # an answer for another model than the one asked is refused
    path = "/v1/completions"
    tokenize_path = "/tokenize"
    metrics_path = "/metrics"  # Prometheus text: vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total
    masked = VLLM_MASKED

    def __init__(self, logprobs_mode: str = "raw_logprobs", max_top_n: int = 20):
        if logprobs_mode not in VLLM_MODES:
            raise EngineError(f"logprobs mode {logprobs_mode!r}; allowed: {', '.join(VLLM_MODES)}")
        self.values = VLLM_MODES[logprobs_mode]
        # prompt tokens skip the sampler: raw log softmax, or raw logits in a logits mode
        # (v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict)
        self.prompt_values = RAW if self.values in LOGPROB_KINDS else RAW_LOGITS
        self.capabilities = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=True,
                                         full_logits=False, max_top_n=max_top_n)

    # requests -------------------------------------------------------------------------------------------------

    def check(self, s: SamplingSettings) -> str | None:
        """A setting vLLM would change without saying so: refused rather than silently different."""
        if 0 < s.temperature < VLLM_MIN_TEMPERATURE:
            return (f"temperature {s.temperature:g}: vLLM raises 0 < t < {VLLM_MIN_TEMPERATURE:g} to "
                    f"{VLLM_MIN_TEMPERATURE:g}; use 0 (greedy) or at least {VLLM_MIN_TEMPERATURE:g}")
        clamped = [t for t, b in s.logit_bias.items() if abs(b) > VLLM_MAX_BIAS]
        if clamped:
            return f"logit bias of token {clamped[0]}: vLLM clamps biases to [-100, 100]"
        return None

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        # prompt_logprobs are computed from the raw model output; max_tokens must be >= 1 (0 only with echo)
        return {"model": model, "prompt": list(ids), "prompt_logprobs": top_n, "max_tokens": 1,
                "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None, "n": 1, "echo": False,
                "stream": False, "add_special_tokens": False, "return_tokens_as_token_ids": True,
                "return_token_ids": True}

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        return {"model": model, "prompt": list(ids), "max_tokens": s.max_tokens, "min_tokens": s.min_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "seed": s.seed, "ignore_eos": s.ignore_eos,
                "logprobs": s.logprobs, "logit_bias": {str(t): b for t, b in s.logit_bias.items()},
                "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop),
                "allowed_token_ids": list(s.allowed_token_ids) or None, "bad_words": list(s.bad_words),
                "n": 1, "echo": False, "stream": False, "skip_special_tokens": False,
                "include_stop_str_in_output": s.include_stop_str_in_output, "add_special_tokens": False,
                "return_tokens_as_token_ids": True, "return_token_ids": True}

    def tokenize_body(self, model: str, text: str, add_special_tokens: bool) -> dict:
        # vllm/entrypoints/serve/tokenize/protocol.py TokenizeCompletionRequest
        return {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}

    # answers --------------------------------------------------------------------------------------------------

    @staticmethod
    def cached_tokens(resp: dict) -> int | None:
        """usage.prompt_tokens_details.cached_tokens: only a server run with --enable-prompt-tokens-details
        writes it."""
        details = ((resp.get("usage") or {}).get("prompt_tokens_details") or {}) if isinstance(resp, dict) else {}
        value = details.get("cached_tokens")
        return int(value) if isinstance(value, int) else None

    @staticmethod
    def prefix_cache_counters(metrics: str) -> dict[str, float]:
        """``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``, summed over its engines."""
        return {"hits": prometheus_sum(metrics, "vllm:prefix_cache_hits_total"),
                "queries": prometheus_sum(metrics, "vllm:prefix_cache_queries_total")}

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        choice = _first_choice(t, resp)
        plp = choice.get("prompt_logprobs")
        ids = body["prompt"]
        if not isinstance(plp, list):
            raise t.fail("the answer has no prompt_logprobs (choices[0].prompt_logprobs is missing)")
        if len(plp) != len(ids):
            raise t.fail(f"prompt_logprobs cover {len(plp)} positions for {len(ids)} prompt tokens")
        return tuple(self._prompt_position(t, i, tok, plp[i], body["prompt_logprobs"]) for i, tok in enumerate(ids))

    def _prompt_position(self, t: Transport, i: int, token_id: int, entry, top_n: int) -> Position:
        if entry is None:
            if i == 0:
                return Position(0, token_id, None, None, ())
            raise t.fail(f"prompt_logprobs[{i}] is null (only the first position has none)")
        defects = [f"position {i}: token {k} listed {len(v)} times" for k, v in repeated_keys(entry).items()]
        values = {int(k): read_value(v["logprob"], self.masked) for k, v in entry.items()}
        if token_id not in values:
            raise t.fail(f"prompt_logprobs[{i}] has no entry for the prompt token {token_id}")
        # vLLM's rank: the number of tokens at least as likely as this one (1 = the most likely)
        rank = entry[str(token_id)].get("rank")
        order = order_defect([int(k) for k in entry], values, expected_first=token_id)
        if order:
            defects.append(f"position {i}: {order}")
        return Position(i, token_id, values[token_id], rank, sorted_top(values, top_n), tuple(defects))

    def read_generation(self, t: Transport, body: dict, resp: dict) -> tuple[tuple[int, ...], tuple[Position, ...],
                                                                          str | None]:
        choice = _first_choice(t, resp)
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
            raise t.fail("the answer has no logprobs (choices[0].logprobs is null); was logprobs sent?")
        ids = tuple(_token_id(t, tok) for tok in lp["tokens"])
        echoed = choice.get("token_ids")
        if echoed is not None and tuple(echoed) != ids:
            raise t.fail(f"token_ids {list(echoed)[:8]} disagree with the logprobs' tokens {list(ids)[:8]}")
        tops = lp.get("top_logprobs") or []
        if len(tops) != len(ids) or len(lp.get("token_logprobs") or []) != len(ids):
            raise t.fail(f"logprobs cover {len(tops)} steps for {len(ids)} tokens")
        steps = tuple(self._step(t, i, tok, lp["token_logprobs"][i], tops[i], body["logprobs"])
                      for i, tok in enumerate(ids))
        return ids, steps, choice.get("finish_reason")

    def _step(self, t: Transport, i: int, token_id: int, logprob, entry, top_n: int) -> Position:
        if logprob is None or not isinstance(entry, dict):
            raise t.fail(f"step {i} has no logprob (top_logprobs[{i}] is null)")
        defects = [f"step {i}: token {_token_id(t, k)} listed {len(v)} times in top logprobs"
                   + ("" if len(set(v)) == 1 else f" with different values {v}")
                   for k, v in repeated_keys(entry).items()]
        keys = [_token_id(t, k) for k in entry]
        values = {_token_id(t, k): read_value(v, self.masked) for k, v in entry.items()}
        value = read_value(logprob, self.masked)
        if token_id in values and values[token_id] != value:
            defects.append(f"step {i}: token {token_id} has logprob {value} but {values[token_id]} in top logprobs")
        order = order_defect(keys, values, expected_first=token_id)
        if order:
            defects.append(f"step {i}: {order}")
        top = sorted_top(values, top_n)
        return Position(i, token_id, value, rank_in_top(token_id, value, top), top, tuple(defects))


def _first_choice(t: Transport, resp: dict) -> dict:
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise t.fail("the answer has no choices")
    return choices[0]


def _token_id(t: Transport, token) -> int:
    """vLLM's ``token_id:N`` (sent with return_tokens_as_token_ids); a token text cannot be mapped back safely."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    raise t.fail(f"token {token!r} is text, not token_id:N (the server ignored return_tokens_as_token_ids)")

