"""The chain's settings (``ChainSettings``): one field per stage parameter, None = off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainSettings:
    """The processor chain; None switches a stage off. temperature 0 means greedy."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    softcap: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram: int | None = None
    logit_bias: tuple[tuple[str, float], ...] = ()
    chain: tuple[str, ...] | None = None
    cache: str = "full"  # the KV-cache policy, `NAME[:key=value,...]` (every command that runs a model)
    # the stages of core/samplers.py (None / empty = off)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_last_n: int | None = None  # the penalties count only the last N tokens (None: all)
    dry_multiplier: float | None = None
    dry_base: float | None = None  # default 1.75 when DRY is on
    dry_allowed_length: int | None = None  # default 2
    dry_penalty_last_n: int | None = None  # default: the whole sequence
    dry_breaker: tuple[str, ...] = ()  # default (with a tokenizer): llama.cpp's "\n", ":", "\"", "*"
    xtc_threshold: float | None = None  # default 0.1 when XTC is on
    xtc_probability: float | None = None  # XTC is on when set
    top_n_sigma: float | None = None
    mirostat_tau: float | None = None  # mirostat v2 is on when tau or eta is set; default tau 5
    mirostat_eta: float | None = None  # default 0.1
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None  # default 1
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    min_new_tokens: int | None = None
    sequence_bias: tuple[tuple[str, float], ...] = ()  # TEXT=BIAS, TEXT any number of tokens
    ban: tuple[str, ...] = ()  # multi-token bans
    allow: tuple[str, ...] = ()  # the only tokens allowed
    semantics: str | None = None  # hf | vllm | llamacpp: read the settings as that engine does

    def stage_values(self, bias_ids: dict[int, float] | None, resolved: dict | None = None) -> dict:
        """Stage name -> constructor argument, the shape build_chain takes. ``resolved`` holds the token ids of the
        text-valued settings ("sequence-bias", "ban", "allow", "dry-breakers"); without it (checking settings
        before a tokenizer exists) placeholders stand in."""
        resolved = resolved or {}
        dry = None
        if self.dry_multiplier is not None:
            dry = {"multiplier": self.dry_multiplier,
                   "base": 1.75 if self.dry_base is None else self.dry_base,
                   "allowed_length": 2 if self.dry_allowed_length is None else self.dry_allowed_length,
                   "last_n": self.dry_penalty_last_n,
                   "breakers": resolved.get("dry-breakers", ())}
        mirostat = None
        if self.mirostat_tau is not None or self.mirostat_eta is not None:
            mirostat = {"tau": 5.0 if self.mirostat_tau is None else self.mirostat_tau,
                        "eta": 0.1 if self.mirostat_eta is None else self.mirostat_eta}
        xtc = None
        if self.xtc_probability is not None:
            xtc = {"threshold": 0.1 if self.xtc_threshold is None else self.xtc_threshold,
                   "probability": self.xtc_probability}
        dynatemp = None
        if self.dynatemp_range is not None:
            dynatemp = {"temperature": 1.0 if self.temperature is None else self.temperature,
                        "range": self.dynatemp_range,
                        "exponent": 1.0 if self.dynatemp_exponent is None else self.dynatemp_exponent}

        def texts(key: str, items, placeholder):
            if not items:
                return None
            return resolved.get(key, placeholder)

        return {
            "allow": texts("allow", self.allow, (0,)),
            "softcap": self.softcap,
            "repetition-penalty": self.repetition_penalty,
            "frequency-penalty": self.frequency_penalty,
            "presence-penalty": self.presence_penalty,
            "dry": dry,
            "no-repeat-ngram": self.no_repeat_ngram,
            "bias": bias_ids or None,
            "sequence-bias": texts("sequence-bias", self.sequence_bias, (((0,), 0.0),)),
            "ban": texts("ban", self.ban, ((0,),)),
            "min-new-tokens": self.min_new_tokens,
            "temperature": self.temperature if dynatemp is None else None,
            "dynatemp": dynatemp,
            "top-n-sigma": self.top_n_sigma,
            "top-k": self.top_k,
            "top-p": self.top_p,
            "min-p": self.min_p,
            "typical-p": self.typical_p,
            "epsilon-cutoff": self.epsilon_cutoff,
            "eta-cutoff": self.eta_cutoff,
            "xtc": xtc,
            "mirostat": mirostat,
        }
