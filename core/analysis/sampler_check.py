"""`check-sampler`: does a sampler draw from the law its settings define? N draws at fixed prefixes, held against the
exact processed distribution recomputed here, and, when they do not fit, which known defect they fit instead.

**Prefixes.** The prompt, then the prompt followed by 1, 2, ... tokens of its raw greedy continuation (computed
here): K fixed prefixes, each sent as a prompt of its own (so nothing counts as generated: output-only penalties see
nothing). At each prefix the sampler under test draws one token N times: N requests seeded seed, seed+1, ... (or one
request with ``n`` = N), or N seeded one-token runs of the embedded runtime.

**The exact law** at a prefix is softmax of decodelab's own chain over the model's raw logits there, the settings read
as the tested sampler reads them (``--semantics``; vLLM's on a served engine).

**The test.** Counts c_i of each token over N draws against expected counts E_i = N p_i (Pearson):
    X^2 = sum_cells (c - E)^2 / E,   p-value = P(chi2_dof >= X^2) = Q(dof / 2, X^2 / 2)
(Q the regularised upper incomplete gamma function). Pooling rule (the chi-square approximation wants E >= 5): a
token with E_i >= 5 is its own cell; every other token of positive probability is pooled into one cell; a pooled
cell with E < 5 is merged into the smallest own cell; dof = cells - 1. A draw of a token the law gives probability 0
(outside the kept set) cannot happen under it: X^2 = inf, p = 0. The K prefixes are independent, so their X^2 and
dof add: one combined p-value, and the check fails when it is below ``alpha``, the stated false-alarm rate.
The KL of the empirical frequencies f = c / N, KL(f || p) = sum f_i log(f_i / p_i), is reported beside it; under the
exact law it is about (cells - 1) / (2 N) (2 N KL is asymptotically chi2_dof), given as ``kl_noise``.

**Naming a failure.** Each known defect is one more law at each prefix, computed with the same chain changed in one
place; the draws' log-likelihood sum_i c_i log q_i under each law is compared. A failure is named when the most
likely law is a defect's, more likely than the exact law, and the draws pass that law's own chi-square at ``alpha``.
The defects (the issue threads they come from):

* ``temperature applied twice``: softmax(z / T^2) before the filters (RL-Kernel PR #86; T = 1 cannot show it);
* ``temperature ignored``: the filters on softmax(z) (vLLM #26480: FlashInfer's sampler);
* ``truncation ignored``: softmax(z / T), no min-p / top-k / top-p;
* ``truncation before temperature``: the filters on the T = 1 distribution, then temperature on the kept set;
* ``top-p before top-k``: the two filters swapped;
* ``greedy cut-off``: the argmax of the exact law at every draw (vLLM #20459: greedy drafts at T > 0).

A defect whose law equals the exact one at every prefix (total variation < 1e-9: temperature twice at T = 1) cannot
be told apart by any number of draws: it is listed as indistinguishable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import Tensor

from ..engine.run import drain, head
from ..errors import ConfigError
from ..methods.sample import REPORT_BLOCK, SampleSettings, build_sampler
from ..methods.served import Connection, check_vocabulary, request_for
from ..sampling.replay import forced_logits
from ..sampling.chain import Chain, build_chain
from ..sampling import registry
from ..sampling.select import make_generator
from ..sampling.semantics import plan
from ..sampling.tokens import Tokens, resolve
from ..settings import as_dict

MIN_EXPECTED = 5.0  # a cell's least expected count before it is pooled
INDISTINGUISHABLE_TV = 1e-9
POOLING_RULE = (f"a token with expected count >= {MIN_EXPECTED:g} is its own cell; the others with positive "
                f"probability are pooled into one cell, merged into the smallest own cell when its expected count is "
                f"below {MIN_EXPECTED:g}; dof = cells - 1; a draw of a probability-0 token gives p = 0")
EXACT = "exact"
MAX_THREADS = 32  # seeded requests sent at once
SERVER_SEMANTICS = {"vllm": "vllm", "llamacpp": "llamacpp"}  # a server kind -> the semantics its sampler follows


# ---------------------------------------------------------------------------------------------------------------
# the laws


@dataclass
class Law:
    """One candidate law: its name, what it is, its probabilities [V] (float64) at each prefix."""

    name: str
    what: str
    probs: list[Tensor]


def prefixes_of(lm, prompt_ids: list[int], count: int) -> list[list[int]]:
    """The prompt, then the prompt with 1 .. count-1 tokens of its raw greedy continuation."""
    ids = list(prompt_ids)
    out = [list(ids)]
    for _ in range(count - 1):
        ids.append(int(forced_logits(lm.model, ids, [0])[0].argmax()))
        out.append(list(ids))
    return out


def raw_logits(lm, prefix: list[int]) -> Tensor:
    """The model's raw logits [1, V] after ``prefix`` (float32), as the runtime computes them."""
    return forced_logits(lm.model, prefix, [0])[:1]


