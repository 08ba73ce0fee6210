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


# ---------------------------------------------------------------------------------------------------------------
# mutation run of core/analysis/check_logprobs.py (2026-12-02)
# The chat shape entry by entry (read_answers' parse, before any model call), the fit without settings on hand-made
# logits, and the request / echo paths the tests above never took.

from decodelab.core.analysis.check_logprobs import (  # noqa: E402
    Listed, Token, _fit, _label_fitted)


def read(tiny, tmp_path, obj):
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(obj))
    return read_answers(path, tiny, {})


def chat_entry(tiny, i: int, v: torch.Tensor, text: bool = True, raw_bytes: bool = True) -> dict:
    entry = {"logprob": float(v[i])}
    if text:
        entry["token"] = tiny.token_text(i)
    if raw_bytes:
        entry["bytes"] = list(tiny.token_text(i).encode())
    return entry


def chat(tiny, steps: int, top=None, prompt=True) -> tuple[dict, list[int], list[list[int]]]:
    """A chat answer of the greedy continuation of PROMPT at temperature 1 (its ids, and each step's listed ids);
    ``top(step, token, best)`` gives a step's listed ids (default: the best TOP, which start with the greedy token)."""
    ids, tops = list(PROMPT), []
    content = []
    for step in range(steps):
        v = torch.log_softmax(raw_logits(tiny, ids), -1)
        best = v.topk(TOP + 1).indices.tolist()
        token = best[0]
        listed = top(step, token, best) if top else best[:TOP]
        content.append({**chat_entry(tiny, token, v), "top_logprobs": [chat_entry(tiny, i, v) for i in listed]})
        ids.append(token)
        tops.append(listed)
    resp = {"model": "tiny", "choices": [{"index": 0, "message": {"content": ""}, "logprobs": {"content": content}}]}
    if prompt:
        resp["prompt_token_ids"] = PROMPT
    return resp, ids[len(PROMPT):], tops


def test_chat_ids_from_the_bytes_or_else_the_text(tiny, tmp_path):
    """An entry's bytes name its id even when its text names none; without bytes its text does; the text and the
    value are the entry's own."""
    resp, ids, tops = chat(tiny, 2)
    first, second = resp["choices"][0]["logprobs"]["content"]
    first["token"] = "no such token text"  # the bytes decide
    first["top_logprobs"][1]["token"] = "nor this"
    for entry in [second] + second["top_logprobs"]:
        del entry["bytes"]  # the text decides
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.tokens] == ids
    assert [t.text for t in a.tokens] == ["no such token text", tiny.token_text(ids[1])]
    assert [t.value for t in a.tokens] == [first["logprob"], second["logprob"]]
    assert [[x.token_id for x in t.listed] for t in a.tokens] == tops
    assert [[x.value for x in t.listed] for t in a.tokens] == [[x["logprob"] for x in e["top_logprobs"]]
                                                                for e in (first, second)]


def test_a_chat_text_two_ids_decode_to_names_neither(tiny, tmp_path):
    """'\\ufffd' is the text of several byte tokens: without bytes it names no id, and checking stops there."""
    assert sum(tiny.token_text(i) == "\ufffd" for i in range(tiny.vocab_size)) > 1
    resp, ids, _ = chat(tiny, 2)
    second = resp["choices"][0]["logprobs"]["content"][1]
    second["token"] = "\ufffd"
    del second["bytes"]
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.tokens] == [ids[0], None]
    report = run(tiny, tmp_path, resp)
    assert len(report.tokens) == 1 and "token 1 is a text no single id decodes to: tokens from it on are skipped " \
        "(ask with return_tokens_as_token_ids)" in report.answers[0]["notes"]


def test_chat_sampled_token_listed_first_is_no_disorder(tiny, tmp_path):
    """vLLM's chat lists the sampled token first, then the best: a sampled token below the best is not "unsorted";
    the note says what that first place costs."""
    resp, ids, tops = chat(tiny, 2, top=lambda step, token, best: [best[2], best[0], best[1], best[3], best[4]])
    for entry in resp["choices"][0]["logprobs"]["content"]:  # the sampled token is now the third best
        entry.update({k: entry["top_logprobs"][0][k] for k in ("token", "logprob", "bytes")})
    report = run(tiny, tmp_path, resp)
    assert report.summary["defects"] == []
    assert report.answers[0]["notes"] == ["chat top_logprobs start with the sampled token (vLLM), which displaces "
                                          "the N-th best"]
    assert [t.label for t in report.tokens][:1] == ["raw"]


def test_chat_without_the_sampled_token_first(tiny, tmp_path):
    """One token whose sampled id is not listed first: no note (and no defect for sorted alternatives)."""
    resp, ids, tops = chat(tiny, 1, top=lambda step, token, best: best[1:TOP + 1])
    report = run(tiny, tmp_path, resp)
    assert report.answers[0]["notes"] == [] and report.summary["defects"] == []


def test_chat_disorder_and_repeats_flagged_word_for_word(tiny, tmp_path):
    """Step 0: the second best listed before the best (the sampled token, so not vLLM's sampled-first place);
    step 1: one alternative twice; step 2: two entries with no text (bytes only) twice each, beside a repeated
    text (the names sort as text: None among str)."""
    def top(step, token, best):
        return ([best[1], best[0], best[2], best[3], best[4]], best[:4] + [best[1]],
                best[:3] + [best[1], best[2]])[step]
    resp, ids, tops = chat(tiny, 3, top=top)
    third = resp["choices"][0]["logprobs"]["content"][2]["top_logprobs"]
    del third[1]["token"], third[3]["token"]  # best[1] twice without a text; best[2] twice with one
    report = run(tiny, tmp_path, resp)
    where = report.answers[0]["where"]
    second, third_text = tiny.token_text(tops[1][1]), tiny.token_text(tops[2][2])
    assert where == str(tmp_path / "answers.jsonl")
    assert report.tokens[0].defects == ["top logprobs not sorted"]
    assert report.tokens[1].defects == [f"token {second} listed 2 times in top logprobs", "top logprobs not sorted"]
    assert sorted(report.tokens[2].defects) == sorted([f"token {third_text} listed 2 times in top logprobs",
                                                       "token None listed 2 times in top logprobs",
                                                       "top logprobs not sorted"])
    assert report.summary["defects"][0] == f"{where} token 0: top logprobs not sorted"


