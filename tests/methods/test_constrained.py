"""The constraint stage inside the methods, on the bundled tiny model (4096 tokens): every output of sample and beam
matches its constraint (a property over seeds and constraints), EOS only where the grammar accepts, the run's
constraint numbers against hand sums, compare's attribution, batch, and exact choice probabilities against a plain
transformers forward per label.

Outputs are checked with the references of tests/sampling/test_constraint.py (the `regex` module's partial matching,
a hand-written balanced-parentheses checker), never with llguidance; token bytes come from the GPT-2 byte alphabet.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodelab.core.analysis import compare as cmp
from decodelab.core.engine.forward import forward
from decodelab.core.engine.models import load_model
from decodelab.core.methods.batch.run import BatchRun, BatchSettings, Entry
from decodelab.core.methods.beam import BeamSettings, build_beam
from decodelab.core.methods.choice import score_choices
from decodelab.core.methods.sample import SampleSettings, build_sampler
from decodelab.core.methods.score import ScoreSettings, build_scorer, validate_score
from decodelab.core.errors import ConfigError
from decodelab.core.sampling.chain import make_chain

from test_constraint import PARENS_LARK, SCHEMA, SCHEMA_REGEX, ParensReference, RegexReference, token_bytes

PROMPT = "Once upon a time"


@functools.lru_cache(maxsize=1)
def tiny():
    return load_model("tiny", device="cpu")


@functools.lru_cache(maxsize=None)
def constraint_file(name: str, text: str) -> str:
    folder = Path(__import__("tempfile").mkdtemp())
    (folder / name).write_text(text, encoding="utf-8")
    return str(folder / name)


MULTIBYTE = r"(café|naïve|日本語)( (café|naïve|日本語))*"
# (settings of the constraint, reference): regexes with multi-byte literals, a context-free grammar, a JSON schema
CASES = [
    ({"regex": r"(yes|no|maybe)"}, RegexReference(r"(yes|no|maybe)")),
    ({"regex": r"[a-z]+( [a-z]+){0,3}\."}, RegexReference(r"[a-z]+( [a-z]+){0,3}\.")),
    ({"regex": MULTIBYTE}, RegexReference(MULTIBYTE)),
    ({"regex": r"[0-9]{1,3}(\.[0-9]+)?"}, RegexReference(r"[0-9]{1,3}(\.[0-9]+)?")),
    ({"grammar": ("parens.lark", PARENS_LARK)}, ParensReference()),
    ({"json_schema": ("schema.json", json.dumps(SCHEMA))}, RegexReference(SCHEMA_REGEX)),
    ({"choice": " yes, no,no way"}, RegexReference(r"( yes| no|no way)")),
]


def constraint_settings(case: int) -> dict:
    given_, _ = CASES[case]
    return {k: (constraint_file(*v) if isinstance(v, tuple) else v) for k, v in given_.items()}


def generated_bytes(tokens: list[int], eos: set[int]) -> tuple[bytes, bool]:
    """The text's bytes before the first end id, and whether an end id came."""
    out = []
    for t in tokens:
        if t in eos:
            return b"".join(out), True
        out.append(token_bytes()[t])
    return b"".join(out), False


def assert_matches(reference, tokens: list[int], eos: set[int]) -> None:
    data, ended = generated_bytes(tokens, eos)
    if ended:
        assert reference.complete(data), f"ended (EOS) on {data!r}, which the constraint does not accept"
        first = next(i for i, t in enumerate(tokens) if t in eos)
        assert all(t in eos for t in tokens[first:]), "text after an end"
    else:
        assert reference.viable(data), f"{data!r} is no prefix of the constraint's language"


# --- every output matches its constraint -----------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(0, len(CASES) - 1), seed=st.integers(0, 2**32 - 1),
       temperature=st.sampled_from([0.0, 1.0, 3.0]))
def test_every_sampled_output_matches_its_constraint(case, seed, temperature):
    lm = tiny()
    s = SampleSettings(**constraint_settings(case), temperature=temperature, seed=seed, max_new_tokens=14)
    prompt_ids = lm.encode(PROMPT)
    sampler = build_sampler(lm, s, prompt_ids, record=False)
    for _ in sampler:
        pass
    assert_matches(CASES[case][1], sampler.new_ids, set(lm.eos_ids))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(0, len(CASES) - 1), beams=st.integers(1, 4), prompt=st.sampled_from([PROMPT, "The answer:"]))
