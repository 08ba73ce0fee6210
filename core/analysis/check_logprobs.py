"""`check-logprobs`: an engine's returned logprobs recomputed on the same model here, each token labelled with what
its number is, the figures trainers watch, and the engine defects that are known to happen.

Input: an OpenAI completions or chat completions answer (one JSON object, a list of them, or JSONL: one a line; a
line may also be ``{"request": ..., "response": ...}``, the pair people log), or a live ``--engine`` query. Token
ids come from ``token_id:N`` keys (vLLM's ``return_tokens_as_token_ids``), ``token_ids`` / ``prompt_token_ids``
(``return_token_ids``), a chat entry's ``bytes``, or a token text that only one id of the local vocabulary decodes
to; a token that cannot be told apart is counted and skipped.

**Labels.** At each generated position the local model's raw logits z give the hypotheses, each a log-probability
over the vocabulary, compared with every number the engine listed there (the sampled token and its alternatives;
a token the engine lists at -inf must be removed in the hypothesis too):

* ``raw``: log softmax(z), the model at temperature 1;
* ``penalized``: log softmax(z') with z' = z after the masks, logit bias and penalties (vLLM's order);
* ``temperature-scaled``: log softmax(z' / T), normalised over the whole vocabulary;
* ``renormalized``: log softmax over the kept set after min-p, top-k and top-p: z'_i / T - log sum_{k kept} e^{z'_k/T}.

With the settings known (the logged request, the live query, or the options given) each hypothesis is decodelab's
own chain under ``--semantics vllm`` at that position, and the label is the first hypothesis (in the order above:
the simplest explanation first) whose largest |difference| over the listed numbers is within ``tolerance``. Without
settings they are fitted: v_i = a z_i + b by least squares over the listed tokens gives T = 1/a; b = -log sum_V
e^{a z} is ``temperature-scaled`` (``raw`` when T = 1), a smaller normaliser (b > that) is ``renormalized`` (kept
probability mass e^{-b - log sum_V e^{a z}}); when the fit fails only because of tokens already in the context,
``penalized``. Anything else is ``unexplained``. (Without settings, a penalty that touched no listed token shrinks the
normaliser as a filter does: such a token reads ``renormalized``, noted "or penalties on unlisted context tokens".)

**Figures** (per generated token with a finite engine value v and a local value l): |v - l|, max and mean; the
importance ratio exp(l - v) a trainer computes (local over engine), its mean, and the share outside [0.9, 1.1].
Against the local raw logprob (``vs_raw``: what a trainer at temperature 1 recomputes), against each token's own
label (``vs_label``: the numerical mismatch left once the label explains the number) and, with settings, against
vLLM's processed value under them (``vs_settings``).

**Defects**: the sampled token listed twice in its top logprobs (a repeated JSON key, or twice in a chat list),
top logprobs out of order (after the sampled token, which vLLM lists first), a first prompt position dropped (or a
BOS missing although the tokenizer adds one), stale prompt logprobs (prompt values that differ from the model, or
the same prefix scored differently by two answers: a prefix cache read although prompt logprobs were asked).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..engine.http.transport import loads, repeated_keys
from ..engine.http.vllm import VLLM_MASKED
from ..engine.http.wire import Generated, SamplingSettings, read_value
from ..errors import ConfigError
from ..inputs import read_input_text
from ..methods.sample import SampleSettings
from ..sampling import replay
from ..sampling.chain import make_chain
from ..sampling.registry import engine_order, param, params, scaling_stage
from ..sampling.semantics import plan as semantics_plan
from ..trace import reasoning
from .full_logprobs import reasoning_split

LABELS = ("raw", "penalized", "temperature-scaled", "renormalized", "unexplained")
# vLLM's order from the registry: every stage before temperature changes the logits before it (a penalty, a mask, a
# bias), every stage after it filters the scaled distribution
VLLM_STAGES = engine_order("vllm")
TEMPERATURE = param("temperature")
SCALING = scaling_stage()  # the stage that divides by T
PENALTY_STAGES = VLLM_STAGES[: VLLM_STAGES.index(SCALING)]
FILTER_STAGES = VLLM_STAGES[VLLM_STAGES.index(SCALING) + 1 :]
RATIO_BAND = (0.9, 1.1)


def request_fields() -> dict:
    """Request field (vLLM's name, the registry's export) -> the settings' parameter: every number vLLM takes."""
    return {p.export["vllm"]: p for p in params() if "vllm" in p.export and p.kind in (int, float)}


