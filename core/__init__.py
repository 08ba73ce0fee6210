"""decodelab's core: the decoding engine a script uses without the CLI.

    from decodelab.core import load_model, settings_for, build_sampler

    lm = load_model("tiny")
    settings = settings_for("sample", options={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16})
    run = build_sampler(lm, settings, lm.encode("Once upon a time"))
    for step in run:
        print(step.token, step.prob, step.raw_prob)
    print(run.summary())

The names below are the public API; each is loaded from its module when first used, so importing a light module
(``decodelab.core.errors``, the stage registry) does not import torch.
"""

from __future__ import annotations

from importlib import import_module

_API = {
    # models and the runtime
    "load_model": "engine.models", "LoadedModel": "engine.models", "Runtime": "engine.runtime",
    "StopRules": "engine.stopping",
    # settings and their checks
    "settings_for": "methods.registry", "METHODS": "methods.registry", "resolve": "settings",
    "ChainSettings": "sampling.settings", "SampleSettings": "methods.sample", "ProbsSettings": "methods.probs",
    "ScoreSettings": "methods.score", "BeamSettings": "methods.beam", "SpeculateSettings": "methods.speculative.run",
    "StreamSettings": "methods.stream", "BatchSettings": "methods.batch.run",
    # the chain
    "STAGES": "sampling.registry", "DEFAULT_ORDER": "sampling.registry", "chain_for": "sampling.chain",
    "make_chain": "sampling.chain", "build_chain": "sampling.chain", "Chain": "sampling.chain",
    "Tokens": "sampling.tokens", "plan": "sampling.semantics", "export": "sampling.export",
    "constraint_spec": "sampling.constraint", "ConstraintStage": "sampling.constraint",
    "choice_probabilities": "sampling.constraint",
    # the methods
    "build_sampler": "methods.sample", "build_probs": "methods.probs", "dist_stages": "methods.probs",
    "build_scorer": "methods.score", "build_beam": "methods.beam", "build_speculator": "methods.speculative.run",
    "score_choices": "methods.choice",
    "Run": "engine.run", "Origin": "engine.run", "drain": "engine.run", "Method": "methods.registry",
    "Outcome": "methods.registry",
    # KV-cache policies
    "parse_cache_spec": "kv", "CacheSpec": "kv", "POLICIES": "kv", "parse_policy_list": "kv",
    "kept_map": "kv.kept", "KeptMap": "kv.kept",
    # what a policy costs: the retrieval probe and the policy ranking
    "Prober": "analysis.probe", "ProbeSettings": "analysis.probe", "PolicyRow": "analysis.policies",
    "ranked": "analysis.policies",
    # errors
    "DecodelabError": "errors", "ConfigError": "errors", "ModelLoadError": "errors", "ChainError": "errors",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    """``decodelab.core.<name>`` loads the name's module on first use (PEP 562)."""
    if name not in _API:
        raise AttributeError(f"module 'decodelab.core' has no attribute {name!r}")
    value = getattr(import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value