def test_chat_token_ids_fill_the_ids_no_text_names(tiny, tmp_path):
    """The choice's token_ids (vLLM's return_token_ids) name a token whose text names no id; an id the entry names
    itself stays; a token_ids list of another length is not read."""
    resp, ids, _ = chat(tiny, 2)
    content = resp["choices"][0]["logprobs"]["content"]
    content[1]["token"] = "\ufffd"
    del content[1]["bytes"]
    resp["choices"][0]["token_ids"] = [ids[0] + 1, ids[1]]  # the first disagrees: the entry's own id stays
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.tokens] == ids
    resp["choices"][0]["token_ids"] = [ids[1]]
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.tokens] == [ids[0], None]


def test_chat_prompt_ids_on_the_choice_and_prompt_logprobs(tiny, tmp_path):
    resp, ids, _ = chat(tiny, 2, prompt=False)
    resp["choices"][0]["prompt_token_ids"] = PROMPT
    resp["prompt_logprobs"] = prompt_logprobs(tiny)
    report = run(tiny, tmp_path, resp)
    assert report.answers[0]["prompt_token_ids"] == PROMPT and [t.token_id for t in report.tokens] == ids
    assert report.summary["prompt_vs_raw"]["tokens"] == len(PROMPT) - 1
    assert report.summary["prompt_vs_raw"]["max_abs_delta"] < 1e-6 and report.summary["defects"] == []
    resp["prompt_logprobs"][2] = {str(PROMPT[2]): {"logprob": -0.125}}
    assert any("prompt logprobs differ" in d for d in run(tiny, tmp_path, resp).summary["defects"])


def test_chat_without_prompt_ids_or_content(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    resp, _, _ = chat(tiny, 1, prompt=False)
    with pytest.raises(ConfigError, match="the prompt's token ids are unknown"):
        run(tiny, tmp_path, resp)
    resp["choices"][0]["logprobs"]["content"] = {"not": "a list"}
    with pytest.raises(ConfigError, match=r"answers.jsonl: logprobs.content is not a list"):
        run(tiny, tmp_path, resp)


def test_prompt_logprobs_read_at_the_prompt_token_not_the_first_key(tiny, tmp_path):
    """An entry that lists a likelier token before the prompt's own: the prompt token's value is read; without
    prompt ids (nothing to tell) the first key is taken, an entry past the ids too."""
    good = prompt_logprobs(tiny)
    entries = [None] + [{"7": {"logprob": -0.5}, **e} for e in good[1:]]
    report = run(tiny, tmp_path, echo_answer(tiny, entries))
    assert report.summary["prompt_vs_raw"]["tokens"] == len(PROMPT) - 1
    assert report.summary["prompt_vs_raw"]["max_abs_delta"] < 1e-6
    resp, _, _ = chat(tiny, 1, prompt=False)
    resp["prompt_logprobs"] = entries
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.prompt] == [None] + [7] * (len(PROMPT) - 1)
    assert [t.value for t in a.prompt] == [None] + [-0.5] * (len(PROMPT) - 1)
    resp["prompt_token_ids"] = PROMPT[:2]
    [a] = read(tiny, tmp_path, resp)
    assert [t.token_id for t in a.prompt] == PROMPT[:2] + [7] * (len(PROMPT) - 2)


Z = [2.0, 1.0, 0.0, -1.0, -3.0]  # hand-made logits for the fit without settings


def lse(xs) -> float:
    return math.log(sum(math.exp(x) for x in xs))


def token_of(values: dict[int, float]) -> Token:
    """The first id sampled, the rest listed."""
    (first, v), *rest = values.items()
    return Token(first, None, v, [Listed(i, x) for i, x in rest])


def fitted(values: dict[int, float], context=frozenset()):
    return _label_fitted(token_of(values), torch.tensor(Z, dtype=torch.float64), set(context), 1e-3)


def test_the_fit_on_two_points_and_its_degenerate_cases():
    z = torch.tensor(Z, dtype=torch.float64)
    a, b, residual = _fit(token_of({0: 1.0, 4: -1.5}), z, set(), 1e-3)  # the sampled token is a point
    assert (a, b, residual) == (pytest.approx(0.5), pytest.approx(0.0), pytest.approx(0.0, abs=1e-12))
    assert _fit(token_of({0: 1.0}), z, set(), 1e-3) is None  # one point
    assert _fit(token_of({0: 1.0, 4: -math.inf}), z, set(), 1e-3) is None  # a removed token is no point
    assert _fit(Token(0, None, 1.0, [Listed(0, 1.0)]), z, set(), 1e-3) is None  # the same point twice
    same = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    assert _fit(token_of({0: -1.0, 1: -2.0}), same, set(), 1e-3) is None  # two points at one logit: no slope


def test_fitted_raw_and_temperature_scaled_by_hand():
    raw = fitted({i: Z[i] - lse(Z) for i in (0, 1, 2)})
    assert raw[0] == "raw" and raw[2:] == (1.0, None, [])
    assert raw[1].tolist() == pytest.approx([x - lse(Z) for x in Z])
    half = [x / 2 for x in Z]
    label, pred, temperature, mass, how = fitted({i: half[i] - lse(half) for i in (1, 0, 3)})
    assert (label, temperature, mass, how) == ("temperature-scaled", pytest.approx(2.0), None, ["temperature 2"])
    assert pred.tolist() == pytest.approx([x - lse(half) for x in half])


def test_fitted_renormalized_by_hand():
    """Top-2 at T = 2: v = z/2 - log(e^1 + e^0.5) on the kept two, the rest removed; kept mass (e^1 + e^0.5) over
    the sum of e^{z/2}."""
    half = [x / 2 for x in Z]
    kept = lse(half[:2])
    values = {0: half[0] - kept, 1: half[1] - kept, 2: -math.inf}
    mass = math.exp(kept - lse(half))
    label, pred, temperature, got_mass, how = fitted(values)
    assert (label, temperature, got_mass) == ("renormalized", pytest.approx(2.0), pytest.approx(mass))
    assert how == ["temperature 2", f"kept mass {mass:.4g}", "or penalties on unlisted context tokens"]
    assert pred[:2].tolist() == pytest.approx([half[0] - kept, half[1] - kept])
    assert fitted(values, context={0})[4] == ["temperature 2", f"kept mass {mass:.4g}"]  # the sampled token seen


