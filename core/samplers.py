"""More stages: penalties that count tokens (in a window), DRY, XTC, top-n-sigma, mirostat v2, dynamic temperature,
epsilon and eta sampling, minimum new tokens, sequence bias and multi-token bans, an allow-list.

Every stage has the processor shape of :mod:`decodelab.core.processors` (``(ids, logits) -> logits``, pure, removal =
-inf) and validates its own parameters, naming the option. What some need besides ``ids`` is handed in explicitly:

* the prompt length, by ``reset(prompt_len)`` before a run (``Chain.reset``): stages that count only generated tokens
  (``scope="output"``) and minimum new tokens;
* the run's ``torch.Generator``, when the chain is built (XTC's coin), so a seed reproduces the run;
* the selected token, by ``accept(token)`` after each step (``Chain.accept``): mirostat's running target mu.

``state()`` returns a stage's per-step numbers (mirostat's mu, XTC's coin, the dynamic temperature) as [B] tensors
for the trace; the values are those the stage used at this step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import ChainError, ConfigError
from .processors import NEG_INF, RepetitionPenalty, entropy, log_softmax, softmax

SCOPES = ("all", "output")


def _bad(option: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{option} {value}: {allowed}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# --- which earlier tokens a penalty counts ---------------------------------------------------------------------


@dataclass
class Counted:
    """The tokens a penalty looks at: prompt and output (``scope="all"``) or the generated tokens only
    (``"output"``), and of those only the last ``last_n`` (llama.cpp's ``penalty_last_n``; None = all)."""

    scope: str = "all"
    last_n: int | None = None
    prompt_len: int | None = field(default=None, repr=False)
    reads_ids = True  # each position needs its own prefix (Chain.uses_ids)

    def check_counted(self, option: str) -> None:
        if self.scope not in SCOPES:
            raise _bad(option + " scope", self.scope, f"allowed: {', '.join(SCOPES)}")
        if self.last_n is not None and (not isinstance(self.last_n, int) or self.last_n < 0):
            raise _bad("--penalty-last-n", self.last_n, "must be an integer >= 0 (0 switches the penalties off)")

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def counted(self, ids: Tensor) -> Tensor:
        """[B, n]: the counted ids, oldest first."""
        start = 0
        if self.scope == "output":
            if self.prompt_len is None:
                raise ChainError(f"{self.name}: counts generated tokens only, but the run never said where the "
                                 "prompt ends (Chain.reset(prompt_len))")
            start = self.prompt_len
        if self.last_n is not None:
            start = max(start, ids.shape[1] - self.last_n)
        return ids[:, min(start, ids.shape[1]):]

    def counts(self, ids: Tensor, logits: Tensor) -> Tensor:
        """[B, V] float: how often each token occurs among the counted ids."""
        seen = self.counted(ids)
        out = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        return out.scatter_add_(1, seen, torch.ones(seen.shape, dtype=logits.dtype, device=logits.device))


@dataclass
class WindowedRepetitionPenalty(Counted):
    """The CTRL repetition penalty (z / theta if z > 0, else z * theta) on the counted tokens only (a window, or
    the output only), as llama.cpp's ``penalties`` sampler does with ``penalty_last_n``."""

    penalty: float = 1.0
    name: str = "repetition-penalty"

    def __post_init__(self):
        if not (_finite(self.penalty) and self.penalty > 0):
            raise _bad("--repetition-penalty", self.penalty, "must be > 0 (1 = off)")
        self.check_counted("--repetition-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        seen = self.counted(ids)
        if seen.shape[1] == 0:
            return logits.clone()
        return RepetitionPenalty(self.penalty)(seen, logits)


@dataclass
class FrequencyPenalty(Counted):
    """z_t -= alpha * count(t) among the counted tokens (OpenAI's definition; vLLM counts the output only)."""

    value: float = 0.0
    name: str = "frequency-penalty"

    def __post_init__(self):
        if not _finite(self.value):
            raise _bad("--frequency-penalty", self.value, "must be a finite number")
        self.check_counted("--frequency-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        return logits - self.value * self.counts(ids, logits)


@dataclass
class PresencePenalty(Counted):
    """z_t -= alpha if t occurs among the counted tokens (once is enough)."""

    value: float = 0.0
    name: str = "presence-penalty"

    def __post_init__(self):
        if not _finite(self.value):
            raise _bad("--presence-penalty", self.value, "must be a finite number")
        self.check_counted("--presence-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        return logits - self.value * (self.counts(ids, logits) > 0).to(logits.dtype)


# --- DRY ---------------------------------------------------------------------------------------------------------


def z_function(seq: list[int]) -> list[int]:
    """z[k] = the length of the longest common prefix of seq and seq[k:] (z[0] = len(seq)); linear time."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0  # [left, right) is the rightmost window known to match a prefix
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and seq[z[k]] == seq[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


@dataclass
class DRY:
    """DRY ("don't repeat yourself", p-e-w 2024; llama.cpp ``src/llama-sampler.cpp`` ``llama_sampler_dry_apply``).

    In the last ``last_n`` tokens h_0..h_{N-1}, for every earlier position j let n_j be the length of the longest
    common suffix of h_0..h_j and the whole window (capped at the number of tokens after the most recent sequence
    breaker). Emitting h_{j+1} would extend that repeat, so for n = max n_j over its occurrences, if
    n >= allowed_length:  z_{h_{j+1}} -= multiplier * base ** (n - allowed_length)  (exponent capped so the power
    stays finite in float32). A token that is itself a one-token breaker is never penalized. ``breakers`` are token
    id sequences (head first). Nothing happens while N <= allowed_length. Reads the window's ids on the host.
    """

    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    breakers: tuple[tuple[int, ...], ...] = ()
    last_n: int | None = None  # None: the whole sequence (llama.cpp's -1, the context size)
    name: str = "dry"
    reads_ids = True

    def __post_init__(self):
        if not (_finite(self.multiplier) and self.multiplier > 0):
            raise _bad("--dry-multiplier", self.multiplier, "must be > 0 (0 = off)")
        if not (_finite(self.base) and self.base >= 1):
            raise _bad("--dry-base", self.base, "must be >= 1")
        if not isinstance(self.allowed_length, int) or self.allowed_length < 0:
            raise _bad("--dry-allowed-length", self.allowed_length, "must be an integer >= 0")
        if self.last_n is not None and (not isinstance(self.last_n, int) or self.last_n < 1):
            raise _bad("--dry-penalty-last-n", self.last_n, "must be an integer >= 1 (or unset for all tokens)")
        self.breakers = tuple(tuple(int(t) for t in b) for b in self.breakers if len(b) > 0)
        self._single = {b[0] for b in self.breakers if len(b) == 1}
        # llama.cpp: max_exponent = FLOAT_MAX_LOG / log(base), FLOAT_MAX_LOG = log(FLT_MAX) = 88.7228391
        self._max_exp = int(88.7228391 / math.log(self.base)) if self.base > 1.000001 else 0

    def repeat_limit(self, h: list[int]) -> int:
        """Tokens after the end of the most recent breaker in the window (its whole length if none)."""
        n = len(h)
        for i in range(n):  # i tokens after the head candidate h[n-1-i]
            head = n - 1 - i
            longest = -1
            for b in self.breakers:
                tail = len(b) - 1
                if b[0] == h[head] and longest < tail <= i and tuple(h[head + 1 : head + 1 + tail]) == b[1:]:
                    longest = tail
            if longest >= 0:
                return i - longest
        return n

    def penalties(self, h: list[int]) -> dict[int, float]:
        """token -> amount subtracted from its logit, for one row's window h."""
        n = len(h)
        if n <= self.allowed_length:
            return {}
        limit = self.repeat_limit(h)
        if limit < self.allowed_length:
            return {}
        # the longest common suffix of h[:j+1] and h is z[n-1-j] of the reversed window
        z = z_function(h[::-1])
        longest: dict[int, int] = {}
        for j in range(n - 1):
            m = min(z[n - 1 - j], limit)
            if m >= self.allowed_length:
                t = h[j + 1]
                longest[t] = max(longest.get(t, 0), m)
        out = {}
        for t, m in longest.items():
            if t in self._single:
                continue
            exp = m - self.allowed_length
            if self._max_exp > 0:
                exp = min(exp, self._max_exp)
            out[t] = self.multiplier * self.base ** exp
        return out

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        window = ids if self.last_n is None else ids[:, -self.last_n :]
        out = logits.clone()
        for row, h in enumerate(window.tolist()):
            pen = self.penalties(h)
            if pen:
                tokens = torch.tensor(list(pen), device=logits.device)
                out[row, tokens] -= torch.tensor(list(pen.values()), dtype=logits.dtype, device=logits.device)
        return out


# --- truncation by the shape of the distribution ---------------------------------------------------------------


@dataclass
class XTC:
    """Exclude Top Choices (llama.cpp ``llama_sample_xtc_apply``): with probability ``probability`` (a coin from
    the run's generator, one per row and step), remove every token with p >= threshold except the least likely of
    them; nothing happens when fewer than two tokens reach the threshold. Ties are ordered by token id."""

    threshold: float
    probability: float
    generator: torch.Generator | None = None
    name: str = "xtc"

    def __post_init__(self):
        if not (_finite(self.threshold) and 0 <= self.threshold <= 1):
            raise _bad("--xtc-threshold", self.threshold, "must be in [0, 1] (above 0.5 it never acts)")
        if not (_finite(self.probability) and 0 <= self.probability <= 1):
            raise _bad("--xtc-probability", self.probability, "must be in [0, 1]")
        self._coin: Tensor | None = None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.generator is None:
            raise ChainError("xtc: built without the run's generator (its coin must come from the run's seed)")
        coin = torch.rand(logits.shape[0], generator=self.generator, device=self.generator.device)
        self._coin = coin.to(logits.device)
        probs = softmax(logits)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        reach = (sorted_p >= self.threshold).sum(dim=-1, keepdim=True)  # c tokens reach the threshold
        rank = torch.arange(logits.shape[-1], device=logits.device)
        act = (self._coin <= self.probability).unsqueeze(-1)  # llama.cpp: skip when chance > probability
        remove_sorted = (rank < reach - 1) & act  # the c - 1 most likely go, the c-th stays
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        return logits.masked_fill(remove, NEG_INF)

    def state(self) -> dict[str, Tensor]:
        return {"coin": self._coin} if self._coin is not None else {}


@dataclass
class TopNSigma:
    """Top-n-sigma (Tang et al. 2024): keep z_i >= max z - n * sigma, sigma the population standard deviation of
    the finite logits (llama.cpp ``llama_sampler_top_n_sigma_apply``). Temperature scales max z - z_i and sigma
    alike, so what it keeps does not depend on the temperature."""

    n: float
    name: str = "top-n-sigma"

    def __post_init__(self):
        if not (_finite(self.n) and self.n > 0):
            raise _bad("--top-n-sigma", self.n, "must be > 0")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        finite = torch.isfinite(logits)
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
        z = torch.where(finite, logits, 0.0)
        mean = z.sum(dim=-1, keepdim=True) / count
        var = torch.where(finite, (logits - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
        top = logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(logits < top - self.n * var.sqrt(), NEG_INF)


@dataclass
class EpsilonCutoff:
    """Epsilon sampling (Hewitt et al. 2022): remove tokens with p < epsilon, the most likely token always stays
    (transformers' ``EpsilonLogitsWarper`` with min_tokens_to_keep=1)."""

    epsilon: float
    name: str = "epsilon-cutoff"

    def __post_init__(self):
        if not (_finite(self.epsilon) and 0 < self.epsilon < 1):
            raise _bad("--epsilon-cutoff", self.epsilon, "must be in (0, 1)")

    def cutoff(self, logits: Tensor, probs: Tensor) -> Tensor | float:
        return self.epsilon

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        probs = softmax(logits)
        low = probs < self.cutoff(logits, probs)
        top = logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(low & (logits < top), NEG_INF)


@dataclass
class EtaCutoff(EpsilonCutoff):
    """Eta sampling (Hewitt et al. 2022): remove tokens with p < eta = min(epsilon, sqrt(epsilon) * exp(-H)), H the
    entropy of the distribution (transformers' ``EtaLogitsWarper``); the most likely token always stays."""

    name: str = "eta-cutoff"

    def __post_init__(self):
        if not (_finite(self.epsilon) and 0 < self.epsilon < 1):
            raise _bad("--eta-cutoff", self.epsilon, "must be in (0, 1)")

    def cutoff(self, logits: Tensor, probs: Tensor) -> Tensor:
        h = entropy(probs).unsqueeze(-1)
        eps = torch.tensor(self.epsilon, dtype=probs.dtype, device=probs.device)
        return torch.minimum(eps, eps.sqrt() * torch.exp(-h))


# --- temperature that follows the entropy --------------------------------------------------------------------


@dataclass
class DynamicTemperature:
    """Dynamic temperature (llama.cpp ``llama_sampler_temp_ext_apply``): with K candidates and entropy H,
    T = T_min + (T_max - T_min) * (H / log K) ** exponent, T_min = max(0, t - range), T_max = t + range; then
    z -> z / T (T <= 0: only the arg-max stays). With one candidate nothing changes."""

    temperature: float
    range: float
    exponent: float = 1.0
    name: str = "dynatemp"

    def __post_init__(self):
        if not (_finite(self.temperature) and self.temperature >= 0):
            raise _bad("--temperature", self.temperature, "must be >= 0")
        if not (_finite(self.range) and self.range > 0):
            raise _bad("--dynatemp-range", self.range, "must be > 0 (0 = plain temperature)")
        if not (_finite(self.exponent) and self.exponent > 0):
            raise _bad("--dynatemp-exponent", self.exponent, "must be > 0")
        self._t: Tensor | None = None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        lo, hi = max(0.0, self.temperature - self.range), self.temperature + self.range
        k = torch.isfinite(logits).sum(dim=-1, keepdim=True).float()
        h = entropy(softmax(logits)).unsqueeze(-1)
        norm = torch.where(k > 1, h / k.clamp(min=2).log(), 0.0)
        t = lo + (hi - lo) * norm.clamp(min=0) ** self.exponent
        self._t = torch.where(k > 1, t, 1.0).squeeze(-1)
        greedy = (t <= 0) & (k > 1)
        best = logits.argmax(dim=-1, keepdim=True)
        point = torch.full_like(logits, NEG_INF).scatter(1, best, logits.gather(1, best))
        scaled = torch.where(k > 1, logits / torch.where(t > 0, t, 1.0), logits)
        return torch.where(greedy, point, scaled)

    def state(self) -> dict[str, Tensor]:
        return {"temperature": self._t} if self._t is not None else {}


# --- mirostat v2 -------------------------------------------------------------------------------------------------


@dataclass
class MirostatV2:
    """Mirostat 2.0 (Basu et al. 2021; llama.cpp ``llama_sampler_mirostat_v2_apply``): keep the tokens whose
    surprise -log2 p is at most mu (at least the most likely one); after the selector draws token x from what is
    kept (renormalized), mu <- mu - eta * (-log2 p_kept(x) - tau). mu starts at 2 tau; one mu per row."""

    tau: float = 5.0
    eta: float = 0.1
    name: str = "mirostat"

    def __post_init__(self):
        if not (_finite(self.tau) and self.tau > 0):
            raise _bad("--mirostat-tau", self.tau, "must be > 0 (the target surprise in bits)")
        if not (_finite(self.eta) and self.eta > 0):
            raise _bad("--mirostat-eta", self.eta, "must be > 0 (the learning rate)")
        self.mu: Tensor | None = None
        self._kept_logp: Tensor | None = None

    def reset(self, prompt_len: int = 0) -> None:
        self.mu, self._kept_logp = None, None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.mu is None or self.mu.shape[0] != logits.shape[0]:
            self.mu = torch.full((logits.shape[0],), 2.0 * self.tau, device=logits.device)
        surprise = -log_softmax(logits) / math.log(2.0)
        best = logits.argmax(dim=-1, keepdim=True)
        keep = (surprise <= self.mu.unsqueeze(-1)).scatter(1, best, True)
        out = logits.masked_fill(~keep, NEG_INF)
        self._kept_logp = log_softmax(out)
        return out

    def accept(self, token: Tensor) -> None:
        """Update mu from the selected token [B] (on the device; no host read). A new tensor, never in place, so
        a trace that captured this step's mu keeps it."""
        if self._kept_logp is None:
            return
        observed = -self._kept_logp.gather(1, token.reshape(-1, 1)).squeeze(-1) / math.log(2.0)
        self.mu = self.mu - self.eta * (observed - self.tau)

    def state(self) -> dict[str, Tensor]:
        return {"mu": self.mu} if self.mu is not None else {}


# --- constraints ----------------------------------------------------------------------------------------------


@dataclass
class MinNewTokens:
    """Ban the end ids (EOS, and stop ids where the engine does) while fewer than n tokens were generated
    (transformers' ``MinNewTokensLengthLogitsProcessor``; vLLM's ``min_tokens``)."""

    n: int
    end_ids: tuple[int, ...] = ()
    name: str = "min-new-tokens"
    prompt_len: int | None = field(default=None, repr=False)
    reads_ids = True

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 0:
            raise _bad("--min-new-tokens", self.n, "must be an integer >= 0")

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.prompt_len is None:
            raise ChainError("min-new-tokens: the run never said where the prompt ends (Chain.reset(prompt_len))")
        out = logits.clone()
        if ids.shape[1] - self.prompt_len < self.n and self.end_ids:
            out[:, list(self.end_ids)] = NEG_INF
        return out


@dataclass
class SequenceBias:
    """For each (sequence, bias): add bias to the logit of the sequence's last token when the ids end with the
    rest of it (a one-token sequence always); biases of several sequences add up (transformers'
    ``SequenceBiasLogitsProcessor``; with -inf, ``NoBadWordsLogitsProcessor``)."""

    biases: tuple[tuple[tuple[int, ...], float], ...]
    name: str = "sequence-bias"
    reads_ids = True

    def __post_init__(self):
        cleaned = []
        for seq, bias in self.biases:
            seq = tuple(int(t) for t in seq)
            if not seq:
                raise _bad("--" + self.name, "''", "a sequence needs at least one token")
            if math.isnan(bias):
                raise _bad("--" + self.name, bias, "the bias must be a number or -inf")
            cleaned.append((seq, float(bias)))
        self.biases = tuple(cleaned)

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        out = logits.clone()
        for seq, bias in self.biases:
            last, prefix = seq[-1], seq[:-1]
            if not prefix:
                out[:, last] += bias
                continue
            if ids.shape[1] < len(prefix):
                continue
            want = torch.tensor(prefix, dtype=ids.dtype, device=ids.device)
            match = (ids[:, -len(prefix) :] == want).all(dim=-1)
            out[:, last] = torch.where(match, out[:, last] + bias, out[:, last])
        return out


@dataclass
class Ban(SequenceBias):
    """Multi-token bans: the last token of a banned sequence is removed when the ids end with the rest of it."""

    biases: tuple = ()
    sequences: tuple[tuple[int, ...], ...] = ()
    name: str = "ban"

    def __post_init__(self):
        self.biases = tuple((seq, NEG_INF) for seq in self.sequences)
        super().__post_init__()


@dataclass
class AllowList:
    """Only the listed token ids stay candidates (vLLM's ``allowed_token_ids``)."""

    token_ids: tuple[int, ...]
    name: str = "allow"

    def __post_init__(self):
        self.token_ids = tuple(sorted({int(t) for t in self.token_ids}))
        if not self.token_ids:
            raise _bad("--allow", "''", "give at least one token")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.token_ids[-1] >= logits.shape[-1] or self.token_ids[0] < 0:
            raise ConfigError(f"--allow {self.token_ids[-1]}: token id out of range [0, {logits.shape[-1]})")
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[list(self.token_ids)] = True
        return logits.masked_fill(~keep, NEG_INF)


# --- building the stages ---------------------------------------------------------------------------------------


@dataclass
class StageContext:
    """What the stages need besides their value, handed in when the chain is built."""

    generator: torch.Generator | None = None  # the run's generator (the selector's): XTC's coin
    end_ids: tuple[int, ...] = ()  # what min-new-tokens bans: EOS (and stop ids where the engine does)
    counting: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # penalty -> (scope, last_n)

    def scope_of(self, name: str) -> dict:
        scope, last_n = self.counting.get(name, ("all", None))
        return {"scope": scope, "last_n": last_n}

    def counts_differently(self, name: str) -> bool:
        return self.counting.get(name, ("all", None)) != ("all", None)

    def windowed_repetition(self, penalty: float) -> WindowedRepetitionPenalty:
        return WindowedRepetitionPenalty(penalty=penalty, **self.scope_of("repetition-penalty"))


# stage name -> factory(value, context); multi-parameter stages take a dict of their fields
NEW_FACTORIES = {
    "allow": lambda v, c: AllowList(tuple(v)),
    "frequency-penalty": lambda v, c: FrequencyPenalty(value=v, **c.scope_of("frequency-penalty")),
    "presence-penalty": lambda v, c: PresencePenalty(value=v, **c.scope_of("presence-penalty")),
    "dry": lambda v, c: DRY(**v),
    "sequence-bias": lambda v, c: SequenceBias(tuple(v)),
    "ban": lambda v, c: Ban(sequences=tuple(v)),
    "min-new-tokens": lambda v, c: MinNewTokens(v, tuple(c.end_ids)),
    "dynatemp": lambda v, c: DynamicTemperature(**v),
    "top-n-sigma": lambda v, c: TopNSigma(v),
    "epsilon-cutoff": lambda v, c: EpsilonCutoff(v),
    "eta-cutoff": lambda v, c: EtaCutoff(v),
    "xtc": lambda v, c: XTC(v["threshold"], v["probability"], c.generator),
    "mirostat": lambda v, c: MirostatV2(**v),
}
