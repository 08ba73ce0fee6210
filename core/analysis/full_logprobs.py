"""`check-logprobs --full`: the served engine's whole next-token distribution against the local one, position by
position, and two more engine defects (logprobs that cover a reasoning model's reasoning while the answer does not;
logprobs that change when the engine's speculative decoding is on).

**The distributions.** The engine scores a sequence (the prompt and the engine's own greedy continuation): at each
position its raw log-probabilities of its top N (vLLM's prompt logprobs: the whole vocabulary when N is the
vocabulary's size and the server runs with ``--max-logprobs -1``; otherwise **truncated**, and every figure that needs
the tail is a bound). P is the engine's, Q the local model's (raw, float64), S the listed ids, t_P = 1 - sum_S p,
t_Q = 1 - sum_S q:

* KL(P || Q): ``truncated_kl``'s bounds (exact when the tail is empty);
* TV = 1/2 sum |p - q|: the listed part exactly, the unlisted part between |t_P - t_Q| (triangle inequality on the
  tail as one bucket) and t_P + t_Q;
* top-K overlap: |top-K of P  intersect  top-K of Q| / K (K <= N);
* log-sum-exp drift: logsumexp_S log p - logsumexp_S log q, the two masses the list covers compared in log space (an
  engine whose logprobs are not normalised as the model's drifts; 0 when they agree);
* argmax flips: the engine's top-1 is not the local argmax, with both top-2 margins;
* |delta logprob| of the sequence's own token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..sampling.export import neutral_request
from ..sampling.replay import forced_logits
from .engine_compare import truncated_kl

DEFAULT_K = 5


@dataclass
class FullPosition:
    position: int  # the token's index in the sequence (it is predicted from the tokens before it)
    token_id: int
    listed: int
    truncated: bool
    kl_lower: float
    kl_upper: float
    tv_lower: float
    tv_upper: float
    topk_overlap: float
    lse_drift: float
    abs_delta_logprob: float
    engine_argmax: int
    local_argmax: int
    engine_margin: float | None  # engine's top-1 minus top-2 (listed)
    local_margin: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FullReport:
    positions: list[FullPosition]
    summary: dict
    defects: list[str] = field(default_factory=list)
    speculative: dict | None = None  # --spec-engine: the second server's drift (:func:`speculative_drift`)

    def full_summary(self) -> dict:
        """The summary with the defects found (a speculative server that drifts)."""
        spec = self.speculative
        return {**self.summary, "defects": [spec["defect"]] if spec and spec["defect"] else []}

    def document(self, lm, source: dict, prompt_text: str, prompt_ids: list[int]) -> dict:
        """``check-logprobs --full``'s JSON document: the local model, the engine (``source``), the prompt, a row per
        position, the speculative server's drift (null without one), the summary."""
        return {"command": "check-logprobs", "model": lm.name, "device": str(lm.device),
                "dtype": str(lm.dtype).replace("torch.", ""), "source": source, "full": True,
                "prompt": {"text": prompt_text, "token_ids": prompt_ids},
                "positions": [r.to_dict() for r in self.positions], "speculative": self.speculative,
                "summary": self.full_summary()}


def tv_bounds(listed: list[tuple[int, float]], local: torch.Tensor) -> tuple[float, float]:
    """(lower, upper) of TV(P, Q) from P's listed (id, log p) and Q = exp(local) [V]."""
    ids = [t for t, _ in listed]
    p = torch.tensor([v for _, v in listed], dtype=torch.float64).exp()
    q = local.double()[ids].exp()
    head = float((p - q).abs().sum())
    tail_p, tail_q = max(0.0, 1 - float(p.sum())), max(0.0, 1 - float(q.sum()))
    return 0.5 * (head + abs(tail_p - tail_q)), 0.5 * (head + tail_p + tail_q)


def compare_position(index: int, token_id: int, listed: list[tuple[int, float]], local: torch.Tensor,
                     token_logprob: float, k: int) -> FullPosition:
    """One position: the engine's listed (id, log p), sorted highest first, against the local log-distribution."""
    lo, hi, tail = truncated_kl(listed, local)
    tv_lo, tv_hi = tv_bounds(listed, local)
    kk = min(k, len(listed))
    engine_top = {t for t, _ in listed[:kk]}
    local_top = set(local.topk(kk).indices.tolist())
    ids = [t for t, _ in listed]
    drift = float(torch.logsumexp(torch.tensor([v for _, v in listed], dtype=torch.float64), 0)
                  - torch.logsumexp(local.double()[ids], 0))
    top2 = local.double().topk(2)
    return FullPosition(index, token_id, len(listed), len(listed) < local.shape[-1] and tail > 0, lo, hi, tv_lo, tv_hi,
                        len(engine_top & local_top) / kk if kk else math.nan, drift,
                        abs(token_logprob - float(local[token_id])), listed[0][0], int(top2.indices[0]),
                        listed[0][1] - listed[1][1] if len(listed) > 1 else None,
                        float(top2.values[0] - top2.values[1]))


