"""What ``--draft`` names, read without torch (the CLI checks a draft model's name before torch loads): a model
(bundled name or folder), a lookup proposer (``ngram``, ``suffix``), or a comma-separated chain of them with at most
one model."""

from __future__ import annotations

from ...errors import ConfigError

LOOKUPS = ("ngram", "suffix")


def members(draft: str) -> list[str]:
    items = [m.strip() for m in draft.split(",")]
    if not items or any(not m for m in items):
        raise ConfigError(f"--draft {draft!r}: a proposer, or a comma-separated chain of them, e.g. ngram,tiny-draft "
                          "(a model: bundled name or folder; ngram; suffix)")
    models = [m for m in items if m not in LOOKUPS]
    if len(models) > 1:
        raise ConfigError(f"--draft {draft!r}: at most one draft model in a chain (given: {', '.join(models)})")
    if len(set(items)) != len(items):
        raise ConfigError(f"--draft {draft!r}: a proposer named twice")
    return items


def model_member(draft: str) -> str | None:
    """The chain's draft model, if it has one (the one model to load)."""
    models = [m for m in members(draft) if m not in LOOKUPS]
    return models[0] if models else None
