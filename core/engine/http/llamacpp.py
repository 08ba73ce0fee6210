"""llama.cpp's server: its native ``/completion`` and ``/tokenize``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..backend import Capabilities
from .adapter import Adapter, register
from .transport import EngineError, Transport
from .wire import PROCESSED, RAW, VLLM_MODES, Position, SamplingSettings, rank_in_top, read_value, sorted_top


@register
class LlamacppAdapter(Adapter):
    """llama.cpp's native /completion (tools/server/server-task.cpp params_from_json_cmpl): token ids in and out,
    ``n_probs`` alternatives; raw softmax values unless ``post_sampling_probs`` (then probabilities after the
    sampler chain, turned into logs here). It returns no prompt logprobs, so it cannot score."""

    kind = "llamacpp"
    owned_by = ("llamacpp",)
    default_mode = "raw_logprobs"
    prompt_values = RAW
    path = "/completion"
    tokenize_path = "/tokenize"  # tools/server: {"content", "add_special"} -> {"tokens"}
    metrics_path = None
    masked = -3.0e38  # llama.cpp writes log(0) as the lowest float

    def tokenize_body(self, model: str, text: str, add_special_tokens: bool) -> dict:
        return {"content": text, "add_special": add_special_tokens}

    def __init__(self, logprobs_mode: str = "raw_logprobs", max_top_n: int | None = None):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineError(f"llama.cpp gives raw_logprobs or processed_logprobs (post_sampling_probs), "
                              f"not {logprobs_mode!r}")
        self.values = VLLM_MODES[logprobs_mode]
        self.capabilities = Capabilities(score=False, generate=True, seeded=True, prompt_ranks=False,
                                         full_logits=False, max_top_n=max_top_n, replay=False)

    def check(self, s: SamplingSettings) -> str | None:
        if s.min_tokens:
            return "min_tokens: llama.cpp's server has no such field"
        if s.stop_token_ids:
            return "stop_token_ids: llama.cpp's server has no such field"
        if s.allowed_token_ids or s.bad_words:
            return "allowed_token_ids / bad_words: llama.cpp's server has no such field"
        if self.kind not in s.neutral:  # else the server's own defaults (its --samplers, its DRY) would apply
            return ("the request does not switch off llama.cpp's own stages (build it with "
                    "decodelab.core.sampling.export.served_settings or neutral_request)")
        return None

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        raise EngineError("llama.cpp's server returns no prompt logprobs: it cannot score a sequence")

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        """The fields the request carries, then what it hands in for llama.cpp (``s.neutral``, the registry's):
        the stages it does not carry switched off, the sampler order written out, so that neither the server's
        --samplers nor its defaults change the chain. Penalties count every token (repeat_last_n -1, as vLLM), the
        mirostat mode is off, min_keep 0."""
        return {"prompt": list(ids), "n_predict": s.max_tokens, "temperature": s.temperature, "top_k": s.top_k,
                "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repetition_penalty,
                "repeat_last_n": -1, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "mirostat": 0, "min_keep": 0,
                "seed": -1 if s.seed is None else s.seed, "ignore_eos": s.ignore_eos, "n_probs": s.logprobs,
                "post_sampling_probs": self.values == PROCESSED,
                "logit_bias": [[t, b] for t, b in s.logit_bias.items()], "return_tokens": True,
                "stop": list(s.stop), "cache_prompt": False, "stream": False, **s.neutral.get(self.kind, {})}

    def read_score(self, t: Transport, body: dict, resp: dict):
        raise t.fail("llama.cpp's server returns no prompt logprobs")

    def read_generation(self, t: Transport, body: dict, resp: dict):
        probs = resp.get("completion_probabilities") if isinstance(resp, dict) else None
        if not isinstance(probs, list):
            raise t.fail("the answer has no completion_probabilities (was n_probs sent?)")
        post = body["post_sampling_probs"]
        steps = tuple(self._step(i, e, post, body["n_probs"]) for i, e in enumerate(probs))
        finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(resp.get("stop_type"), resp.get("stop_type"))
        return tuple(p.token_id for p in steps), steps, finish

    def _step(self, i: int, e: dict, post: bool, top_n: int) -> Position:
        def value(d):  # post_sampling_probs gives probabilities; log(0) is -inf
            if post:
                return math.log(d["prob"]) if d["prob"] > 0 else -math.inf
            return read_value(d["logprob"], self.masked)

        listed = sorted_top({int(d["id"]): value(d) for d in e.get("top_probs" if post else "top_logprobs", [])},
                             top_n)
        v = value(e)
        return Position(i, int(e["id"]), v, rank_in_top(int(e["id"]), v, listed), listed)