def _chain(lm, settings: SampleSettings, values_edit: dict | None = None,
           order_edit: Callable[[list[str]], list[str]] | None = None) -> Chain:
    """The chain of ``settings`` as their semantics reads them (the one builder's steps), with stage values replaced
    by ``values_edit`` and the order passed through ``order_edit``: the exact law, or a defect's."""
    p = plan(settings)
    tokens = Tokens.of(lm)
    values = {**p.settings.stage_values(resolved=resolve(p.settings, tokens)), **(values_edit or {})}
    order = list(p.order) if order_edit is None else order_edit(list(p.order))
    values = {k: (v if k in order else None) for k, v in values.items()}
    context = p.context(make_generator(settings.seed, lm.device), tuple(lm.eos_ids), tuple(settings.stop_id), tokens)
    return build_chain(values, order, context)


def law_at(chain: Chain, prefix: list[int], logits: Tensor) -> Tensor:
    """softmax of the chain's output [V] (float64) at a prefix sent as a prompt (nothing generated yet)."""
    chain.reset(len(prefix))
    ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
    with torch.inference_mode():
        z = chain.apply(ids, logits)[0]
    return torch.softmax(z.double(), dim=-1).cpu()


def _move(order: list[str], name: str, after: list[str]) -> list[str]:
    """``name`` taken out and put right after the last of ``after`` present in the order."""
    rest = [n for n in order if n != name]
    at = max(i for i, n in enumerate(rest) if n in after) + 1
    return rest[:at] + [name] + rest[at:]


def _swap(order: list[str], a: str, b: str) -> list[str]:
    i, j = order.index(a), order.index(b)
    out = list(order)
    out[i], out[j] = b, a
    return out


def truncation_filters() -> list[str]:
    """The stages that cut the candidate set by a rule on the distribution: from the registry's rows, those that act
    only when sampling (``warper``) and neither divide the logits (``scales``) nor carry state (XTC's coin,
    mirostat's mu)."""
    return [s.name for s in registry.STAGES if s.warper and not s.scales and "state" not in s.needs]


def defect_edits(settings: SampleSettings) -> list[tuple[str, str, dict | None, Callable | None]]:
    """(name, what, values edit, order edit) of each known defect these settings could show."""
    p = plan(settings)
    order = p.order
    values = p.settings.stage_values()
    every = truncation_filters()
    filters = [n for n in order if n in every]
    scaling = registry.scaling_stage()
    top_k, top_p = registry.stage_of("top_k").name, registry.stage_of("top_p").name
    out = []
    if scaling in order:
        t = float(values[scaling])
        out.append(("temperature applied twice", f"softmax(z / T^2) = softmax(z / {t * t:.4g}) before the filters",
                    {scaling: t * t}, None))
        out.append(("temperature ignored", "the filters on softmax(z) (T = 1)", None,
                    lambda o: [n for n in o if n != scaling]))
    elif settings.temperature in (None, 1.0):  # T = 1 is no stage: the defect's law is the exact one (listed so)
        out.append(("temperature applied twice", "softmax(z / 1^2): at T = 1 the same law", None, None))
    if filters:
        out.append(("truncation ignored", f"no {', '.join(filters)}", None,
                    lambda o: [n for n in o if n not in every]))
    if filters and scaling in order and order.index(scaling) < order.index(filters[-1]):
        out.append(("truncation before temperature", f"{', '.join(filters)} on the T = 1 distribution, then "
                    "temperature on the kept set", None, lambda o: _move(o, scaling, every)))
    if top_k in order and top_p in order:
        out.append(("top-p before top-k", "the two filters swapped", None, lambda o: _swap(o, top_k, top_p)))
    return out