# ---------------------------------------------------------------------------------------------------------------
# what an answer says


@dataclass
class Listed:
    token_id: int | None  # None: a text no single id of the local vocabulary decodes to
    value: float  # the engine's number (-inf: removed)


@dataclass
class Token:
    token_id: int | None
    text: str | None
    value: float | None  # None: the engine gave no number (echo's first prompt position)
    listed: list[Listed] = field(default_factory=list)
    defects: list[str] = field(default_factory=list)
    matches: list[str] = field(default_factory=list)  # every label whose hypothesis explains it (set when checked)


@dataclass
class Answer:
    """One choice of one answer: what the engine said, and what is known about how it was asked."""

    where: str  # FILE line N choice C, or --engine URL
    shape: str  # completions | chat
    prompt_ids: list[int] | None
    tokens: list[Token]  # the generated tokens
    prompt: list[Token] | None = None  # prompt logprobs (echo or vLLM's prompt_logprobs), position 0 first
    settings: SampleSettings | None = None  # the sampling settings it was asked with, where known
    settings_from: str | None = None  # request | options | query
    values: str | None = None  # what the engine says its numbers are, where it says (a live query's mode)
    defects: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Ids:
    """Token texts (or bytes) back to ids on the local tokenizer: only a text exactly one id decodes to."""

    def __init__(self, local):
        self.local = local
        self._by_text: dict[str, int | None] | None = None

    def table(self) -> dict[str, int | None]:
        if self._by_text is None:
            table: dict[str, int | None] = {}
            for i in range(self.local.vocab_size):
                text = self.local.token_text(i)
                table[text] = None if text in table else i  # a text two ids decode to names neither
            self._by_text = table
        return self._by_text

    def of(self, token, raw_bytes=None) -> int | None:
        if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
            return int(token[9:])
        if raw_bytes is not None:
            try:
                token = bytes(raw_bytes).decode("utf-8")
            except (UnicodeDecodeError, ValueError, TypeError):
                return None  # a partial UTF-8 byte: its text is shared by many ids
        return self.table().get(token) if isinstance(token, str) else None


def _value(v) -> float | None:
    return None if v is None else read_value(float(v), VLLM_MASKED)


def _order_defect(values: list[float], skip_first: bool) -> str | None:
    rest = values[1:] if skip_first else values
    if any(a < b for a, b in zip(rest, rest[1:])):
        return "top logprobs not sorted"
    return None


def _completions_entry(ids: Ids, token, value, top) -> Token:
    t = Token(ids.of(token), token if isinstance(token, str) else None, _value(value))
    if isinstance(top, dict):
        for key, repeats in repeated_keys(top).items():
            t.defects.append(f"token {key} listed {len(repeats)} times in top logprobs")
        t.listed = [Listed(ids.of(k), _value(v)) for k, v in top.items()]
        order = _order_defect([x.value for x in t.listed], skip_first=bool(t.listed) and t.listed[0].token_id
                              == t.token_id)
        if order:
            t.defects.append(order)
    return t


def _chat_entry(ids: Ids, entry: dict) -> Token:
    t = Token(ids.of(entry.get("token"), entry.get("bytes")), entry.get("token"), _value(entry.get("logprob")))
    listed = entry.get("top_logprobs") or []
    t.listed = [Listed(ids.of(x.get("token"), x.get("bytes")), _value(x.get("logprob"))) for x in listed]
    names = [x.get("token") for x in listed]
    for name in sorted({n for n in names if names.count(n) > 1}, key=str):
        t.defects.append(f"token {name} listed {names.count(name)} times in top logprobs")
    order = _order_defect([x.value for x in t.listed], skip_first=bool(names) and names[0] == t.text)
    if order:
        t.defects.append(order)
    return t


