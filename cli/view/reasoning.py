"""One line for a run's reasoning / answer split (core/trace/reasoning.py), one for a loop (core/analysis/loops.py)."""

from __future__ import annotations


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def reasoning_line(part: dict) -> str | None:
    """``reasoning: N tokens, mean raw logprob X, mean raw entropy Y (the model's own) · answer: ... · markers: M`` (None: no markers)."""
    doc = part.get("reasoning")
    if not doc:
        return None
    s = doc["summary"]
    pieces = [f"{name}: {s[name]['tokens']} tokens, mean raw logprob {_num(s[name]['mean_raw_logprob'])}, "
              f"mean raw entropy {_num(s[name]['mean_raw_entropy'])} nats" for name in ("reasoning", "answer")]
    end = "never ended" if doc["answer_starts_at"] is None else f"answer from token {doc['answer_starts_at']}"
    outside = f" · outside any block: {s['outside']['tokens']} tokens" if s["outside"]["tokens"] else ""
    return " · ".join(pieces + [f"markers: {s['marker']['tokens']} tokens ({end})"]) + outside


def loop_line(part: dict) -> str | None:
    """``loop: period P x C copies from token S; kept by model at N of M repeated positions, ...`` (None: no loop)."""
    loop = part.get("loop")
    if not loop:
        return None
    total = len(loop["positions"])
    kept = ", ".join(f"{who} at {n} of {total}" for who, n in sorted(loop["kept_by"].items(), key=lambda kv: -kv[1]))
    acted = ", ".join(f"{name} {n}" for name, n in sorted(loop["stages_acted"].items())) or "none"
    return (f"loop: period {loop['period']} x {loop['count']} copies from token {loop['start']}; kept by {kept} "
            f"repeated positions; stages that changed logits there: {acted}")