def laws(lm, settings: SampleSettings, prefixes: list[list[int]]) -> tuple[Law, list[Law]]:
    """The exact law and each defect's, at every prefix."""
    logits = [raw_logits(lm, prefix) for prefix in prefixes]

    def along(chain: Chain) -> list[Tensor]:
        return [law_at(chain, prefix, z) for prefix, z in zip(prefixes, logits)]

    exact = Law(EXACT, "softmax of the chain as the semantics reads it", along(_chain(lm, settings)))
    defects = [Law(name, what, along(_chain(lm, settings, v, o))) for name, what, v, o in defect_edits(settings)]
    greedy = []
    for p in exact.probs:
        point = torch.zeros_like(p)
        point[int(p.argmax())] = 1.0
        greedy.append(point)
    defects.append(Law("greedy cut-off", "the argmax of the exact law at every draw", greedy))
    return exact, defects


# ---------------------------------------------------------------------------------------------------------------
# the statistics


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int
    pooled_tokens: int  # tokens pooled (expected count below MIN_EXPECTED)
    forbidden_draws: int  # draws of a token the law gives probability 0


def p_value(statistic: float, dof: int) -> float:
    """P(chi2_dof >= statistic) = Q(dof / 2, statistic / 2); 1 with no degree of freedom, 0 for an infinite one."""
    if math.isinf(statistic):
        return 0.0
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square(counts: Tensor, probs: Tensor) -> ChiSquare:
    """Pearson's X^2 of token counts [V] against a law [V], cells pooled by :data:`POOLING_RULE`."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = float(counts.sum())
    forbidden = int(counts[probs <= 0].sum())
    expected = n * probs
    own = expected >= MIN_EXPECTED
    rest = (~own) & (probs > 0)
    obs, exp = counts[own].tolist(), expected[own].tolist()
    rest_obs, rest_exp = float(counts[rest].sum()), float(expected[rest].sum())
    if rest_exp >= MIN_EXPECTED or (rest_exp > 0 and not obs):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0:
        smallest = min(range(len(exp)), key=exp.__getitem__)
        obs[smallest] += rest_obs
        exp[smallest] += rest_exp
    dof = len(obs) - 1
    if forbidden:
        return ChiSquare(math.inf, dof, 0.0, len(obs), int(rest.sum()), forbidden)
    stat = math.fsum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return ChiSquare(stat, dof, p_value(stat, dof), len(obs), int(rest.sum()), 0)


def empirical_kl(counts: Tensor, probs: Tensor) -> float:
    """KL(f || p) in nats of the frequencies f = counts / N against the law p (inf if f puts mass where p has none)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    f = counts / counts.sum()
    seen = f > 0
    if bool((probs[seen] <= 0).any()):
        return math.inf
    return float((f[seen] * (f[seen].log() - probs[seen].log())).sum())