def test_every_beam_hypothesis_matches_its_constraint(case, beams, prompt):
    """One matcher state per beam, looked up by the row's prefix: rows reordered to their parents keep theirs."""
    lm = tiny()
    s = BeamSettings(**constraint_settings(case), beams=beams, max_new_tokens=10)
    search = build_beam(lm, s, lm.encode(prompt), record=True)
    hyps = search.run()
    assert hyps
    for h in hyps:
        assert_matches(CASES[case][1], h.token_ids, set(lm.eos_ids))
        assert h.sum_logprob > float("-inf")
    for step in search.steps:  # a live beam with a finite score is on a path the constraint allows
        for beam in step.beams:
            if beam.sum_logprob > float("-inf"):
                assert_matches(CASES[case][1], beam.token_ids, set(lm.eos_ids))


def test_eos_comes_only_where_the_grammar_accepts_and_then_the_run_ends():
    """(yes|no|maybe): after 'no' only the end is allowed (forced), so greedy decoding ends there on EOS."""
    lm = tiny()
    s = SampleSettings(choice="yes,no", temperature=0.0, max_new_tokens=10)
    sampler = build_sampler(lm, s, lm.encode("Answer:"))
    steps = list(sampler)
    assert sampler.stop_reason == "eos"
    text = lm.decode(sampler.new_ids[:-1])
    assert text in ("yes", "no")
    assert steps[-1].state["constraint.accepting"] == 1.0 and steps[-1].state["constraint.forced"] == 1.0
    assert all(st_.state["constraint.accepting"] == 0.0 for st_ in steps[:-1])


# --- the run's constraint numbers -------------------------------------------------------------------------------


def test_mass_removed_is_the_hand_sum_and_the_summary_adds_the_steps():
    """Step t's mass removed = sum over the tokens the reference forbids after the text so far of the model's own
    softmax (the constraint runs first, on the raw logits); the summary's removed log-mass is -sum_t log m_t."""
    lm = tiny()
    pattern = r"[a-z]+( [a-z]+){0,3}\."
    reference = RegexReference(pattern)
    s = SampleSettings(regex=pattern, temperature=1.0, seed=3, max_new_tokens=4)
    prompt_ids = lm.encode(PROMPT)
    sampler = build_sampler(lm, s, prompt_ids)
    steps = list(sampler)
    tb, eos = token_bytes(), set(lm.eos_ids)
    for step in steps[:3]:
        generated = sampler.new_ids[: step.index]
        data = b"".join(tb[t] for t in generated)
        allowed = torch.tensor([reference.complete(data) if i in eos else (tb[i] is not None and
                                reference.viable(data + tb[i])) for i in range(lm.vocab_size)])
        with torch.inference_mode():
            raw = forward(lm.model, torch.tensor([prompt_ids + generated]))[0, -1]
        p = torch.softmax(raw.double(), dim=-1)
        by_hand = float(p[~allowed].sum())
        stat = next(st_ for st_ in step.stages if st_.name == "constraint")
        assert stat.mass_removed == pytest.approx(by_hand, abs=2e-6)
        assert step.state["constraint.allowed"] == int(allowed.sum())
        assert step.state["constraint.log_mass_kept"] == pytest.approx(math.log(float(p[allowed].sum())), abs=1e-5)
    c = sampler.summary().constraint
    assert c.removed_log_mass == pytest.approx(-sum(st_.state["constraint.log_mass_kept"] for st_ in steps))
    assert c.steps == len(steps)
    kept = sorted(st_.state["constraint.log_mass_kept"] for st_ in steps if st_.state["constraint.log_mass_kept"] < 0)
    assert [h.log_mass_kept for h in c.hardest] == kept[: len(c.hardest)]


def test_no_constraint_no_constraint_summary():
    lm = tiny()
    sampler = build_sampler(lm, SampleSettings(temperature=0.0, max_new_tokens=2), lm.encode(PROMPT))
    list(sampler)
    assert sampler.summary().constraint is None


# --- the other methods -----------------------------------------------------------------------------------------


def test_compare_attributes_a_divergence_to_the_constraint():
    """Same settings and seeds but the constraint: where the rows part, switching the constraint on is what changes
    the token (compare's attribution builds the stages from the registry, the constraint included)."""
    lm = tiny()
    variants = [cmp.parse_variant("a: temperature=0.8", 0), cmp.parse_variant("c: temperature=0.8,regex=[a-z ]+", 1)]
    run = cmp.Comparison(lm, variants, [cmp.Prompt("1", PROMPT)], [0, 1, 2], base={"max_new_tokens": 8}).run()
    parted = [p for p in run.pairs if p.first_divergence is not None and p.deciding_stage != "stop"]
    assert parted
    assert {p.deciding_stage for p in parted} == {"constraint"}
    for row in run.rows:
        if row.variant == "c":
            assert_matches(RegexReference("[a-z ]+"), row.token_ids, set(lm.eos_ids))


