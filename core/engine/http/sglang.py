"""SGLang's native ``/generate``: token ids in and out, input and output logprobs in ``meta_info``."""

from __future__ import annotations

from collections.abc import Sequence

from ..backend import Capabilities
from .adapter import Adapter, register
from .transport import EngineError, Transport
from .wire import RAW, VLLM_MODES, Position, SamplingSettings, rank_in_top, sorted_top


@register
class SglangAdapter(Adapter):
    """SGLang's native /generate (sglang/srt/managers/io_struct.py GenerateReqInput): token ids in and out.

    Its output logprobs are computed after temperature (and, in the versions read, renormalised over top-p)
    unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1; scoring runs at temperature 1, so prompt
    logprobs are raw either way."""

    kind = "sglang"
    owned_by = ("sglang",)
    default_mode = "processed_logprobs"
    path = "/generate"
    tokenize_path = None  # not in the versions read
    metrics_path = None
    masked = None
    prompt_values = RAW

    def __init__(self, logprobs_mode: str = "processed_logprobs", max_top_n: int | None = None):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineError(f"SGLang logprobs are raw_logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1) "
                              f"or processed_logprobs, not {logprobs_mode!r}")
        self.values = VLLM_MODES[logprobs_mode]
        self.capabilities = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=False,
                                         full_logits=False, max_top_n=max_top_n)

    def check(self, s: SamplingSettings) -> str | None:
        if s.allowed_token_ids or s.bad_words:
            return "allowed_token_ids / bad_words: SGLang's /generate has no such field"
        return None

    def _sampling(self, s: SamplingSettings) -> dict:
        return {"max_new_tokens": s.max_tokens, "min_new_tokens": s.min_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1, "min_p": s.min_p,
                "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "sampling_seed": s.seed, "ignore_eos": s.ignore_eos,
                "logit_bias": {str(t): b for t, b in s.logit_bias.items()},
                "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop), "skip_special_tokens": False, "n": 1}

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        sampling = self._sampling(SamplingSettings(max_tokens=1, logprobs=top_n))
        return {"input_ids": list(ids), "sampling_params": sampling, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": top_n, "return_text_in_logprobs": False}

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        return {"input_ids": list(ids), "sampling_params": self._sampling(s), "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": s.logprobs, "return_text_in_logprobs": False}

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        meta = _meta(t, resp)
        lps, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
        ids = body["input_ids"]
        if not isinstance(lps, list) or len(lps) != len(ids):
            raise t.fail("the answer has no input_token_logprobs for every prompt token")
        return tuple(self._position(t, i, lps[i], (tops or [None] * len(ids))[i], body["top_logprobs_num"])
                     for i in range(len(ids)))

    def read_generation(self, t: Transport, body: dict, resp: dict):
        meta = _meta(t, resp)
        lps, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if not isinstance(lps, list):
            raise t.fail("the answer has no output_token_logprobs (was return_logprob sent?)")
        steps = tuple(self._position(t, i, lps[i], (tops or [None] * len(lps))[i], body["top_logprobs_num"])
                      for i in range(len(lps)))
        finish = meta.get("finish_reason")
        return tuple(p.token_id for p in steps), steps, finish.get("type") if isinstance(finish, dict) else finish

    def _position(self, t: Transport, i: int, triple, top, top_n: int) -> Position:
        # each entry is (logprob, token_id, text or None); the first prompt token's logprob is None
        logprob, token_id = triple[0], int(triple[1])
        values = {int(e[1]): float(e[0]) for e in (top or []) if e[0] is not None}
        listed = sorted_top(values, top_n)
        value = None if logprob is None else float(logprob)
        return Position(i, token_id, value, rank_in_top(token_id, value, listed), listed)


def _meta(t: Transport, resp) -> dict:
    if isinstance(resp, list):
        resp = resp[0] if resp else {}
    meta = resp.get("meta_info") if isinstance(resp, dict) else None
    if not isinstance(meta, dict):
        raise t.fail("the answer has no meta_info")
    return meta

