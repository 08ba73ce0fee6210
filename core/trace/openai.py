"""The OpenAI completions logprobs shape, out of and into decodelab traces.

An OpenAI-compatible server (vLLM, SGLang, llama.cpp's server) answers ``/v1/completions`` with ``logprobs: N`` as
``choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``: per returned token its text, its
log-probability, an object ``{token text: log-probability}`` of the N most likely tokens there (plus the returned
token itself, first, when it is not among them: N or N + 1 entries), and the character offset of the token in the
returned text. The shape does not say which distribution the numbers are from; vLLM's default is the model's own
softmax (``--logprobs-mode raw_logprobs``), so a decodelab trace is written with its raw numbers unless asked for
the processed ones, and the response says which in a ``decodelab`` field the OpenAI clients ignore.

Losses of the shape, kept as an engine has them: ``top_logprobs`` is keyed by text, so two tokens that read the
same keep one entry (the first: the returned token, then the more likely); a probability of 0 has no logarithm in
JSON, so a candidate the chain removed is left out of the processed ``top_logprobs``, and a removed *returned*
token (only `score` has one) has ``null``."""

from __future__ import annotations

import math

from ..errors import ConfigError

RAW, PROCESSED = "raw", "processed"
TEXT_KEYS, ID_KEYS = "text", "ids"  # ids: vLLM's return_tokens_as_token_ids ("token_id:12")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def is_logprobs(obj) -> bool:
    """An OpenAI completions logprobs object: ``tokens`` and ``token_logprobs`` lists."""
    return isinstance(obj, dict) and isinstance(obj.get("tokens"), list) and isinstance(obj.get("token_logprobs"),
                                                                                          list)


def is_openai(doc) -> bool:
    """A completions response (every choice with a logprobs object) or a bare logprobs object."""
    if is_logprobs(doc):
        return True
    choices = doc.get("choices") if isinstance(doc, dict) else None
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and is_logprobs(c.get("logprobs")) for c in choices)


def check_logprobs(lp: dict, where: str) -> None:
    """The four lists run in step (``top_logprobs`` and ``text_offset`` may be absent or null)."""
    n = len(lp["tokens"])
    for key in ("token_logprobs", "top_logprobs", "text_offset"):
        value = lp.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != n):
            raise ConfigError(f"{where}: logprobs.{key} has {len(value) if isinstance(value, list) else value!r} "
                              f"entries for {n} tokens; the lists must run in step")


def check_openai(doc: dict, source: str) -> None:
    if is_logprobs(doc):
        check_logprobs(doc, source)
        return
    for i, choice in enumerate(doc["choices"]):
        check_logprobs(choice["logprobs"], f"{source}: choices[{i}]")


# --- decodelab trace -> OpenAI ----------------------------------------------------------------------------------


def _key(token: str, token_id: int, token_keys: str) -> str:
    return f"token_id:{token_id}" if token_keys == ID_KEYS else token


def _log(p: float) -> float | None:
    return math.log(p) if p > 0 else None


def _sample_entry(step: dict, logprobs: str, token_keys: str) -> tuple[str, float | None, dict]:
    """(token, its log-probability, top) of a generated step: the returned token first, then its alternatives by
    the chosen distribution (a candidate with probability 0 there has no log-probability and is left out)."""
    key = _key(step["token"], step["token_id"], token_keys)
    value = step["raw_logprob"] if logprobs == RAW else step["logprob"]
    top = {key: value}
    field = "raw_prob" if logprobs == RAW else "prob"
    for alt in sorted(step.get("alternatives") or [], key=lambda a: -a[field]):
        alt_key, lp = _key(alt["token"], alt["token_id"], token_keys), _log(alt[field])
        if lp is not None and alt_key not in top:
            top[alt_key] = lp
    return key, value, top