def test_fitted_a_normaliser_above_the_vocabularys_is_unexplained():
    """v = z - (log sum e^z + 0.5): a line of slope 1, but more mass than the vocabulary holds: no transform
    gives that, and with no listed token in the context no penalty either."""
    assert fitted({i: Z[i] - lse(Z) - 0.5 for i in (0, 1, 2)}) == ("unexplained", None, None, None, [])


def test_fitted_penalized_by_hand():
    """Token 1 (in the context) lowered by 1.5 before T = 2: off the line the others lie on (slope 1/2)."""
    pen = [x / 2 for x in Z]
    pen[1] = (Z[1] - 1.5) / 2
    values = {0: pen[0] - lse(pen), 1: pen[1] - lse(pen), 2: pen[2] - lse(pen)}
    label, pred, temperature, mass, how = fitted(values, context={1})
    assert (label, pred, mass, how) == ("penalized", None, None, ["penalties on tokens already in the context"])
    assert temperature == pytest.approx(2.0)
    assert fitted(values, context={0})[0] == "unexplained"  # the seen token is on the line: no penalty explains
    # one token outside the context: no line through the rest
    assert fitted({0: values[0], 1: values[1]}, context={1})[0] == "unexplained"


def test_fitted_flat_numbers_are_no_temperature():
    """The same number for different logits: slope 0, an infinite temperature, which no setting gives."""
    assert fitted({0: -1.0, 1: -1.0, 2: -1.0}, context={2}) == ("unexplained", None, None, None, [])


def test_unknown_settings_raw_within_the_tolerance_inclusive():
    """Without settings: raw when every listed number is within the tolerance of log softmax(z), the bound
    included; else the fit, whose error is its own prediction's, or the raw one's for an unexplained token."""
    from decodelab.core.analysis.check_logprobs import _error, _label_unknown

    z = torch.tensor(Z, dtype=torch.float64)
    raw = torch.log_softmax(z, -1)
    t = token_of({0: float(raw[0]) + 0.25, 1: float(raw[1]) + 0.25})
    err = _error(t, raw)
    assert err == pytest.approx(0.25)
    assert _label_unknown(t, z, raw, set(), err) == ("raw", raw, 1.0, None, [], err) and t.matches == ["raw"]
    label, pred, temperature, mass, how, error = _label_unknown(t, z, raw, set(), 1e-3)
    assert (label, temperature, mass) == ("renormalized", pytest.approx(1.0), pytest.approx(math.exp(-0.25)))
    assert how == ["temperature 1", f"kept mass {math.exp(-0.25):.4g}", "or penalties on unlisted context tokens"]
    assert error < 1e-9 and pred[2] == pytest.approx(float(raw[2]) + 0.25)
    flat = token_of({0: -1.0, 1: -1.0, 2: -1.0})
    assert _label_unknown(flat, z, raw, set(), 1e-3) == ("unexplained", raw, None, None, [], _error(flat, raw))
    pen = [x / 2 for x in Z]
    pen[1] = (Z[1] - 1.5) / 2
    seen = token_of({i: pen[i] - lse(pen) for i in (0, 1, 2)})
    assert _label_unknown(seen, z, raw, {1}, 1e-3) == ("penalized", None, pytest.approx(2.0), None,
                                                       ["penalties on tokens already in the context"], None)


def test_a_query_answer_from_the_engines_positions(tiny):
    """A live query: the client's sorted top N, the sampled token put back first where it is not among them, the
    local texts, vLLM semantics, settings from the query, the server's mode as what the values are."""
    from decodelab.core.analysis.check_logprobs import answer_of_query
    from decodelab.core.engine.http.wire import Alternative, Generated, Labels, Position
    from decodelab.core.methods.sample import SampleSettings

    steps = (Position(0, 12, -0.5, 1, (Alternative(12, -0.5), Alternative(14, -2.0)), ("a defect",)),
             Position(1, 284, -3.0, 3, (Alternative(12, -1.0), Alternative(14, -2.5))))
    g = Generated("m", (1, 2), (12, 284), steps, "length", Labels("processed", 2, "vllm"), {})
    a = answer_of_query(g, SampleSettings(temperature=0.7), "--engine http://127.0.0.1:1", tiny)
    assert (a.where, a.shape, a.prompt_ids, a.prompt) == ("--engine http://127.0.0.1:1", "completions", [1, 2], None)
    assert (a.settings_from, a.values, a.settings.semantics, a.settings.temperature) == ("query", "processed",
                                                                                         "vllm", 0.7)
    assert [(t.token_id, t.text, t.value, t.defects) for t in a.tokens] == [
        (12, tiny.token_text(12), -0.5, ["a defect"]), (284, tiny.token_text(284), -3.0, [])]
    assert [[(x.token_id, x.value) for x in t.listed] for t in a.tokens] == [[(12, -0.5), (14, -2.0)],
                                                                          [(284, -3.0), (12, -1.0), (14, -2.5)]]


def stages_of(*names_and_logits):
    return [(name, torch.tensor(z, dtype=torch.float64)) for name, z in names_and_logits]


def test_hypotheses_one_per_label_after_its_last_stage():
    from decodelab.core.analysis.check_logprobs import _hypotheses

    pen = [2.0, 0.5, 0.0, -1.0, -3.0]
    half = [x / 2 for x in pen]
    top2 = half[:2] + [-math.inf] * 3
    stages = stages_of(("raw", Z), ("bias", [2.0, 1.0, 0.0, -1.0, -2.0]), ("repetition-penalty", pen),
                       ("something else", [9.0] * 5), ("temperature", half), ("top-k", top2))
    hyps = _hypotheses(stages, greedy=False)
    assert [(n, applied) for n, _, applied in hyps] == [
        ("raw", []), ("penalized", ["bias", "repetition-penalty"]),
        ("temperature-scaled", ["bias", "repetition-penalty", "temperature"]),
        ("renormalized", ["bias", "repetition-penalty", "temperature", "top-k"])]
    for (_, p, _), z in zip(hyps, (Z, pen, half, top2)):
        assert p.tolist() == pytest.approx(torch.log_softmax(torch.tensor(z, dtype=torch.float64), -1).tolist())
    greedy = _hypotheses(stages, greedy=True)  # vLLM's greedy values stop after the penalties
    assert [n for n, _, _ in greedy] == ["raw", "penalized"]