def _prompt_logprobs(ids: Ids, entries: list, prompt_ids: list[int] | None) -> list[Token]:
    """vLLM's prompt_logprobs: element 0 null, then {id: {logprob, rank, decoded_token}} with the prompt token first."""
    out = []
    for i, entry in enumerate(entries):
        token_id = prompt_ids[i] if prompt_ids and i < len(prompt_ids) else None
        if entry is None:
            out.append(Token(token_id, None, None))
            continue
        values = {int(k): _value(v.get("logprob") if isinstance(v, dict) else v) for k, v in entry.items()}
        if token_id is None:
            token_id = next(iter(values))
        out.append(Token(token_id, None, values.get(token_id), [Listed(k, v) for k, v in values.items()]))
    return out


def settings_of_request(request: dict | None, defaults: dict) -> tuple[SampleSettings | None, list[str]]:
    """The sampling settings a logged request asked for (vLLM's field names); a field it left out is what vLLM
    fills it with: the model's generation_config (``defaults``), else the OpenAI default (off)."""
    if not isinstance(request, dict):
        return None, []
    values, notes = {}, []
    neutral = SamplingSettings()
    for key, p in request_fields().items():
        value = request.get(key)
        if value is None and key in defaults:
            value = defaults[key]
            notes.append(f"{key} not in the request: {value} from the model's generation_config, as vLLM fills it")
        if value is None or _off(p, key, value, neutral):
            continue
        values[p.field] = p.kind(value)
    bias = request.get("logit_bias") or {}
    if bias:
        values["logit_bias"] = tuple((str(int(k)), float(b)) for k, b in bias.items())
    if request.get("seed") is not None:
        values["seed"] = int(request["seed"])
    return replace(SampleSettings(), **values, semantics="vllm"), notes


def _off(p, key: str, value, neutral: SamplingSettings) -> bool:
    """Whether vLLM reads ``value`` of request field ``key`` as "stage off": the registry's off-rule for vLLM (top-k 0
    or -1), else the request's neutral value (min_tokens 0). A temperature is never off: it says greedy or not."""
    if p is TEMPERATURE:
        return False
    rule = p.off.get("vllm")
    return rule.test(value) if rule is not None else value == getattr(neutral, key)


def parse_answer(obj, request: dict | None, ids: Ids, where: str, encode, defaults: dict) -> list[Answer]:
    """The choices of one OpenAI (or vLLM) completions / chat completions answer."""
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        raise ConfigError(f"{where}: the answer is an error: {obj['error'].get('message')}")
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"{where}: no choices (not an OpenAI completions or chat answer)")
    settings, notes = settings_of_request(request, defaults)
    out = []
    for c, choice in enumerate(choices):
        here = f"{where} choice {c}" if len(choices) > 1 else where
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lp, dict):
            raise ConfigError(f"{here}: no logprobs (ask with logprobs: N, or logprobs: true for chat)")
        answer = (_parse_chat(obj, choice, lp, request, ids, here, encode) if "content" in lp
                  else _parse_completions(obj, choice, lp, request, ids, here, encode))
        answer.settings, answer.settings_from = settings, ("request" if settings is not None else None)
        answer.notes += notes
        out.append(answer)
    return out