def _score_entry(step: dict, logprobs: str, token_keys: str) -> tuple[str, float | None, dict | None]:
    """A scored token: `score` keeps no alternatives, so its top holds the token alone."""
    key = _key(step["token"], step["token_id"], token_keys)
    value = step["raw_logprob"] if logprobs == RAW else step["logprob"]
    return key, value, ({key: value} if value is not None else None)


def _entries(doc: dict, logprobs: str, token_keys: str) -> list[tuple[str, float | None, dict | None]]:
    command, steps = doc.get("command"), doc.get("steps")
    if command == "score" and isinstance(steps, list):
        return [_score_entry(s, logprobs, token_keys) for s in steps]
    if command in ("sample", "stream") and isinstance(steps, list) and doc.get("mode", "generate") == "generate":
        return [_sample_entry(s, logprobs, token_keys) for s in steps]
    what = "sample -N (no per-token steps)" if doc.get("samples") is not None else \
        f"{command}{' ' + doc['mode'] if doc.get('mode') else ''}"
    raise ConfigError(f"-f openai: a {what} document has no per-token log-probabilities to write; `sample`, "
                      "`score` and `stream` (generating) have")


def to_logprobs(doc: dict, logprobs: str = RAW, token_keys: str = TEXT_KEYS) -> dict:
    """The OpenAI completions logprobs object of a `sample`, `score` or generating `stream` trace: the generated
    (or scored) tokens, their raw (or processed) log-probabilities, the top candidates of each step by the same
    distribution with the returned token first, and each token's character offset in their concatenation (vLLM
    without echo counts from the returned text's start; with ``token_keys="ids"`` it counts the characters of the
    ``token_id:N`` keys, as vLLM does)."""
    if logprobs not in (RAW, PROCESSED):
        raise ConfigError(f"logprobs {logprobs!r}: allowed: {RAW}, {PROCESSED}")
    if token_keys not in (TEXT_KEYS, ID_KEYS):
        raise ConfigError(f"token_keys {token_keys!r}: allowed: {TEXT_KEYS}, {ID_KEYS}")
    entries = _entries(doc, logprobs, token_keys)
    offsets, at = [], 0
    for token, _, _ in entries:
        offsets.append(at)
        at += len(token)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": offsets}


def token_ids(doc: dict, scored: bool) -> dict:
    """A generating trace's prompt and generated ids as vLLM returns them (``return_token_ids``: the choice's
    ``prompt_token_ids`` and ``token_ids``), so that ``check-logprobs`` reads decodelab's own answer as it reads an
    engine's (without them the prompt's ids are unknown). A score has no generated tokens: none."""
    prompt = (doc.get("prompt") or {}).get("token_ids")
    generated = doc.get("token_ids")
    if scored or not isinstance(prompt, list) or not isinstance(generated, list):
        return {}
    return {"prompt_token_ids": list(prompt), "token_ids": list(generated)}


def to_completion(doc: dict, logprobs: str = RAW, token_keys: str = TEXT_KEYS, created: int = 0) -> dict:
    """A whole ``/v1/completions`` response (``object: text_completion``) holding :func:`to_logprobs` as its one
    choice's logprobs, as an engine answers: the text (a score: the scored tokens' text), finish_reason from the
    stop reason, usage in tokens."""
    lp = to_logprobs(doc, logprobs, token_keys)
    scored = doc.get("command") == "score"
    text = "".join(s["token"] for s in doc["steps"]) if scored else doc.get("text", "")
    stop = (doc.get("summary") or {}).get("stop_reason")
    prompt_tokens = len((doc.get("prompt") or {}).get("token_ids") or [])
    completion_tokens = 0 if scored else len(lp["tokens"])
    return {
        "id": f"decodelab-{doc.get('command')}", "object": "text_completion", "created": created,
        "model": doc.get("model"),
        "choices": [{"index": 0, "text": text, "logprobs": lp,
                     "finish_reason": "length" if scored else FINISH.get(stop), **token_ids(doc, scored)}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "decodelab": {"command": doc.get("command"), "logprobs": logprobs},
    }