def known(values: dict[int, float], stages, temperature=None, greedy=False, tolerance=1e-3):
    from decodelab.core.analysis.check_logprobs import _label_known
    from decodelab.core.methods.sample import SampleSettings

    t = token_of(values)
    return _label_known(t, stages, SampleSettings(temperature=temperature), greedy, tolerance), t.matches


def logp(z) -> list[float]:
    return torch.log_softmax(torch.tensor(z, dtype=torch.float64), -1).tolist()


def test_known_settings_label_the_closest_within_tolerance():
    pen = [2.0, 0.5, 0.0, -1.0, -3.0]
    half = [x / 2 for x in pen]
    top2 = half[:2] + [-math.inf] * 3
    stages = stages_of(("raw", Z), ("repetition-penalty", pen), ("temperature", half), ("top-k", top2))
    v = logp(top2)
    (label, pred, temperature, mass, how, err), matches = known({0: v[0], 1: v[1], 2: -math.inf}, stages, 0.5)
    kept = math.exp(half[0]) + math.exp(half[1])  # the mass under temperature-scaled, not the penalized one
    assert (label, temperature, err) == ("renormalized", 0.5, 0.0) and matches == ["renormalized"]
    assert mass == pytest.approx(kept / sum(math.exp(x) for x in half))
    assert how == ["repetition-penalty", "temperature", "top-k", f"kept mass {mass:.4g}"]
    # 0.01 off the temperature-scaled numbers, nearer them than any other: unexplained, with the nearest's error
    v = logp(half)
    (label, pred, temperature, mass, how, err), matches = known({0: v[0] + 0.01, 1: v[1]}, stages, 0.5)
    assert (label, err, how, mass, matches) == ("unexplained", pytest.approx(0.01), ["repetition-penalty",
                                                                                     "temperature"], None, [])
    assert pred.tolist() == pytest.approx(v)
    # the same numbers at a tolerance of exactly their error: within it
    assert known({0: v[0] + 0.01, 1: v[1]}, stages, 0.5, tolerance=err)[0][0] == "temperature-scaled"
    # greedy: the temperature stage is no hypothesis
    assert known({0: v[0], 1: v[1]}, stages, 0.5, greedy=True)[0][0] == "unexplained"


def test_known_settings_near_ties_name_the_simplest():
    """A presence penalty on token 1 that moves the listed numbers by about its size times (1 - p_1): raw is
    9.95e-5 from them, the penalized hypothesis exact, within max(1e-5, tolerance / 100) = 1e-4 of the best at
    tolerance 0.01, so both match and raw (the simplest) names it; at 1.5e-5 and tolerance 1e-3, more than 1e-5 from
    the best, only the penalized one matches."""
    p1 = math.exp(logp(Z)[1])
    for gap, tolerance, label, matches in ((9.95e-5, 0.01, "raw", ["raw", "penalized"]),
                                           (1.5e-5, 1e-3, "penalized", ["penalized"])):
        pen = list(Z)
        pen[1] -= gap / (1 - p1)
        stages = stages_of(("raw", Z), ("presence-penalty", pen))
        v, raw = logp(pen), logp(Z)
        raw_err = max(abs(v[i] - raw[i]) for i in (0, 1, 2))
        assert raw_err == pytest.approx(gap, rel=1e-3) and (label == "penalized" or 9.9e-5 < raw_err < 1e-4)
        (got, pred, temperature, mass, how, err), got_matches = known({0: v[0], 1: v[1], 2: v[2]}, stages,
                                                                      tolerance=tolerance)
        assert (got, got_matches, temperature) == (label, matches, 1.0)
        assert err == (0.0 if label == "penalized" else raw_err)
    (got, *_), matches = known({0: logp(Z)[0], 1: logp(Z)[1]}, stages_of(("raw", Z)))
    assert (got, matches) == ("raw", ["raw", "processed"])  # no transform: raw or processed alike


def test_ids_of_token_id_keys_and_odd_tokens(tiny):
    from decodelab.core.analysis.check_logprobs import Ids

    ids = Ids(tiny)
    assert (ids.of("token_id:5"), ids.of("token_id:12"), ids.of("token_id:x")) == (5, 12, None)
    assert ids.of("not_an_id:12") is None  # nine characters and digits, but not the prefix
    assert ids.of(12) is None and ids.of(None) is None and ids.of(["a"]) is None
    assert ids.of(tiny.token_text(12)) == 12 and ids.of("no such text", list(tiny.token_text(12).encode())) == 12
    assert ids.of(tiny.token_text(12), [0xE2]) is None  # a partial UTF-8 byte names no single id


def test_the_order_check():
    from decodelab.core.analysis.check_logprobs import _order_defect

    assert _order_defect([-0.1, -2.0, -1.0], skip_first=True) == "top logprobs not sorted"
    assert _order_defect([-3.0, -0.5, -1.0], skip_first=True) is None  # the sampled token first, then sorted
    assert _order_defect([-3.0, -0.5, -1.0], skip_first=False) == "top logprobs not sorted"
    assert _order_defect([-1.0, -2.0, -1.5], skip_first=False) == "top logprobs not sorted"
    assert _order_defect([-1.0, -1.0, -math.inf], skip_first=False) is None  # ties and a removed token are in order


def test_completions_sampled_token_first_and_disorder(tiny, tmp_path):
    """The last step's sampled token made the third best (listed first, as vLLM does): no defect; listing the
    second best before the best (the sampled one) is one."""
    a = answer(tiny, raw, {"temperature": 1.0})
    lp = a["response"]["choices"][0]["logprobs"]
    keys = list(lp["top_logprobs"][-1])
    third = keys[2]
    lp["tokens"][-1], lp["token_logprobs"][-1] = third, lp["top_logprobs"][-1][third]
    lp["top_logprobs"][-1] = {third: lp["top_logprobs"][-1][third],
                              **{k: v for k, v in lp["top_logprobs"][-1].items() if k != third}}
    report = run(tiny, tmp_path, a)
    assert report.summary["defects"] == [] and [t.label for t in report.tokens] == ["raw"] * STEPS
    first = lp["top_logprobs"][0]
    best, second = list(first)[:2]
    lp["top_logprobs"][0] = {second: first[second], best: first[best],
                             **{k: v for k, v in first.items() if k not in (best, second)}}
    report = run(tiny, tmp_path, a)
    assert report.summary["defects"] == [f"{tmp_path / 'answers.jsonl'} token 0: top logprobs not sorted"]
    [parsed] = read(tiny, tmp_path, a["response"])
    assert (parsed.where, parsed.shape, parsed.prompt) == (str(tmp_path / "answer.json"), "completions", None)
    assert parsed.tokens[0].text == lp["tokens"][0] and parsed.tokens[0].token_id == int(lp["tokens"][0][9:])