def log_likelihood(counts: Tensor, probs: Tensor) -> float:
    """sum_i c_i log p_i: the draws' log-probability under a law (-inf if one is impossible under it)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    seen = counts > 0
    if bool((probs[seen] <= 0).any()):
        return -math.inf
    return float((counts[seen] * probs[seen].log()).sum())


def total_variation(p: Tensor, q: Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


# ---------------------------------------------------------------------------------------------------------------
# the draws


def draw_embedded(lm, settings: SampleSettings, prefix: list[int], n: int, seed: int) -> list[int]:
    """N one-token runs of the embedded runtime (what ``sample -n 1 --seed s`` does), seeds seed .. seed+N-1."""
    out = []
    for i in range(n):
        run = build_sampler(lm, replace(settings, max_new_tokens=1, seed=seed + i, ignore_eos=True), prefix,
                            block=REPORT_BLOCK)
        drain(run)
        out.append(int(run.new_ids[0]))
    return out


def draw_engine(conn: Connection, settings: SampleSettings, prefix: list[int], n: int, seed: int,
                how: str = "seeded") -> list[int]:
    """N draws of one token from the served engine: ``seeded``, N requests seeded seed .. seed+N-1 (sent
    :data:`MAX_THREADS` at a time); ``n``, one request with n = N (vLLM), seeded with ``seed``."""
    request, _ = request_for(conn, settings, 1)
    request = replace(request, max_tokens=1, min_tokens=0, ignore_eos=True, stop=(), stop_token_ids=())
    if how == "seeded":
        def one(i: int) -> int:
            g = conn.engine.generate(prefix, replace(request, seed=seed + i))
            check_vocabulary(conn, g.steps)
            return int(g.token_ids[0])

        with ThreadPoolExecutor(max_workers=min(MAX_THREADS, n)) as pool:
            return list(pool.map(one, range(n)))
    if how != "n":
        raise ConfigError(f"--how {how!r}: allowed: seeded, n")
    return _draw_n(conn, replace(request, seed=seed), prefix, n)


def _draw_n(conn: Connection, request, prefix: list[int], n: int) -> list[int]:
    """One vLLM request with ``n`` choices (the client's generate sends n = 1): each choice read as a generation."""
    engine = conn.engine
    if engine.adapter.kind != "vllm":
        raise ConfigError(f"--how n: one request with n choices is vLLM's; the {engine.adapter.kind} server is "
                          "asked with --how seeded")
    if engine.adapter.check(request):
        raise engine.transport.fail(engine.adapter.check(request))
    body = {**engine.adapter.generate_body(engine.model, prefix, request), "n": n}
    resp = engine.transport.post(engine.adapter.path, body)
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise engine.transport.fail(f"asked for n={n} choices, answered {len(choices or [])}")
    out = []
    for choice in choices:
        ids, steps, _ = engine.adapter.read_generation(engine.transport, body, {**resp, "choices": [choice]})
        if not ids:
            raise engine.transport.fail("a choice has no token")
        check_vocabulary(conn, steps)
        out.append(int(ids[0]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the check


@dataclass
class PrefixCheck:
    """The draws at one prefix against the exact law."""

    index: int
    prefix_token_ids: list[int]
    draws: int
    support: int  # tokens of positive exact probability
    chi_square: float
    dof: int
    p_value: float
    cells: int
    pooled_tokens: int
    forbidden_draws: int  # draws of a token outside the exact law's support
    kl_empirical: float  # KL(frequencies || exact), nats
    kl_noise: float  # its size under the exact law: (cells - 1) / (2 N)
    top: list[dict]  # the most drawn tokens: id, text, count, expected
    log_likelihood: dict[str, float]  # law -> the draws' log-likelihood

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LawFit:
    name: str
    what: str
    log_likelihood: float
    chi_square: float
    dof: int
    p_value: float
    tv_max: float  # the largest total variation from the exact law over the prefixes
    distinguishable: bool


@dataclass
class SamplerCheck:
    source: str  # "embedded" or the engine's URL
    alpha: float
    draws: int  # per prefix
    how: str
    prefixes: list[PrefixCheck]
    laws: list[LawFit]  # the exact law first, then each defect
    chi_square: float
    dof: int
    p_value: float
    passed: bool
    named: str | None  # the defect the draws match, when they fail and one does
    verdict: str
    pooling_rule: str = POOLING_RULE
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("prefixes",)}

    def document(self, lm, settings: SampleSettings, prompt_text: str, prompt_ids: list[int],
                 conn: Connection | None = None) -> dict:
        """``check-sampler``'s JSON document: the head with the settings as the check read them (a server's own
        semantics with ``conn``) and their chain, where the draws came from, a row per prefix, the summary."""
        read = replace(settings, semantics=SERVER_SEMANTICS.get(conn.kind, settings.semantics)) if conn is not None \
            else settings
        return head("check-sampler", lm, as_dict(read), plan(read).order, prompt_text, prompt_ids,
                    source={"engine": conn.describe()} if conn is not None else {"embedded": True},
                    prefixes=[p.to_dict() for p in self.prefixes], summary=self.summary())


def check_draws(lm, draws: list[list[int]], exact: Law, defects: list[Law], prefixes: list[list[int]],
                alpha: float, source: str, how: str) -> SamplerCheck:
    """The draws at each prefix against the exact law (combined chi-square) and, when they fail, each defect."""
    vocab = exact.probs[0].shape[-1]
    counts = [torch.bincount(torch.tensor(d, dtype=torch.long), minlength=vocab) for d in draws]
    rows = []
    every = [exact] + defects
    for i, (prefix, c) in enumerate(zip(prefixes, counts)):
        p = exact.probs[i]
        x = chi_square(c, p)
        n = int(c.sum())
        top = [{"token_id": t, "token": lm.token_text(t), "count": int(c[t]), "expected": n * float(p[t])}
               for t in c.argsort(descending=True)[:5].tolist() if c[t] > 0]
        rows.append(PrefixCheck(i, list(prefix), n, int((p > 0).sum()), x.statistic, x.dof, x.p_value, x.cells,
                                x.pooled_tokens, x.forbidden_draws, empirical_kl(c, p), (x.cells - 1) / (2 * n),
                                top, {law.name: log_likelihood(c, law.probs[i]) for law in every}))
    fits = []
    for law in every:
        tests = [chi_square(c, q) for c, q in zip(counts, law.probs)]
        stat = math.fsum(t.statistic for t in tests)
        dof = sum(t.dof for t in tests)
        tv = max(total_variation(q, p) for q, p in zip(law.probs, exact.probs))
        fits.append(LawFit(law.name, law.what, math.fsum(r.log_likelihood[law.name] for r in rows), stat, dof,
                           p_value(stat, dof), tv, law is exact or tv > INDISTINGUISHABLE_TV))
    first = fits[0]
    passed = first.p_value >= alpha
    named, verdict = name_failure(fits, alpha, passed)
    notes = [f"{f.name}: the same law as the exact one under these settings (total variation {f.tv_max:.2g}): "
             "no number of draws can tell them apart" for f in fits[1:] if not f.distinguishable]
    return SamplerCheck(source, alpha, rows[0].draws if rows else 0, how, rows, fits, first.chi_square, first.dof,
                        first.p_value, passed, named, verdict, notes=notes)


def name_failure(fits: list[LawFit], alpha: float, passed: bool) -> tuple[str | None, str]:
    """(the defect named or None, one sentence)."""
    exact = fits[0]
    if passed:
        return None, (f"passed: the draws fit the exact law (chi-square {exact.chi_square:.4g} on {exact.dof} dof, "
                      f"p = {exact.p_value:.3g} >= alpha {alpha:g})")
    candidates = [f for f in fits[1:] if f.distinguishable]
    best = max(candidates, key=lambda f: f.log_likelihood, default=None)
    head = f"failed: the draws do not fit the exact law (p = {exact.p_value:.3g} < alpha {alpha:g})"
    if best is None or not best.log_likelihood > exact.log_likelihood:
        return None, head + "; no known defect explains them better"
    if best.p_value >= alpha:
        return best.name, head + (f"; they match '{best.name}' ({best.what}: p = {best.p_value:.3g}, "
                                  f"log-likelihood {best.log_likelihood:.1f} against {exact.log_likelihood:.1f})")
    return None, head + (f"; closest to '{best.name}' (log-likelihood {best.log_likelihood:.1f} against "
                         f"{exact.log_likelihood:.1f}), which does not fit either (p = {best.p_value:.3g})")


def require_sampled(settings: SampleSettings) -> None:
    """Refuse a greedy plan: an arg-max has no law to draw from. Greedy or not is the plan's decision (its selector),
    so ``-t 0 --dynatemp-range 0.5 --semantics llamacpp``, which llama.cpp samples, is checked."""
    if plan(settings).greedy:
        raise ConfigError(f"--temperature {settings.temperature:g}: this plan is greedy "
                          f"({settings.semantics or 'decodelab'} semantics), which has no law to sample; check-sampler "
                          "tests a sampled law (compare checks greedy parity)")


def check_sampler(lm, settings: SampleSettings, prompt_ids: list[int], prefixes: int, draws: int, alpha: float,
                  conn: Connection | None = None, how: str = "seeded",
                  on_prefix: Callable[[int], None] | None = None) -> SamplerCheck:
    """The whole check: prefixes, laws, draws (the engine's, or the embedded runtime's), the statistics."""
    require_sampled(settings)
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha {alpha}: the false-alarm rate must be in (0, 1)")
    if draws < 1 or prefixes < 1:
        raise ConfigError("-N and --prefixes must be >= 1")
    if conn is not None:  # the exact law as the server reads the settings (vLLM's reading; llama.cpp's own)
        settings = replace(settings, semantics=SERVER_SEMANTICS.get(conn.kind, settings.semantics))
        require_sampled(settings)
    fixed = prefixes_of(lm, prompt_ids, prefixes)
    exact, defects = laws(lm, settings, fixed)
    out = []
    for i, prefix in enumerate(fixed):
        seed = settings.seed + i * draws
        out.append(draw_engine(conn, settings, prefix, draws, seed, how) if conn is not None
                   else draw_embedded(lm, settings, prefix, draws, seed))
        if on_prefix is not None:
            on_prefix(i)
    source = conn.engine.url if conn is not None else "embedded"
    return check_draws(lm, out, exact, defects, fixed, alpha, source, how if conn is not None else "seeded")