def _request_prompt(request: dict | None, encode) -> list[int] | None:
    prompt = request.get("prompt") if isinstance(request, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        return encode(prompt, bool(request.get("add_special_tokens", True)))
    return None


def _parse_completions(obj, choice, lp, request, ids: Ids, where: str, encode) -> Answer:
    tokens, values, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise ConfigError(f"{where}: logprobs has no tokens / token_logprobs of one length")
    tops = tops if isinstance(tops, list) else [None] * len(tokens)
    entries = [_completions_entry(ids, tok, v, top) for tok, v, top in zip(tokens, values, tops)]
    prompt_ids = choice.get("prompt_token_ids") or _request_prompt(request, encode)
    echo = bool(request.get("echo")) if isinstance(request, dict) else (values and values[0] is None)
    prompt = None
    if echo:
        n = len(prompt_ids) if prompt_ids else ((obj.get("usage") or {}).get("prompt_tokens"))
        if not isinstance(n, int):
            raise ConfigError(f"{where}: an echoed answer, but how many of its tokens are the prompt is unknown "
                              "(log the request or usage.prompt_tokens)")
        prompt, entries = entries[:n], entries[n:]
        if prompt_ids is None:
            prompt_ids = [t.token_id for t in prompt]
        if request and request.get("max_tokens") == 0:  # vLLM runs 1 token and drops it (echo without generation)
            entries = []
    if isinstance(choice.get("prompt_logprobs"), list):
        prompt = _prompt_logprobs(ids, choice["prompt_logprobs"], prompt_ids)
    generated = choice.get("token_ids")
    if isinstance(generated, list) and len(generated) == len(entries):
        for t, token_id in zip(entries, generated):
            t.token_id = int(token_id) if t.token_id is None else t.token_id
    return Answer(where, "completions", list(prompt_ids) if prompt_ids else None, entries, prompt)


def _parse_chat(obj, choice, lp, request, ids: Ids, where: str, encode) -> Answer:
    content = lp.get("content")
    if not isinstance(content, list):
        raise ConfigError(f"{where}: logprobs.content is not a list")
    entries = [_chat_entry(ids, e) for e in content if isinstance(e, dict)]
    generated = choice.get("token_ids")
    if isinstance(generated, list) and len(generated) == len(entries):
        for t, token_id in zip(entries, generated):
            t.token_id = int(token_id) if t.token_id is None else t.token_id
    prompt_ids = obj.get("prompt_token_ids") or choice.get("prompt_token_ids")
    answer = Answer(where, "chat", list(prompt_ids) if prompt_ids else None, entries)
    split = reasoning_split(choice, lp)
    if split:
        answer.defects.append(split)
    if isinstance(obj.get("prompt_logprobs"), list):
        answer.prompt = _prompt_logprobs(ids, obj["prompt_logprobs"], answer.prompt_ids)
    if entries and entries[0].listed and entries[0].listed[0].token_id == entries[0].token_id:
        answer.notes.append("chat top_logprobs start with the sampled token (vLLM), which displaces the N-th best")
    return answer


def read_answers(path: Path, local, defaults: dict) -> list[Answer]:
    """Every choice of every answer in FILE (one JSON value, or JSONL)."""
    text = read_input_text("FILE", path)
    ids = Ids(local)

    def encode(prompt: str, special: bool) -> list[int]:
        return list(local.tokenizer.encode(prompt, add_special_tokens=special))

    try:
        items = [(f"{path}", loads(text))]
    except ValueError:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"{path} line {n}", loads(line)))
                except ValueError as exc:
                    raise ConfigError(f"FILE {path} line {n}: not JSON ({exc})") from None
    if len(items) == 1 and isinstance(items[0][1], list):
        items = [(f"{path} item {i}", v) for i, v in enumerate(items[0][1])]
    if not items:
        raise ConfigError(f"FILE {path}: no answers in it")
    out = []
    for where, item in items:
        request, answer = (item.get("request"), item.get("response")) if isinstance(item, dict) and \
            "response" in item else (None, item)
        out += parse_answer(answer, request, ids, where, encode, defaults)
    return out


def answer_of_query(g: Generated, settings: SampleSettings, where: str, local) -> Answer:
    """A live query's answer: ids exact, settings known, values as the server's mode says."""
    tokens = [Token(p.token_id, local.token_text(p.token_id), p.logprob,
                    [Listed(a.token_id, a.logprob) for a in p.top], list(p.defects)) for p in g.steps]
    # the client lists the top N sorted; the sampled token is re-inserted with its value where vLLM listed it
    for t, p in zip(tokens, g.steps):
        if all(x.token_id != t.token_id for x in t.listed):
            t.listed.insert(0, Listed(t.token_id, t.value))
    return Answer(where, "completions", list(g.prompt_ids), tokens, None, replace(settings, semantics="vllm"),
                  "query", g.labels.values)


# ---------------------------------------------------------------------------------------------------------------
# recomputing and labelling