def test_batch_requests_follow_their_own_constraints():
    """Each request's chain is reset to its own prompt, so the constraint reads only that request's output."""
    lm = tiny()
    base = BatchSettings(temperature=1.0, max_new_tokens=8, baselines=())
    entries = [Entry("0", PROMPT, replace(base, regex="[0-9]+")), Entry("1", "Hello", replace(base, choice="yes,no")),
               Entry("2", "The", base)]
    run = BatchRun(lm, base, entries)
    for _ in run:
        pass
    results = {r.id: r for r in run.report().results}
    assert_matches(RegexReference("[0-9]+"), results["0"].new_ids, set(lm.eos_ids))
    assert_matches(RegexReference("(yes|no)"), results["1"].new_ids, set(lm.eos_ids))
    assert results["0"].chain == ["constraint", "temperature"] and results["2"].chain == ["temperature"]


def test_score_under_a_constraint_removes_what_it_forbids():
    """Teacher-forced: the text after its first token is read against the constraint; a token it forbids gets
    processed log-probability -inf, an allowed one the renormalized model probability."""
    lm = tiny()
    s = ScoreSettings(regex="[a-z ]+")
    validate_score(s)
    ids = lm.encode("hello world 42")
    scorer = build_scorer(lm, s, ids, make_chain(lm, s))
    rows = list(scorer)
    tb = token_bytes()
    reference = RegexReference("[a-z ]+")
    for r in rows:
        viable = reference.viable(b"".join(tb[t] for t in ids[1 : r.position + 1]))
        assert (r.logprob > float("-inf")) == viable
        if viable:
            assert r.logprob >= r.raw_logprob


# --- exact choice probabilities ---------------------------------------------------------------------------------


def plain_logprob(model, prompt_ids: list[int], tokens: tuple[int, ...]) -> float:
    """log P(tokens | prompt) from one forward of transformers over prompt + tokens, no cache."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids + list(tokens)])).logits[0].double()
    logp = torch.log_softmax(out, dim=-1)
    return math.fsum(float(logp[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(tokens))


@pytest.mark.parametrize("prompt,labels", [("Q: Is the sky blue? A:", " yes, no, maybe"),
                                           ("The colour of the sea is", " blue, green, grey,blue")])
def test_exact_choice_probabilities_equal_a_transformers_forward_per_label(prompt, labels):
    lm = tiny()
    s = ScoreSettings(choice=labels)
    validate_score(s)
    ids = lm.encode(prompt)
    report = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    total = 0.0
    for lab in report.scores.labels:
        assert lab.tokenizations, lab.label
        by_hand = sum(math.exp(plain_logprob(lm.model, ids, t)) for t, _ in lab.tokenizations)
        assert lab.exact == pytest.approx(by_hand, rel=1e-4)
        for t, p in lab.tokenizations:
            assert lm.decode(list(t)) == lab.label
            assert p == pytest.approx(math.exp(plain_logprob(lm.model, ids, t)), rel=1e-4)
        total += lab.exact
    shares = [lab.share for lab in report.scores.labels]
    assert sum(shares) == pytest.approx(1.0)
    assert [lab.share for lab in report.scores.labels] == pytest.approx([lab.exact / total
                                                                         for lab in report.scores.labels])
    # the sampler's distribution over the labels sums to 1 with what it lost or did not walk
    sampler = sum(lab.sampler for lab in report.scores.labels)
    assert sampler + report.scores.sampler_lost + report.scores.sampler_unexplored == pytest.approx(1.0, abs=1e-6)
    for lab in report.scores.labels:
        assert lab.first_token_error == pytest.approx(lab.first_token - lab.share)
        assert lab.sampler_error == pytest.approx(lab.sampler - lab.share)
        assert lab.all_paths >= lab.exact * (1 - 1e-6)  # every listed tokenization is a path the sampler allows


def test_choice_scoring_refuses_what_it_does_not_use():
    for bad, needle in ((ScoreSettings(choice="a,b", temperature=0.5), "drop the temperature"),
                        (ScoreSettings(choice="a,b", limit=3), "--limit"),
                        (ScoreSettings(choice="a,b", min_mass=1.0), "--min-mass")):
        with pytest.raises(ConfigError, match=needle):
            validate_score(bad)
