"""The engine seam: what a backend can do, each ability declared as a capability, and the one check a command makes
before it runs anything.

Two kinds of backend:

* the **embedded** transformers runtime (:mod:`.runtime`): the model in this process, every capability, the full
  logits of every position, every KV-cache policy;
* a **served** engine (:mod:`.http`): an OpenAI-compatible server reached over HTTP (vLLM first; SGLang and
  llama.cpp's server through small adapters), whose adapter declares what it can do. Over HTTP only the top N
  alternatives of a position come back, never the full distribution, and the server keeps its own KV cache.

A command lists what it needs (a capability and the option that asks for it); :func:`refuse_lacking` turns the
first one the backend lacks into one line, as ``--cache`` is refused when a policy cannot do what a method needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; a command that needs more is refused before it runs."""

    score: bool  # per-position logprobs, ranks and top N of a given sequence, teacher-forced
    generate: bool  # a continuation under given sampling settings
    seeded: bool  # the same seed draws the same tokens
    prompt_ranks: bool  # the rank of every scored token, not only of those in the top N
    full_logits: bool  # the whole next-token distribution per position (never, over HTTP)
    max_top_n: int | None  # alternatives per position (None: the whole vocabulary)
    replay: bool = True  # teacher-forced replay of given tokens (a generation's tokens scored again, raw values)
    kv_policies: bool = False  # decodelab's KV-cache policies (--cache); a server keeps its own cache

    def to_dict(self) -> dict:
        return asdict(self)


# the transformers model in this process: everything, over the whole vocabulary
EMBEDDED = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=True, full_logits=True,
                        max_top_n=None, replay=True, kv_policies=True)

# what each capability lets a command do, for the refusal line
WHAT = {
    "score": "scoring a given sequence (prompt logprobs)",
    "generate": "generation",
    "seeded": "seeded draws",
    "prompt_ranks": "the rank of every scored token",
    "full_logits": "the full next-token distribution (a served engine returns only its top N)",
    "replay": "teacher-forced replay of given tokens",
    "kv_policies": "a KV-cache policy (the server keeps its own cache)",
}


def refuse_lacking(capabilities: Capabilities, needs: dict[str, str], backend: str) -> None:
    """``needs``: capability -> the option or command that asks for it. The first capability the backend lacks
    becomes one line naming the option, the backend and what it would take."""
    for capability, option in needs.items():
        if capability not in WHAT:
            raise ValueError(f"unknown capability {capability!r}")
        if not getattr(capabilities, capability):
            raise ConfigError(f"{option}: needs {WHAT[capability]}, which {backend} cannot give; "
                              "run it without --engine")