def test_completions_without_top_logprobs_or_of_two_lengths(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    a = answer(tiny, raw, {"temperature": 1.0})["response"]
    lp = a["choices"][0]["logprobs"]
    del lp["top_logprobs"]
    [parsed] = read(tiny, tmp_path, a)
    assert [t.listed for t in parsed.tokens] == [[]] * STEPS
    lp["tokens"] = [12] + lp["tokens"][1:]  # a token that is no text: no id, no text
    [parsed] = read(tiny, tmp_path, a)
    assert (parsed.tokens[0].token_id, parsed.tokens[0].text) == (None, None)
    message = "answer.json: logprobs has no tokens / token_logprobs of one length"
    for tokens, values in ((lp["tokens"][:-1], lp["token_logprobs"]), (None, lp["token_logprobs"]),
                           (lp["tokens"], None)):
        with pytest.raises(ConfigError, match=message):
            read(tiny, tmp_path, {"choices": [{"logprobs": {"tokens": tokens, "token_logprobs": values}}]})


def test_completions_token_ids_fill_the_ids_no_text_names(tiny, tmp_path):
    a = answer(tiny, raw, {"temperature": 1.0})["response"]
    choice = a["choices"][0]
    ids = [int(t[9:]) for t in choice["logprobs"]["tokens"]]
    choice["logprobs"]["tokens"][1] = "\ufffd"
    choice["token_ids"] = [ids[0] + 1] + ids[1:]  # the first disagrees: the key's own id stays
    [parsed] = read(tiny, tmp_path, a)
    assert [t.token_id for t in parsed.tokens] == ids
    choice["token_ids"] = ids[1:]
    [parsed] = read(tiny, tmp_path, a)
    assert [t.token_id for t in parsed.tokens][:2] == [ids[0], None]


def echoed(tiny, request: dict | None, usage: bool = False) -> dict:
    """vLLM's echo: the prompt's tokens first (position 0 without a number), then the generated ones."""
    a = answer(tiny, raw, {"temperature": 1.0})
    resp = a["response"]
    lp = resp["choices"][0]["logprobs"]
    with torch.no_grad():
        logp = torch.log_softmax(tiny.model(torch.tensor([PROMPT])).logits[0].double(), -1)
    lp["tokens"] = [f"token_id:{t}" for t in PROMPT] + lp["tokens"]
    lp["token_logprobs"] = [None] + [float(logp[i - 1, t]) for i, t in enumerate(PROMPT) if i] + lp["token_logprobs"]
    lp["top_logprobs"] = [None] * len(PROMPT) + lp["top_logprobs"]
    if usage:
        resp["usage"] = {"prompt_tokens": len(PROMPT)}
    return resp if request is None else {"request": request, "response": resp}


def test_echo_splits_the_prompt_from_the_generated_tokens(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    for a in (echoed(tiny, {"prompt": PROMPT, "echo": True, "temperature": 1.0}), echoed(tiny, None, usage=True)):
        report = run(tiny, tmp_path, a)
        assert report.summary["tokens"] == STEPS and report.summary["labels"]["raw"] == STEPS
        assert report.summary["prompt_vs_raw"]["tokens"] == len(PROMPT) - 1
        assert report.summary["prompt_vs_raw"]["max_abs_delta"] < 1e-6 and report.summary["defects"] == []
        assert report.answers[0]["prompt_token_ids"] == PROMPT
    with pytest.raises(ConfigError, match=r"answers.jsonl: an echoed answer, but how many of its tokens are the "
                                          r"prompt is unknown \(log the request or usage.prompt_tokens\)"):
        run(tiny, tmp_path, echoed(tiny, None))
    no_echo = echoed(tiny, {"prompt": PROMPT, "echo": False})  # then the prompt's tokens are read as generated
    [parsed] = read(tiny, tmp_path, no_echo)
    assert len(parsed.tokens) == len(PROMPT) + STEPS and parsed.prompt is None
    for max_tokens, checked in ((0, 0), (1, STEPS)):  # vLLM's echo with max_tokens 0 drops its one token
        a = echoed(tiny, {"prompt": PROMPT, "echo": True, "max_tokens": max_tokens})
        assert run(tiny, tmp_path, a).summary["tokens"] == checked


def test_the_request_prompt_as_text_or_ids(tiny, tmp_path):
    """A text prompt is encoded with the request's add_special_tokens (vLLM's default true); a list of ints is the
    ids; a list of texts (a batch of prompts) is neither."""
    from decodelab.core.analysis.check_logprobs import read_answers

    calls = []

    class Tokenizer:
        def encode(self, text, add_special_tokens):
            calls.append((text, add_special_tokens))
            return [1, 2, 3]

    class Local:
        tokenizer, vocab_size = Tokenizer(), 4

        def token_text(self, i):
            return f"<{i}>"

    resp = answer(tiny, raw, {})["response"]
    path = tmp_path / "answers.jsonl"
    for request, ids in (({"prompt": "Once"}, [1, 2, 3]), ({"prompt": "Once", "add_special_tokens": False}, [1, 2, 3]),
                         ({"prompt": [7, 8]}, [7, 8]), ({"prompt": ["Once", "upon"]}, None), ({"prompt": []}, None)):
        path.write_text(json.dumps({"request": request, "response": resp}))
        assert read_answers(path, Local(), {})[0].prompt_ids == ids
    assert calls == [("Once", True), ("Once", False)]


def test_settings_of_the_request_and_the_generation_config():
    from decodelab.core.analysis.check_logprobs import settings_of_request

    s, notes = settings_of_request({"temperature": 0.5, "top_k": -1, "top_p": 1.0, "presence_penalty": -1.0,
                                    "logit_bias": {"12": 5}, "seed": 3}, {"temperature": 0.9, "top_p": 0.8})
    assert (s.temperature, s.top_k, s.top_p, s.presence_penalty, s.logit_bias, s.seed, s.semantics) == (
        0.5, None, None, -1.0, (("12", 5.0),), 3, "vllm")
    assert notes == []
    s, notes = settings_of_request({"top_k": 4}, {"temperature": 0.9, "top_p": 0.8})
    assert (s.temperature, s.top_p, s.top_k) == (0.9, 0.8, 4)
    assert notes == ["temperature not in the request: 0.9 from the model's generation_config, as vLLM fills it",
                     "top_p not in the request: 0.8 from the model's generation_config, as vLLM fills it"]
    assert settings_of_request(None, {}) == (None, [])


def test_parse_answer_choices_and_what_is_known_of_them(tiny, tmp_path):
    from decodelab.core.analysis.check_logprobs import read_answers
    from decodelab.core.errors import ConfigError

    resp, ids, _ = chat(tiny, 2)
    resp["choices"].append(json.loads(json.dumps(resp["choices"][0])))
    path = tmp_path / "answers.json"
    path.write_text(json.dumps({"request": {"temperature": 1.0}, "response": resp}))
    answers = read_answers(path, tiny, {"top_k": 20})
    assert [a.where for a in answers] == [f"{path} choice 0", f"{path} choice 1"]
    assert [a.settings_from for a in answers] == ["request", "request"] and answers[0].settings.top_k == 20
    note = "chat top_logprobs start with the sampled token (vLLM), which displaces the N-th best"
    assert answers[0].notes == [note, "top_k not in the request: 20 from the model's generation_config, as vLLM "
                                      "fills it"]
    answers[0].notes.append("one more")
    assert answers[1].notes[-1] != "one more"  # each choice its own notes
    assert [a.settings_from for a in read(tiny, tmp_path, resp)] == [None, None]
    for bad, message in (([1], "item 0: no choices"), ({"choices": ["x"]}, "answer.json: no logprobs")):
        with pytest.raises(ConfigError, match=message):
            read(tiny, tmp_path, bad)


def test_jsonl_lines_lists_and_empty_files(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    one = json.dumps(answer(tiny, raw))
    path = tmp_path / "answers.jsonl"
    path.write_text(one + "\n\n" + one + "\n")
    report = check(tiny, read_answers(path, tiny, {}))
    assert [a["where"] for a in report.answers] == [f"{path} line 1", f"{path} line 3"]
    assert [(r.answer, r.index, r.position) for r in report.tokens][STEPS - 1:STEPS + 1] == [
        (0, STEPS - 1, len(PROMPT) + STEPS - 1), (1, 0, len(PROMPT))]
    path.write_text(one + "\nnot json\n")
    with pytest.raises(ConfigError, match=f"FILE {path} line 2: not JSON"):
        read_answers(path, tiny, {})
    path.write_text("\n \n")
    with pytest.raises(ConfigError, match=f"^FILE {path}: no answers in it$"):
        read_answers(path, tiny, {})
    with pytest.raises(ConfigError, match=f"^FILE {tmp_path / 'missing.jsonl'}: no such file"):
        read_answers(tmp_path / "missing.jsonl", tiny, {})


def test_the_largest_difference_over_the_listed_numbers():
    from decodelab.core.analysis.check_logprobs import _error

    pred = torch.tensor([-1.0, -2.0, -math.inf, -3.0], dtype=torch.float64)
    assert _error(Token(0, None, -1.25, [Listed(1, -2.0)]), pred) == 0.25  # the sampled token counts
    assert _error(Token(0, None, -1.0, [Listed(None, -9.0), Listed(1, -2.5)]), pred) == 0.5  # an unknown id skipped
    assert _error(Token(0, None, None, [Listed(2, -math.inf), Listed(3, -3.5)]), pred) == 0.5  # both removed: equal
    assert _error(Token(0, None, -1.0, [Listed(1, -math.inf)]), pred) == math.inf  # removed on one side only
    assert _error(Token(0, None, -1.0, [Listed(2, -5.0)]), pred) == math.inf


def test_checked_rows_and_the_vocabulary_bound(tiny, tmp_path):
    from decodelab.core.errors import ConfigError

    report = run(tiny, tmp_path, answer(tiny, raw, {"temperature": 0.7, "top_k": 3}))
    rows = report.tokens
    assert [r.token for r in rows] == [tiny.token_text(r.token_id) for r in rows]
    assert [r.listed for r in rows] == [TOP] * STEPS and all(r.error < 1e-5 for r in rows)
    assert report.summary["ambiguous"] == 0 and report.summary["verdict"].startswith("raw:")
    assert report.answers[0]["settings"] == {"temperature": 0.7, "top_k": 3, "seed": 0}
    assert report.answers[0]["settings_from"] == "request"
    a = answer(tiny, raw)
    a["choices"][0]["logprobs"]["top_logprobs"][0]["token_id:0"] = -20.0  # id 0 is in the vocabulary
    run(tiny, tmp_path, a)
    message = (f"^{tmp_path / 'answers.jsonl'}: token ids outside --model tiny's vocabulary of 4096: the engine's "
               "model has another vocabulary$")
    for sampled, listed in ((4096, None), (None, 4096)):
        a = answer(tiny, raw)
        lp = a["choices"][0]["logprobs"]
        if sampled is not None:
            lp["tokens"][1] = f"token_id:{sampled}"
        else:
            lp["top_logprobs"][1][f"token_id:{listed}"] = -20.0
        with pytest.raises(ConfigError, match=message):
            run(tiny, tmp_path, a)
    a = answer(tiny, raw)
    del a["choices"][0]["prompt_token_ids"]
    with pytest.raises(ConfigError, match=r"the prompt's token ids are unknown \(log the request with its prompt, or "
                                          r"ask with return_token_ids / echo\)$"):
        run(tiny, tmp_path, a)


def test_a_greedy_point_mass_is_no_hypothesis(tiny, tmp_path):
    """vLLM's processed values for a greedy row stop after the penalties: a point mass on the argmax (what the
    temperature-0 stage gives) is unexplained; a request that sets no temperature is not greedy."""
    def point(z, seen):
        return torch.full_like(z, -math.inf).index_fill(0, z.argmax(), 0.0)
    report = run(tiny, tmp_path, answer(tiny, point, {"temperature": 0.0}))
    assert [t.label for t in report.tokens] == ["unexplained"] * STEPS
    report = run(tiny, tmp_path, answer(tiny, raw, {}))
    assert [t.label for t in report.tokens] == ["raw"] * STEPS and "temperature" not in report.answers[0]["settings"]


def test_figures_by_hand():
    from decodelab.core.analysis.check_logprobs import Figures, figures

    assert figures([]) == figures([(None, -1.0), (-1.0, None), (-math.inf, -1.0)]) == Figures(0, None, None, None,
                                                                                               None)
    f = figures([(-1.0, -1.5), (-2.0, -1.0), (-math.inf, -3.0)])
    assert (f.tokens, f.max_abs_delta, f.mean_abs_delta) == (2, 1.0, 0.75)
    assert f.mean_ratio == pytest.approx((math.exp(-0.5) + math.exp(1.0)) / 2) and f.outside_band == 1.0
    for bound in (0.9, 1.1):  # a ratio exactly at a bound is inside the band
        l = math.log(bound)
        while math.exp(l) != bound:
            l = math.nextafter(l, math.inf if math.exp(l) < bound else -math.inf)
        assert figures([(0.0, l)]).outside_band == 0.0


class _BosTokenizer:
    bos_token_id = 1

    def encode(self, text, add_special_tokens):
        return ([1] if add_special_tokens else []) + [97]


def test_a_missing_bos(tiny):
    from decodelab.core.analysis.check_logprobs import Answer, check_prompt

    class Local:
        tokenizer = _BosTokenizer()

    def defects(ids):
        return check_prompt(Local(), Answer("w", "completions", ids, []), 1e-3)
    assert defects([5, 1]) == (["the prompt has no BOS (1) although the tokenizer adds one"], [])
    assert defects([1, 5]) == ([], []) and defects([]) == ([], [])
    assert check_prompt(tiny, Answer("w", "completions", [5, 1], []), 1e-3) == ([], [])  # tiny adds no BOS


def test_prompt_logprobs_defects_word_for_word(tiny, tmp_path):
    good = prompt_logprobs(tiny)
    dropped = run(tiny, tmp_path, echo_answer(tiny, good[1:])).summary["defects"]
    assert dropped == [f"{tmp_path / 'answers.jsonl'}: prompt logprobs have one position fewer than the prompt: the "
                       "first (BOS) position dropped"]
    first = [{str(PROMPT[0]): {"logprob": -1.0}}] + good[1:]
    assert run(tiny, tmp_path, echo_answer(tiny, first)).summary["defects"] == [
        f"{tmp_path / 'answers.jsonl'}: prompt position 0 has a logprob (nothing precedes it to condition on)"]
    holes = [None, None] + good[2:]  # a position without a number is skipped
    report = run(tiny, tmp_path, echo_answer(tiny, holes))
    assert report.summary["prompt_vs_raw"]["tokens"] == len(PROMPT) - 2 and report.summary["defects"] == []
    assert run(tiny, tmp_path, echo_answer(tiny, [None] * len(PROMPT))).summary["defects"] == []
    two = answer(tiny, raw)
    two["choices"][0]["prompt_token_ids"] = PROMPT[:2]
    two["choices"][0]["prompt_logprobs"] = good[:2]
    assert run(tiny, tmp_path, two).summary["prompt_vs_raw"]["tokens"] == 1  # two prompt tokens: one number
    stale = [None] + [{k: {"logprob": v["logprob"] + 0.5} for k, v in e.items()} for e in good[1:]]
    report = run(tiny, tmp_path, echo_answer(tiny, stale))
    worst = report.summary["prompt_vs_raw"]["max_abs_delta"]
    assert report.summary["defects"] == [f"{tmp_path / 'answers.jsonl'}: prompt logprobs differ from the model's raw "
                                         f"values by up to {worst:.4g} (stale under prefix caching, or another model)"]
    path = tmp_path / "answers.jsonl"
    at_bound = check(tiny, read_answers(path, tiny, {}), tolerance=worst)  # the bound itself is no defect
    assert at_bound.summary["defects"] == []


def test_stale_prompt_logprobs_across_answers_word_for_word(tiny, tmp_path):
    good = prompt_logprobs(tiny)
    stale = [dict(e) if e else e for e in good]
    stale[3] = {k: {"logprob": v["logprob"] + 0.5} for k, v in good[3].items()}
    report = run(tiny, tmp_path, answer(tiny, raw), echo_answer(tiny, good), echo_answer(tiny, stale))
    path = tmp_path / "answers.jsonl"
    v, was = stale[3][str(PROMPT[3])]["logprob"], good[3][str(PROMPT[3])]["logprob"]
    assert report.summary["defects"][-1] == (f"{path} line 3: prompt position 3 scored {v:.6g} here but {was:.6g} in "
                                             f"{path} line 2 for the same prefix (stale prompt logprobs)")
    assert report.summary["prompt_vs_raw"]["tokens"] == 2 * (len(PROMPT) - 1)  # both answers' prompts
    assert len(report.tokens) == 3 * STEPS and [r.answer for r in report.tokens][::STEPS] == [0, 1, 2]
    assert report.summary["defects"][0].startswith(f"{path} line 3: prompt logprobs differ")
    at_bound = check(tiny, read_answers(path, tiny, {}), tolerance=abs(was - v))  # the bound itself is no defect
    assert [d for d in at_bound.summary["defects"] if "stale prompt logprobs" in d] == []
    assert run(tiny, tmp_path, echo_answer(tiny, good), echo_answer(tiny, good)).summary["defects"] == []
    longer = echo_answer(tiny, good + [{"12": {"logprob": -1.0}}])  # a number past the prompt is no position
    assert run(tiny, tmp_path, longer).summary["defects"] == []
    other = echo_answer(tiny, good)  # the same first two tokens, then others: no shared prefix past them
    with torch.no_grad():
        logp = torch.log_softmax(tiny.model(torch.tensor([PROMPT[:2] + [12, 14, 284]])).logits[0].double(), -1)
    other["choices"][0]["prompt_token_ids"] = PROMPT[:2] + [12, 14, 284]
    other["choices"][0]["prompt_logprobs"] = [None] + [{str(t): {"logprob": float(logp[i - 1, t])}} for i, t in
                                                       enumerate(PROMPT[:2] + [12, 14, 284]) if i]
    assert [d for d in run(tiny, tmp_path, echo_answer(tiny, good), other).summary["defects"]
            if "stale" in d] == []


def test_the_verdict_word_for_word(tiny, tmp_path):
    from types import SimpleNamespace as Row

    from decodelab.core.analysis.check_logprobs import _verdict

    def rows(*labels, ambiguous=False):
        return [Row(label=label, ambiguous=ambiguous) for label in labels]
    assert _verdict([], []) == "no token could be checked; no defect found"
    assert _verdict(rows("raw", ambiguous=True), ["x"]) == ("raw or processed alike: the settings changed no token's "
                                                           "numbers; 1 defect(s)")
    assert _verdict(rows("raw", "raw"), []) == ("raw: the model's log softmax at temperature 1 (vLLM --logprobs-mode "
                                               "raw_logprobs); no defect found")
    assert _verdict(rows("renormalized", "penalized", "renormalized"), ["x", "y"]) == (
        "processed: penalized, renormalized (vLLM --logprobs-mode processed_logprobs); 2 defect(s)")
    assert _verdict(rows("raw", "renormalized", "raw"), []) == "mixed: 2 raw, 1 renormalized; no defect found"
    assert _verdict(rows("penalized", "unexplained"), []) == "mixed: 1 penalized, 1 unexplained; no defect found"
    report = run(tiny, tmp_path, answer(tiny, temperature(0.5), {"temperature": 0.7}))  # no label explains them
    assert report.summary["labels"]["unexplained"] == STEPS and report.summary["vs_label"]["tokens"] == 0


def test_the_fit_at_its_bounds():
    """Each bound of the fit at an input that meets it exactly: logits 1e-9 apart are a slope (below that none); a
    residual, a normaliser gap and a slope gap equal to the tolerance are outside it (the comparisons are strict)."""
    z = torch.tensor([1e-9, 0.0], dtype=torch.float64)
    assert _fit(token_of({0: -1.0, 1: -2.0}), z, set(), 1e-3) is not None
    zz = torch.tensor(Z, dtype=torch.float64)
    off = {0: Z[0] - lse(Z), 1: Z[1] - lse(Z) - 0.01, 2: Z[2] - lse(Z)}  # token 1 off the line
    residual = _fit(token_of(off), zz, set(), 1e-3)[2]
    assert _label_fitted(token_of(off), zz, set(), residual)[0] == "unexplained"
    seen = {**{i: Z[i] - lse(Z) for i in (0, 2, 3)}, 1: Z[1] - lse(Z) - 1.0}  # 1 in the context, 2 off by 0.01
    seen[2] -= 0.01
    rest = _fit(token_of({i: seen[i] for i in (0, 2, 3)}), zz, set(), 1e-3)[2]
    assert _label_fitted(token_of(seen), zz, {1}, rest * 1.001)[0] == "penalized"
    assert _label_fitted(token_of(seen), zz, {1}, rest)[0] == "unexplained"
    half = [x / 2 for x in Z]
    kept = {0: half[0] - lse(half[:2]), 1: half[1] - lse(half[:2])}
    a, b, _ = _fit(token_of(kept), zz, set(), 1e-3)
    gap = abs(b + float(torch.logsumexp(a * zz, dim=-1)))
    assert _label_fitted(token_of(kept), zz, set(), gap)[0] == "renormalized"
    scaled = {i: Z[i] * 1.5 - lse([x * 1.5 for x in Z]) for i in (0, 1, 2)}
    a, _, _ = _fit(token_of(scaled), zz, set(), 1e-3)
    assert _label_fitted(token_of(scaled), zz, set(), abs(a - 1))[0] == "temperature-scaled"


def test_prompt_logprobs_as_bare_numbers_and_their_listed_tokens(tiny, tmp_path):
    """A prompt position's entry as {id: {logprob, ...}} or {id: number}; every id it lists is kept with its value."""
    resp, _, _ = chat(tiny, 1)
    resp["prompt_logprobs"] = [None, {"7": -0.5, str(PROMPT[1]): -1.5}, {str(PROMPT[2]): {"logprob": -2.5}, "9": {
        "logprob": -0.25}}]
    [a] = read(tiny, tmp_path, resp)
    assert [t.value for t in a.prompt] == [None, -1.5, -2.5]
    assert [[(x.token_id, x.value) for x in t.listed] for t in a.prompt] == [
        [], [(7, -0.5), (PROMPT[1], -1.5)], [(PROMPT[2], -2.5), (9, -0.25)]]


def test_request_min_tokens_is_a_count():
    from decodelab.core.analysis.check_logprobs import settings_of_request

    s, _ = settings_of_request({"min_tokens": 2.0, "top_k": 3.0, "temperature": 1}, {})
    assert (s.min_new_tokens, s.top_k, s.temperature) == (2, 3, 1.0)
    assert (type(s.min_new_tokens), type(s.top_k), type(s.temperature)) == (int, int, float)


def test_fitted_penalized_when_the_sampled_token_was_seen():
    """The sampled token (in the context) is the one off the line; the listed ones are not in the context."""
    pen = list(Z)
    pen[0] = Z[0] - 0.75
    values = {i: pen[i] - lse(pen) for i in (0, 1, 2, 3)}
    assert fitted(values, context={0})[:2] == ("penalized", None)


def test_id_0_sampled_a_tokenizer_without_bos_and_defects_of_every_answer(tiny, tmp_path):
    from decodelab.core.analysis.check_logprobs import Answer, check_prompt

    a = answer(tiny, raw)
    lp = a["choices"][0]["logprobs"]
    lp["tokens"][-1] = "token_id:0"  # id 0 (<|endoftext|>) sampled last: inside the vocabulary
    assert run(tiny, tmp_path, a).tokens[-1].token_id == 0

    class Local:
        tokenizer = object()  # no bos_token_id at all
    assert check_prompt(Local(), Answer("w", "completions", [5, 6], []), 1e-3) == ([], [])
    text = json.dumps(answer(tiny, raw))
    first = text.index('"top_logprobs": [{') + len('"top_logprobs": [{')
    key_end = text.index(",", first)
    doubled = text[:first] + text[first:key_end] + ", " + text[first:key_end] + text[key_end:]
    report = run(tiny, tmp_path, text=doubled + "\n" + text + "\n")  # the defect in the first of two answers
    assert len(report.summary["defects"]) == 1 and report.summary["defects"][0].startswith(
        f"{tmp_path / 'answers.jsonl'} line 1 token 0: token ")
