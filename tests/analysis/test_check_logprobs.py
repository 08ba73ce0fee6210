"""check-logprobs on answers written here by hand from the bundled model's own logits under each transform (the
formulas in the test, not decodelab's chain): each must get its label, with and without the request's settings,
and every known defect must be flagged."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decodelab.core.analysis.check_logprobs import check, read_answers
from decodelab.core.engine.models import load_model

PROMPT = [2008, 321, 1826, 259, 708]  # "Once upon a time"
STEPS = 6
TOP = 5


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


def raw_logits(tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.model(torch.tensor([ids])).logits[0, -1].double()


def temperature(t):
    return lambda z, seen: torch.log_softmax(z / t, -1)


def top_k(k, t):
    def f(z, seen):
        z = z / t
        return torch.log_softmax(z.masked_fill(z < z.topk(k).values[-1], -math.inf), -1)
    return f


def repetition(r):
    def f(z, seen):  # CTRL: positive logits of seen tokens divided by r, negative ones multiplied
        mask = torch.zeros_like(z, dtype=torch.bool)
        mask[list(seen)] = True
        return torch.log_softmax(torch.where(mask, torch.where(z > 0, z / r, z * r), z), -1)
    return f


def raw(z, seen):
    return torch.log_softmax(z, -1)


def answer(tiny, values, request: dict | None = None, n: int = STEPS) -> dict:
    """A vLLM completions answer (token_id:N keys, the sampled token first, then the top N; -inf as -9999.0) for
    the greedy continuation of PROMPT, every number from ``values(z, seen)``."""
    ids = list(PROMPT)
    tokens, token_logprobs, tops = [], [], []
    for _ in range(n):
        z = raw_logits(tiny, ids)
        v = values(z, set(ids))
        token = int(v.argmax())
        best = v.topk(TOP)
        entry = {f"token_id:{token}": max(float(v[token]), -9999.0)}
        for i, val in zip(best.indices.tolist(), best.values.tolist()):
            entry.setdefault(f"token_id:{i}", max(val, -9999.0))
        tokens.append(f"token_id:{token}")
        token_logprobs.append(max(float(v[token]), -9999.0))
        tops.append(entry)
        ids.append(token)
    resp = {"model": "tiny", "choices": [{"index": 0, "text": "", "logprobs": {"tokens": tokens, "token_logprobs":
            token_logprobs, "top_logprobs": tops, "text_offset": [0] * n}, "finish_reason": "length"}]}
    if request is not None:
        return {"request": {"prompt": PROMPT, **request}, "response": resp}
    resp["choices"][0]["prompt_token_ids"] = PROMPT
    return resp


def run(tiny, tmp_path, *answers, text: str | None = None):
    path = tmp_path / "answers.jsonl"
    path.write_text(text if text is not None else "\n".join(json.dumps(a) for a in answers) + "\n")
    return check(tiny, read_answers(path, tiny, {}))


CASES = [  # (values, the request's settings, the label)
    (raw, {"temperature": 1.0}, "raw"),
    (temperature(0.7), {"temperature": 0.7}, "temperature-scaled"),
    (top_k(3, 0.7), {"temperature": 0.7, "top_k": 3}, "renormalized"),
    (repetition(1.3), {"temperature": 0.0, "repetition_penalty": 1.3}, "penalized"),
]


@pytest.mark.parametrize("values, request_, label", CASES, ids=[c[2] for c in CASES])
def test_labels_with_the_request(tiny, tmp_path, values, request_, label):
    report = run(tiny, tmp_path, answer(tiny, values, request_))
    assert [t.label for t in report.tokens] == [label] * STEPS
    assert report.summary["vs_label"]["max_abs_delta"] < 1e-5
    assert report.answers[0]["settings_from"] == "request"


@pytest.mark.parametrize("values, request_, label", CASES, ids=[c[2] for c in CASES])
def test_labels_without_settings_are_fitted(tiny, tmp_path, values, request_, label):
    report = run(tiny, tmp_path, answer(tiny, values))
    labels = [t.label for t in report.tokens]
    if label == "penalized":  # a penalty that touched no listed token only shrinks the normaliser, as a filter
        assert set(labels) <= {"penalized", "renormalized"} and "penalized" in labels
        assert all("or penalties on unlisted context tokens" in t.transforms for t in report.tokens
                   if t.label == "renormalized")
    else:
        assert labels == [label] * STEPS
    if label in ("temperature-scaled", "renormalized"):
        assert all(t.temperature == pytest.approx(0.7, rel=1e-4) for t in report.tokens)


def test_the_kept_mass_of_a_renormalized_token(tiny, tmp_path):
    report = run(tiny, tmp_path, answer(tiny, top_k(3, 0.7), {"temperature": 0.7, "top_k": 3}))
    ids = list(PROMPT)
    for t in report.tokens:
        p = torch.softmax(raw_logits(tiny, ids) / 0.7, -1)
        assert t.kept_mass == pytest.approx(float(p.topk(3).values.sum()), abs=1e-6)
        ids.append(t.token_id)


def test_figures_against_the_local_raw_logprobs(tiny, tmp_path):
    """vs_raw by hand: |engine - raw| and the ratio exp(raw - engine) of each sampled token."""
    report = run(tiny, tmp_path, answer(tiny, temperature(0.7), {"temperature": 0.7}))
    deltas = [t.engine_logprob - t.local_raw_logprob for t in report.tokens]
    ratios = [math.exp(-d) for d in deltas]
    f = report.summary["vs_raw"]
    assert f["max_abs_delta"] == pytest.approx(max(abs(d) for d in deltas))
    assert f["mean_ratio"] == pytest.approx(sum(ratios) / len(ratios))
    assert f["outside_band"] == pytest.approx(sum(not 0.9 <= r <= 1.1 for r in ratios) / len(ratios))


def test_the_verdict(tiny, tmp_path):
    assert run(tiny, tmp_path, answer(tiny, raw, {"temperature": 0.7})).summary["verdict"].startswith("raw")
    processed = run(tiny, tmp_path, answer(tiny, top_k(3, 0.7), {"temperature": 0.7, "top_k": 3}))
    assert processed.summary["verdict"].startswith("processed: renormalized")
    neutral = run(tiny, tmp_path, answer(tiny, raw, {"temperature": 1.0}))  # nothing could tell them apart
    assert neutral.summary["ambiguous"] == STEPS and "alike" in neutral.summary["verdict"]


def test_a_duplicated_sampled_token_is_flagged(tiny, tmp_path):
    text = json.dumps(answer(tiny, raw, {"temperature": 1.0}))
    first = text.index('"top_logprobs": [{') + len('"top_logprobs": [{')
    key_end = text.index(",", first)
    text = text[:first] + text[first:key_end] + ", " + text[first:key_end] + text[key_end:]
    report = run(tiny, tmp_path, text=text + "\n")
    assert len(report.summary["defects"]) == 1 and "listed 2 times in top logprobs" in report.summary["defects"][0]
    assert "1 defect(s)" in report.summary["verdict"]


def test_unsorted_top_logprobs_are_flagged(tiny, tmp_path):
    a = answer(tiny, raw, {"temperature": 1.0})
    top = a["response"]["choices"][0]["logprobs"]["top_logprobs"]
    items = list(top[2].items())
    top[2] = dict(items[:1] + items[1:][::-1])  # the sampled token first, the rest worst first
    report = run(tiny, tmp_path, a)
    assert any("top logprobs not sorted" in d for d in report.summary["defects"])


def echo_answer(tiny, prompt_logprobs) -> dict:
    resp = answer(tiny, raw)
    resp["choices"][0]["prompt_logprobs"] = prompt_logprobs
    return resp


def prompt_logprobs(tiny) -> list:
    with torch.no_grad():
        logp = torch.log_softmax(tiny.model(torch.tensor([PROMPT])).logits[0].double(), -1)
    return [None] + [{str(t): {"logprob": float(logp[i - 1, t]), "rank": 1, "decoded_token": None}}
                     for i, t in enumerate(PROMPT) if i > 0]


def test_prompt_logprobs_checked_and_a_dropped_first_position_flagged(tiny, tmp_path):
    good = run(tiny, tmp_path, echo_answer(tiny, prompt_logprobs(tiny)))
    assert good.summary["prompt_vs_raw"]["tokens"] == len(PROMPT) - 1 and not good.summary["defects"]
    dropped = run(tiny, tmp_path, echo_answer(tiny, prompt_logprobs(tiny)[1:]))
    assert any("first (BOS) position dropped" in d for d in dropped.summary["defects"])


def test_stale_prompt_logprobs_are_flagged(tiny, tmp_path):
    stale = prompt_logprobs(tiny)
    stale[3] = {k: {**v, "logprob": v["logprob"] + 0.5} for k, v in stale[3].items()}
    report = run(tiny, tmp_path, echo_answer(tiny, prompt_logprobs(tiny)), echo_answer(tiny, stale))
    defects = report.summary["defects"]
    assert any("differ from the model's raw values by up to 0.5" in d for d in defects)
    assert any("scored differently" in d or "for the same prefix (stale prompt logprobs)" in d for d in defects)


def test_a_chat_answer_with_text_tokens_and_bytes(tiny, tmp_path):
    """Chat shape: tokens as text with their UTF-8 bytes; the sampled token listed first (vLLM)."""
    ids = list(PROMPT)
    content = []
    for _ in range(4):
        v = torch.log_softmax(raw_logits(tiny, ids), -1)
        best = v.topk(TOP)
        token = int(best.indices[0])
        entry = lambda i: {"token": tiny.token_text(i), "logprob": float(v[i]),  # noqa: E731
                           "bytes": list(tiny.token_text(i).encode())}
        content.append({**entry(token), "top_logprobs": [entry(i) for i in best.indices.tolist()]})
        ids.append(token)
    resp = {"model": "tiny", "prompt_token_ids": PROMPT, "choices": [{"index": 0, "message": {"content": ""},
                                                                      "logprobs": {"content": content}}]}
    report = run(tiny, tmp_path, resp)
    assert [t.token_id for t in report.tokens] == ids[len(PROMPT):]
    assert [t.label for t in report.tokens] == ["raw"] * 4
    assert report.answers[0]["shape"] == "chat"


@pytest.mark.parametrize("text, message", [
    ("{\"choices\": []}\n", "no choices"),
    ("{\"choices\": [{\"text\": \"x\"}]}\n", "no logprobs"),
    ("not json\n", "not JSON"),
    ("{\"error\": {\"message\": \"boom\"}}\n", "the answer is an error: boom"),
])
def test_unreadable_answers_are_one_line(tiny, tmp_path, text, message):
    from decodelab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        run(tiny, tmp_path, text=text)


def test_an_answer_without_the_prompt_ids(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    resp = answer(tiny, raw)
    del resp["choices"][0]["prompt_token_ids"]
    with pytest.raises(ConfigError, match="the prompt's token ids are unknown"):
        run(tiny, tmp_path, resp)