@dataclass
class Checked:
    """One generated token: the engine's number, the local ones, and what the engine's number is."""

    answer: int
    index: int
    position: int
    token_id: int | None
    token: str | None
    engine_logprob: float | None
    local_raw_logprob: float | None
    label: str  # raw | penalized | temperature-scaled | renormalized | unexplained | skipped
    local_logprob: float | None  # the label's value (the closest hypothesis for unexplained)
    error: float | None  # the largest |engine - label| over the listed numbers
    temperature: float | None  # given, or fitted (no settings)
    kept_mass: float | None  # the kept set's probability at temperature T (renormalized)
    listed: int
    transforms: list[str] = field(default_factory=list)
    ambiguous: bool = False  # raw and processed explain the numbers alike (the settings left them unchanged)
    defects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _hypotheses(stages: list, greedy: bool) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(label, log-probabilities [V], what was applied) from one position's stage outputs under vLLM's reading
    (raw first). A greedy row's temperature-0 stage (a point mass) is no hypothesis: vLLM's processed values for
    a greedy row stop after the penalties."""
    def logp(z):
        return torch.log_softmax(z.double(), dim=-1)

    out = [("raw", logp(stages[0][1]), [])]
    applied: list[str] = []
    for name, z in stages[1:]:
        if greedy and name == SCALING:
            break
        if name not in PENALTY_STAGES + (SCALING,) + FILTER_STAGES:
            continue
        applied = applied + [name]
        label = ("penalized" if name in PENALTY_STAGES else "temperature-scaled" if name == SCALING
                 else "renormalized")
        # each label's hypothesis is the distribution after the last stage of its kind (vLLM's order puts every
        # penalty before temperature, and temperature before every filter)
        out = [h for h in out if h[0] != label] + [(label, logp(z), list(applied))]
    return out


def _error(token, pred: torch.Tensor) -> float:
    """The largest |engine - hypothesis| over the listed tokens; inf where one side removed a token the other kept."""
    worst = 0.0
    for x in [Listed(token.token_id, token.value)] + token.listed:
        if x.token_id is None or x.value is None:
            continue
        p = float(pred[x.token_id])
        if math.isinf(x.value) or math.isinf(p):
            if not (math.isinf(x.value) and math.isinf(p)):
                return math.inf
            continue
        worst = max(worst, abs(x.value - p))
    return worst


def _fit(token, z: torch.Tensor, context: set[int], tolerance: float):
    """No settings: v_i = a z_i + b over the listed finite numbers (least squares); (label, a, b, residual)."""
    points = [(float(z[x.token_id]), x.value) for x in [Listed(token.token_id, token.value)] + token.listed
              if x.token_id is not None and x.value is not None and math.isfinite(x.value)]
    points = list(dict.fromkeys(points))
    if len(points) < 2 or max(p for p, _ in points) - min(p for p, _ in points) < 1e-9:
        return None
    n = len(points)
    mz, mv = sum(p for p, _ in points) / n, sum(v for _, v in points) / n
    a = sum((p - mz) * (v - mv) for p, v in points) / sum((p - mz) ** 2 for p, _ in points)
    b = mv - a * mz
    return a, b, max(abs(v - (a * p + b)) for p, v in points)


def _label_fitted(token, z: torch.Tensor, context: set[int], tolerance: float):
    """(label, predicted log-probabilities or None, temperature, kept mass, transforms)."""
    fit = _fit(token, z, context, tolerance)
    if fit is not None and fit[2] < tolerance and fit[0] > 0:
        a, b, _ = fit
        lse = float(torch.logsumexp(a * z.double(), dim=-1))
        pred = a * z.double() + b
        if abs(b + lse) < tolerance:
            if abs(a - 1) < tolerance:
                return "raw", pred, 1.0, None, []
            return "temperature-scaled", pred, 1 / a, None, [f"temperature {1 / a:.4g}"]
        if -b < lse:
            mass = math.exp(-b - lse)
            how = [f"temperature {1 / a:.4g}", f"kept mass {mass:.4g}"]
            listed = [x.token_id for x in [Listed(token.token_id, token.value)] + token.listed]
            if not context & set(listed):  # a penalty on unlisted context tokens shrinks the normaliser alike
                how.append("or penalties on unlisted context tokens")
            return "renormalized", pred, 1 / a, mass, how
    if fit is not None:  # the tokens already in the context may be the ones off the line: penalties
        rest = Token(None, None, None, [x for x in [Listed(token.token_id, token.value)] + token.listed
                                        if x.token_id is not None and x.token_id not in context])
        again = _fit(rest, z, context, tolerance)
        touched = any(x.token_id in context for x in [Listed(token.token_id, token.value)] + token.listed)
        if again is not None and again[2] < tolerance and touched and again[0] > 0:
            return "penalized", None, 1 / again[0], None, ["penalties on tokens already in the context"]
    return "unexplained", None, None, None, []


def check_answer(lm, answer: Answer, number: int, tolerance: float) -> list[Checked]:
    """Every generated token of one answer, recomputed on ``lm`` and labelled."""
    if answer.prompt_ids is None:
        raise ConfigError(f"{answer.where}: the prompt's token ids are unknown (log the request with its prompt, or "
                          "ask with return_token_ids / echo)")
    known = [t for t in answer.tokens if t.token_id is not None]
    if len(known) < len(answer.tokens):
        cut = next(i for i, t in enumerate(answer.tokens) if t.token_id is None)
        answer.notes.append(f"token {cut} is a text no single id decodes to: tokens from it on are skipped (ask "
                            "with return_tokens_as_token_ids)")
        tokens = answer.tokens[:cut]
    else:
        tokens = answer.tokens
    out: list[Checked] = []
    if not tokens:
        return out
    vocab = lm.vocab_size
    for t in tokens:
        if not 0 <= t.token_id < vocab or any(x.token_id is not None and not 0 <= x.token_id < vocab
                                               for x in t.listed):
            raise ConfigError(f"{answer.where}: token ids outside --model {lm.name}'s vocabulary of {vocab}: the "
                              "engine's model has another vocabulary")
    out_ids = [t.token_id for t in tokens]
    logits = replay.forced_logits(lm.model, answer.prompt_ids, out_ids)
    stages = None
    settings = answer.settings
    if settings is not None:
        chain = make_chain(lm, settings)
        stages = replay.along(chain, answer.prompt_ids, out_ids, logits, record=True)
    greedy = settings is not None and semantics_plan(settings).greedy  # vLLM's: a temperature below 1e-5
    for i, t in enumerate(tokens):
        z = logits[i]
        raw = torch.log_softmax(z.double(), dim=-1)
        context = set(answer.prompt_ids) | set(out_ids[:i])
        if stages is not None:
            row = _label_known(t, stages[i], settings, greedy, tolerance)
        else:
            row = _label_unknown(t, z, raw, context, tolerance)
        label, pred, temperature, mass, transforms, error = row
        out.append(Checked(number, i, len(answer.prompt_ids) + i, t.token_id, lm.token_text(t.token_id), t.value,
                           float(raw[t.token_id]), label,
                           None if pred is None else float(pred[t.token_id]), error, temperature, mass,
                           len(t.listed), transforms, "raw" in t.matches and len(t.matches) > 1,
                           list(t.defects)))
    return out


def _label_known(t: Token, stages: list, settings: SampleSettings, greedy: bool, tolerance: float):
    hyps = _hypotheses(stages, greedy)
    scored = [(name, pred, applied, _error(t, pred)) for name, pred, applied in hyps]
    best = min(scored, key=lambda h: h[3])
    # the hypotheses as close as the best one (float32 noise apart): the simplest of them names the token; more
    # than one such means the transforms did not change this token's numbers (ambiguous)
    close = [h for h in scored if h[3] <= tolerance and h[3] <= best[3] + max(1e-5, tolerance / 100)]
    match = close[0] if close else None
    name, pred, applied, err = match or best
    # raw and the fully processed value both explain it: these settings cannot tell raw from processed here
    t.matches = [h[0] for h in close] if len(close) > 1 or scored[-1][0] != "raw" else ["raw", "processed"]
    temperature = 1.0 if settings.temperature is None else settings.temperature
    mass = None
    if name == "renormalized":  # the kept set's probability under the full-vocabulary distribution before it
        before = [p for n, p, _ in hyps if n != "renormalized"][-1]
        mass = float(before[torch.isfinite(pred)].exp().sum())
    transforms = list(applied) + ([f"kept mass {mass:.4g}"] if mass is not None else [])
    return (name if match else "unexplained"), pred, temperature, mass, transforms, err


def _label_unknown(t: Token, z: torch.Tensor, raw: torch.Tensor, context: set[int], tolerance: float):
    err_raw = _error(t, raw)
    if err_raw <= tolerance:
        t.matches = ["raw"]
        return "raw", raw, 1.0, None, [], err_raw
    label, pred, temperature, mass, transforms = _label_fitted(t, z, context, tolerance)
    if pred is None:
        return label, raw if label == "unexplained" else None, temperature, mass, transforms, \
            (err_raw if label == "unexplained" else None)
    return label, pred, temperature, mass, transforms, _error(t, pred)


# ---------------------------------------------------------------------------------------------------------------
# figures, prompt checks, the report


@dataclass
class Figures:
    """Engine value v against a local value l over the tokens where both are finite."""

    tokens: int
    max_abs_delta: float | None
    mean_abs_delta: float | None
    mean_ratio: float | None  # mean exp(l - v): a trainer's importance ratio (local over engine)
    outside_band: float | None  # share of tokens whose ratio leaves [0.9, 1.1]


def figures(pairs: list[tuple[float | None, float | None]]) -> Figures:
    both = [(v, l) for v, l in pairs if v is not None and l is not None and math.isfinite(v) and math.isfinite(l)]
    if not both:
        return Figures(0, None, None, None, None)
    deltas = [abs(v - l) for v, l in both]
    ratios = [math.exp(l - v) for v, l in both]
    lo, hi = RATIO_BAND
    return Figures(len(both), max(deltas), sum(deltas) / len(deltas), sum(ratios) / len(ratios),
                   sum(1 for r in ratios if not lo <= r <= hi) / len(ratios))


def check_prompt(lm, answer: Answer, tolerance: float) -> tuple[list[str], list[tuple[float, float]]]:
    """Prompt-level defects, and (engine, local raw) pairs of the prompt positions with a number."""
    defects, pairs = [], []
    bos = getattr(lm.tokenizer, "bos_token_id", None)
    ids = answer.prompt_ids or []
    adds_bos = bos is not None and list(lm.tokenizer.encode("a", add_special_tokens=True))[:1] == [bos]
    if adds_bos and ids and ids[0] != bos:
        defects.append(f"the prompt has no BOS ({bos}) although the tokenizer adds one")
    if answer.prompt is None:
        return defects, pairs
    if len(answer.prompt) == len(ids) - 1:
        defects.append("prompt logprobs have one position fewer than the prompt: the first (BOS) position dropped")
        return defects, pairs
    if answer.prompt and answer.prompt[0].value is not None:
        defects.append("prompt position 0 has a logprob (nothing precedes it to condition on)")
    if len(ids) < 2:
        return defects, pairs
    logits = replay.forced_logits(lm.model, ids[:1], ids[1:])
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, t in enumerate(answer.prompt[1 : len(ids)], 1):
        if t.value is not None and t.token_id is not None:
            pairs.append((t.value, float(raw[i - 1, t.token_id])))
    worst = max((abs(v - l) for v, l in pairs if math.isfinite(v)), default=0.0)
    if worst > tolerance:
        defects.append(f"prompt logprobs differ from the model's raw values by up to {worst:.4g} (stale under "
                       "prefix caching, or another model)")
    return defects, pairs


def stale_across(answers: list[Answer], tolerance: float) -> list[str]:
    """The same prompt prefix scored differently by two answers: prompt logprobs read from a stale cache."""
    seen: dict[tuple[int, ...], tuple[float, str]] = {}
    out = []
    for a in answers:
        if a.prompt is None or a.prompt_ids is None:
            continue
        for i, t in enumerate(a.prompt):
            if t.value is None or i >= len(a.prompt_ids):
                continue
            key = tuple(a.prompt_ids[: i + 1])
            if key in seen and abs(seen[key][0] - t.value) > tolerance:
                out.append(f"{a.where}: prompt position {i} scored {t.value:.6g} here but {seen[key][0]:.6g} in "
                           f"{seen[key][1]} for the same prefix (stale prompt logprobs)")
                break
            seen.setdefault(key, (t.value, a.where))
    return out


@dataclass
class Report:
    answers: list[dict]
    tokens: list[Checked]
    summary: dict
    reasoning: list[dict] = field(default_factory=list)  # per answer with thinking markers, its split

    def document(self, lm, source: dict) -> dict:
        """``check-logprobs``' JSON document: the local model, where the answers came from, each answer, a row per
        checked token, the summary and verdict, each answer's reasoning / answer split when there are markers."""
        return {"command": "check-logprobs", "model": lm.name, "device": str(lm.device),
                "dtype": str(lm.dtype).replace("torch.", ""), "source": source, "answers": self.answers,
                "tokens": [r.to_dict() for r in self.tokens], "summary": self.summary,
                **({"reasoning": self.reasoning} if self.reasoning else {})}