def full_check(engine, lm, prompt_ids: list[int], new_tokens: int, top_n: int, k: int = DEFAULT_K) -> FullReport:
    """The engine's greedy continuation of the prompt, then prompt + continuation scored by the engine (its top N)
    and here; every position from the second on compared."""
    ids = list(prompt_ids)
    if new_tokens > 0:
        g = engine.generate(ids, neutral_request(max_tokens=new_tokens, temperature=0.0, logprobs=1,
                                                 ignore_eos=True))
        ids += list(g.token_ids)
    scored = engine.score(ids, top_n)
    logits = forced_logits(lm.model, ids[:1], ids[1:])
    local = torch.log_softmax(logits.double(), dim=-1)
    rows = []
    for i, pos in enumerate(scored.positions[1:]):
        listed = [(a.token_id, a.logprob) for a in pos.top]
        if pos.token_id not in {t for t, _ in listed}:
            listed.append((pos.token_id, pos.logprob))
        listed.sort(key=lambda x: -x[1])
        rows.append(compare_position(i + 1, pos.token_id, listed, local[i], pos.logprob, k))
    return FullReport(rows, summarize(rows, top_n, len(prompt_ids), lm.vocab_size))


def summarize(rows: list[FullPosition], top_n: int, prompt_len: int, vocab: int) -> dict:
    def mean(key):
        values = [getattr(r, key) for r in rows if getattr(r, key) is not None and math.isfinite(getattr(r, key))]
        return sum(values) / len(values) if values else None

    def most(key):
        values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        return max(values) if values else None

    flips = [r for r in rows if r.engine_argmax != r.local_argmax]
    return {"positions": len(rows), "prompt_tokens": prompt_len, "top_n": top_n, "vocab": vocab,
            "truncated": any(r.truncated for r in rows),
            "kl_lower_mean": mean("kl_lower"), "kl_upper_mean": mean("kl_upper"), "kl_upper_max": most("kl_upper"),
            "tv_lower_mean": mean("tv_lower"), "tv_upper_mean": mean("tv_upper"), "tv_upper_max": most("tv_upper"),
            "topk_overlap_mean": mean("topk_overlap"), "lse_drift_max": most("lse_drift"),
            "lse_drift_min": min((r.lse_drift for r in rows), default=None),
            "max_abs_delta_logprob": most("abs_delta_logprob"), "mean_abs_delta_logprob": mean("abs_delta_logprob"),
            "argmax_flips": [{"position": r.position, "engine": r.engine_argmax, "local": r.local_argmax,
                              "local_margin": r.local_margin, "engine_margin": r.engine_margin} for r in flips]}


# ---------------------------------------------------------------------------------------------------------------
# the defect checks


def reasoning_split(choice: dict, lp: dict) -> str | None:
    """A chat answer of a reasoning model: ``logprobs.content`` must cover ``message.content`` alone. When its
    tokens spell the reasoning (``message.reasoning_content`` / ``reasoning``) as well, the logprobs span the
    reasoning while the answer does not (sglang#25055, olmo-eval#366): one line, else None."""
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict) or not isinstance(lp.get("content"), list):
        return None
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning.strip():
        return None
    text = "".join(e.get("token") or "" for e in lp["content"] if isinstance(e, dict))
    answer = message.get("content") or ""
    if reasoning.strip() and reasoning.strip()[:32] in text:
        return (f"logprobs.content covers the reasoning ({len(lp['content'])} tokens spell {len(text)} characters; "
                f"message.content has {len(answer)}): its logprobs are not the answer's")
    return None


def speculative_drift(base, spec, prompt_ids: list[int], new_tokens: int, top_n: int,
                      tolerance: float) -> dict:
    """The same greedy request to two servers of one model, the second with speculative decoding on: the tokens must
    be the same and every listed logprob the same within ``tolerance`` (speculation must not change the law)."""
    request = neutral_request(max_tokens=new_tokens, temperature=0.0, logprobs=top_n, ignore_eos=True)
    a, b = base.generate(prompt_ids, request), spec.generate(prompt_ids, request)
    same = a.token_ids == b.token_ids
    first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    worst, where = 0.0, None
    for i, (pa, pb) in enumerate(zip(a.steps, b.steps)):
        if first is not None and i > first:
            break
        va, vb = {t.token_id: t.logprob for t in pa.top}, {t.token_id: t.logprob for t in pb.top}
        va[pa.token_id], vb[pb.token_id] = pa.logprob, pb.logprob
        for t in va.keys() & vb.keys():
            if math.isfinite(va[t]) and math.isfinite(vb[t]) and abs(va[t] - vb[t]) > worst:
                worst, where = abs(va[t] - vb[t]), i
    defect = None
    if not same:
        defect = f"greedy tokens differ with speculative decoding on, from step {first}"
    elif worst > tolerance:
        defect = f"logprobs change with speculative decoding on: up to {worst:.4g} nats at step {where}"
    return {"same_tokens": same, "first_divergence": first, "max_abs_delta_logprob": worst, "at_step": where,
            "tolerance": tolerance, "defect": defect}
