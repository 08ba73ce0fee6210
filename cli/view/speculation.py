"""Views of the speculation planning reports: the offline acceptance prediction (``speculate --predict``)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def prediction_table(prediction, measured: dict) -> Table:
    """One row per gamma: predicted from the alphas (position-dependent walk and iid formula) beside what was
    measured for that gamma (``measured``: gamma -> summary), when it was."""
    table = Table(title=f"predicted from one teacher-forced forward over {prediction.tokens} tokens "
                  f"({prediction.source} text, {prediction.verification}); mean alpha {prediction.mean_alpha:.3f}",
                  header_style="bold", show_edge=False,
                  caption="a: accepted / judged drafts · tok/rnd: N / expected rounds (position-dependent) · "
                  "iid: (1 - a^(g+1)) / (1 - a), a = mean alpha · speedup: predicted, N / (rounds + c drafts) · "
                  "meas: measured (median of the timing rounds)")
    for header in ("g", "a pred", "a meas", "tok/rnd", "iid", "tok/call meas", "speedup", "meas"):
        table.add_column(header, justify="right", no_wrap=True)
    for plan in prediction.plans:
        m = measured.get(plan.gamma)
        table.add_row(str(plan.gamma), fmt(plan.acceptance_rate), fmt(m.acceptance_rate if m else None),
                      fmt(plan.tokens_per_round, ".2f"), fmt(plan.iid_tokens_per_round, ".2f"),
                      fmt(m.tokens_per_target_call if m else None, ".2f"),
                      times(plan.predicted_speedup), times(m.measured_speedup if m else None))
    return table


def times(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def decay_line(prediction) -> Text:
    """Predicted acceptance by draft depth for the largest gamma (accepted there / judged there)."""
    if not prediction.plans:
        return Text("")
    plan = prediction.plans[-1]
    depths = " ".join(fmt(a, ".2f") for a in plan.per_position_acceptance)
    return Text(f"predicted acceptance by draft depth (gamma {plan.gamma}): {depths}")


def conditional_line(c) -> Text:
    """The executed run against alpha on its own judged drafts (an identity in expectation)."""
    z = "exact match required (greedy)" if c.z is None else f"z = {c.z:+.2f} (|z| > 3: the prediction is off)"
    return Text(f"judged drafts of this run: {c.accepted}/{c.judged} accepted (rate {c.measured_rate:.3f}); "
                f"alpha summed over them: {c.expected_accepted:.2f} +- {c.std:.2f} (rate "
                f"{c.predicted_rate:.3f}); {z}", style="bold")


def prediction_views(prediction, summaries) -> list:
    measured = {s.gamma: s for s in summaries}
    c = prediction.cost_ratio
    out = [prediction_table(prediction, measured), decay_line(prediction),
           Text("cost ratio c (draft step / target step): " + ("not measured" if c is None else f"{c:.3f}"))]
    if prediction.conditional is not None:
        out.append(conditional_line(prediction.conditional))
    if prediction.policies:
        out.append(policies_table(prediction))
    return out


def policies_table(prediction) -> Table:
    """Each verification policy replayed on the recorded p and q: its distortion beside the speedup it buys."""
    table = Table(title=f"verification policies replayed on the recorded p, q (gamma {prediction.policies_gamma}): "
                  "emitted law of a round's first token vs the target's p", header_style="bold", show_edge=False,
                  caption="TV, KL(emitted || p): exact, by enumerating the one-step law; means over positions "
                  "(max in the JSON; KL '-': infinite, mass where p = 0) · acc: first-draft acceptance · speedup: predicted")
    for header in ("policy", "exact", "TV", "KL", "acc", "tok/rnd", "speedup"):
        table.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)
    for r in prediction.policies:
        table.add_row(r.policy, "yes" if r.lossless else "no", f"{r.mean_tv:.4f}", fmt(r.mean_kl, ".4f"), f"{r.first_acceptance:.3f}", f"{r.plan.tokens_per_round:.2f}",
                      times(r.plan.predicted_speedup))
    return table


def width_line(a) -> Text:
    """The verify-width audit in words: drift, flips with their margins, and what a zero means."""
    if a.tokens == 0:
        return Text("verify-width audit: no tokens to audit")
    head = (f"verify-width audit ({a.width} rows per verify forward vs 1, {a.tokens} tokens, {a.device}): max "
            f"|logit drift| {a.max_drift:.3g}, mean {a.mean_drift:.3g}; {a.identical}/{a.tokens} positions "
            f"bit-identical; {a.flips} argmax flips")
    if a.flips:
        head += " at " + ", ".join(f"{i} (margin {a.margin[i]:.3g})" for i in a.flip_at[:8])
    else:
        head += f" (smallest top-1/top-2 margin {min(a.margin):.3g})"
    if a.max_drift == 0:
        head += ": the two widths gave bit-identical logits on this device (on a GPU they may not)"
    return Text(head, style="bold")