def check(lm, answers: list[Answer], tolerance: float = 1e-3, markers_from: SampleSettings | None = None) -> Report:
    """Every answer checked: per token rows, per answer its defects and notes, one summary; ``markers_from``: the
    settings whose thinking markers (--think-tags, else the chat template's) split each answer (None: no split)."""
    rows: list[Checked] = []
    heads, prompt_pairs, defects = [], [], []
    for n, a in enumerate(answers):
        checked = check_answer(lm, a, n, tolerance)
        prompt_defects, pairs = check_prompt(lm, a, tolerance)
        a.defects += prompt_defects
        prompt_pairs += pairs
        rows += checked
        defects += [f"{a.where}: {d}" for d in a.defects] + [f"{a.where} token {r.index}: {d}" for r in checked
                                                             for d in r.defects]
        heads.append({"where": a.where, "shape": a.shape, "prompt_token_ids": a.prompt_ids,
                      "tokens": len(a.tokens), "checked": len(checked), "settings_from": a.settings_from,
                      "settings": _settings_dict(a.settings), "values": a.values, "defects": list(a.defects),
                      "notes": list(a.notes)})
    defects += stale_across(answers, tolerance)
    counts = {label: sum(1 for r in rows if r.label == label) for label in LABELS}
    summary = {"answers": len(answers), "tokens": len(rows), "labels": counts, "tolerance": tolerance,
               "vs_raw": asdict(figures([(r.engine_logprob, r.local_raw_logprob) for r in rows])),
               "vs_label": asdict(figures([(r.engine_logprob, r.local_logprob) for r in rows
                                           if r.label != "unexplained"])),
               "prompt_vs_raw": asdict(figures(prompt_pairs)),
               "defects": defects}
    summary["ambiguous"] = sum(1 for r in rows if r.ambiguous)
    summary["verdict"] = _verdict(rows, defects)
    split = reasoning.for_answers(markers_from, lm, answers) if markers_from is not None else []
    return Report(heads, rows, summary, split)


def _settings_dict(s: SampleSettings | None) -> dict | None:
    if s is None:
        return None
    keys = [p.field for p in request_fields().values()] + [param("logit_bias").field, "seed"]
    return {k: getattr(s, k) for k in keys if getattr(s, k) not in (None, ())}


def _verdict(rows: list[Checked], defects: list[str]) -> str:
    """One sentence: what the numbers are, from the tokens only one label explains."""
    clear = [r.label for r in rows if not r.ambiguous]
    counts = {label: clear.count(label) for label in LABELS if clear.count(label)}
    if not rows:
        what = "no token could be checked"
    elif not counts:
        what = "raw or processed alike: the settings changed no token's numbers"
    elif list(counts) == ["raw"]:
        what = "raw: the model's log softmax at temperature 1 (vLLM --logprobs-mode raw_logprobs)"
    elif "raw" not in counts and "unexplained" not in counts:
        what = "processed: " + ", ".join(counts) + " (vLLM --logprobs-mode processed_logprobs)"
    else:
        what = "mixed: " + ", ".join(f"{n} {label}" for label, n in counts.items())
    return what + (f"; {len(defects)} defect(s)" if defects else "; no defect found")
