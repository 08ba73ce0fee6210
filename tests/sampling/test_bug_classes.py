"""One test per class of bug that slipped past the suite (issue #13, item 8), each with an answer checkable by hand.

Each test names the bug it catches; every one was seen failing with that bug injected, then passing without it.
Vectors are chosen so the arithmetic is exact in float32 (powers of two, equal logits), so a boundary case is a
real boundary and not a rounding accident.
"""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch

from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.biases import LogitBias
from decodelab.core.sampling.penalties import NoRepeatNGram
from decodelab.core.sampling.scaling import Temperature
from decodelab.core.sampling.filters import TopK, TopP
from decodelab.core.sampling.distribution import entropy, softmax
from decodelab.core.sampling.select import make_generator
from decodelab.core.methods.speculative.proposers import NGramProposer
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.trace.stats import pack, ranked_alternatives, stage_stats, unpack
from decodelab.core.engine.stopping import StopChecker, StopRules
from decodelab.core.sampling.step import select
from decodelab.core.trace.records import Alternative, Step

from conftest import random_model

INF = float("inf")


def kept(logits: torch.Tensor) -> list[int]:
    """Ids left with a finite logit in row 0."""
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


# --- top-k: ties with the k-th value are kept ------------------------------------------------------------------


def test_top_k_keeps_every_token_tied_with_the_kth():
    """Bug: top-k keeps exactly k ids (topk indices) and drops those tied with the k-th value.
    Logits 1, 2, 2, 3 with k = 2: the k-th largest is 2, held by ids 1 and 2, so three ids survive."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    assert kept(TopK(2)(None, logits)) == [1, 2, 3]
    assert kept(TopK(1)(None, logits)) == [3]
    assert kept(TopK(3)(None, logits)) == [1, 2, 3]
    # all equal: any k keeps all of them
    assert kept(TopK(1)(None, torch.zeros(1, 4))) == [0, 1, 2, 3]


# --- top-p: the boundary where the mass before a token equals p exactly ----------------------------------------


def test_top_p_stops_when_the_mass_before_a_token_equals_p_exactly():
    """Bug: `mass_before <= p` keeps one token too many when the mass before it is exactly p.
    Four equal logits give p = 1/4 each (exact in float32); the masses before them are 0, 1/4, 1/2, 3/4. With
    top-p 1/2 the third token has exactly 1/2 before it: the first two already reach p, so exactly two stay."""
    logits = torch.zeros(1, 4)
    assert softmax(logits)[0].tolist() == [0.25] * 4  # the premise: exact quarters
    assert len(kept(TopP(0.5)(None, logits))) == 2
    assert len(kept(TopP(0.25)(None, logits))) == 1
    assert len(kept(TopP(0.75)(None, logits))) == 3
    assert len(kept(TopP(0.75 + 2**-20)(None, logits))) == 4  # just past the boundary: the fourth is needed


def test_top_p_exact_powers_of_two():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (logits log 4, log 2, 0, 0 -> exp differences 4, 2, 1, 1 over 8, exact):
    top-p 3/4 keeps {1/2, 1/4} (the mass before the third is exactly 3/4), top-p 1/2 keeps {1/2}."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2.0)
    probs = softmax(logits)[0].tolist()
    assert probs == pytest.approx([0.5, 0.25, 0.125, 0.125], abs=1e-7)
    assert kept(TopP(0.75)(None, logits)) == [0, 1]
    assert kept(TopP(0.5)(None, logits)) == [0]


# --- no-repeat-ngram: a sequence exactly n long, and a prompt of n-1 tokens ------------------------------------


def test_no_repeat_ngram_bans_inside_a_sequence_exactly_n_long():
    """Bug: a sequence of exactly n tokens is skipped (`length <= n` before any work).
    [3, 3] with n = 2: the bigram (3, 3) exists and the last token is 3, so 3 is banned next.
    [4, 4, 4] with n = 3: (4, 4, 4) exists and the tail is (4, 4), so 4 is banned."""
    logits = torch.zeros(1, 6)
    assert torch.isneginf(NoRepeatNGram(2)(torch.tensor([[3, 3]]), logits)[0]).nonzero().flatten().tolist() == [3]
    assert torch.isneginf(NoRepeatNGram(3)(torch.tensor([[4, 4, 4]]), logits)[0]).nonzero().flatten().tolist() == [4]
    # exactly n long without a repeat in the tail: nothing banned ((1, 2) would need the tail 1)
    assert not torch.isneginf(NoRepeatNGram(2)(torch.tensor([[1, 2]]), logits)).any()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_no_repeat_ngram_on_fewer_than_n_tokens_bans_nothing_and_does_not_crash(n):
    """Bug (a crash today): n-1 tokens form no n-gram, but the old guard let them through to unfold(1, n, 1)."""
    logits = torch.arange(8, dtype=torch.float32)[None]
    for length in range(1, n):
        ids = torch.full((1, length), 2)
        out = NoRepeatNGram(n)(ids, logits)
        assert torch.equal(out, logits) and out is not logits  # unchanged, and a new tensor (pure)


# --- --ignore-eos when the model emits EOS --------------------------------------------------------------------


def test_stop_checker_ignores_eos_only_when_asked():
    """Bug: ignore_eos has no effect. The token 0 is EOS: it ends the run, unless EOS is ignored."""
    rules = StopRules(max_new_tokens=3, eos_ids=(0,))
    assert StopChecker(rules).check([0], 5) == "eos"
    ignoring = StopChecker(StopRules(max_new_tokens=3, eos_ids=(0,), ignore_eos=True))
    assert [ignoring.check([0] * i, 4 + i) for i in (1, 2, 3)] == [None, None, "length"]


@pytest.fixture(scope="module")
def toy_eos(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir).eos_token_id


@pytest.mark.parametrize("command", ["sample", "speculate"])
def test_ignore_eos_through_the_cli(cli, toy_model_dir, toy_eos, command):
    """Bug: --ignore-eos not passed on to the stop rules. A +1e4 bias makes EOS every step's only likely token:
    with --ignore-eos the run makes exactly -n tokens, all EOS; without it, one token and stop_reason eos."""
    extra = ["--draft", "ngram"] if command == "speculate" else []
    args = [command, "Hello", "-m", toy_model_dir, "-n", "4", "-t", "0", "--logit-bias", f"{toy_eos}=1e4",
            *extra, "-f", "json"]
    code, out, err = cli(*args, "--ignore-eos")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == [toy_eos] * 4 and doc["summary"]["stop_reason"] == "length"
    code, out, err = cli(*args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == [toy_eos] and doc["summary"]["stop_reason"] == "eos"


# --- a stop string spanning tokens -----------------------------------------------------------------------------


PIECES = {1: "he", 2: "llo", 3: " w", 4: "or", 5: "ld", 6: "x"}


def detok(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def first_stop(tokens: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Feed tokens one by one; (how many were emitted, reason) at the first stop."""
    checker = StopChecker(StopRules(max_new_tokens=100, stop_strings=stops), detok)
    for i in range(1, len(tokens) + 1):
        reason = checker.check(tokens[:i], i)
        if reason is not None:
            return i, reason
    return None


def test_stop_string_spanning_two_tokens():
    """Bug: only the newest token's text is searched. "ell" lies across "he" + "llo"; "lo w" across "llo" + " w";
    "hello world" across all five tokens, after some filler that pushes it away from the start."""
    assert first_stop([1, 2, 6], ("ell",)) == (2, "stop")
    assert first_stop([1, 2, 3, 4], ("lo w",)) == (3, "stop")
    filler = [6] * 40
    assert first_stop(filler + [1, 2, 3, 4, 5, 6], ("hello world",)) == (45, "stop")
    assert first_stop([1, 2, 3], ("hex",)) is None


def test_stop_string_made_of_single_byte_tokens():
    """Bug: a search window counted in characters, not in the worst-case tokens. Byte tokens: the two emoji of
    the stop string are 8 tokens (4 bytes each) for 2 characters, all of which must be in the window."""
    stop = "\U0001F600\U0001F600"
    tokens = list(b"ab" * 10) + list(stop.encode()) + list(b"c")
    checker = StopChecker(StopRules(max_new_tokens=100, stop_strings=(stop,)),
                          lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    reasons = [checker.check(tokens[:i], i) for i in range(1, len(tokens) + 1)]
    assert reasons.index("stop") == 20 + 8 - 1  # the stop string's last byte


# --- the processed entropy of a greedy step ---------------------------------------------------------------------


P4 = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
Z4 = P4.log()
H4 = -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))  # 1.27985 nats


def traced(chain: Chain, logits: torch.Tensor, top: int = 4):
    from decodelab.core.sampling.select import Greedy

    sel = select(chain, Greedy(), torch.zeros(1, 1, dtype=torch.long), logits, record=True)
    host = pack(sel.token, logits, sel.processed, sel.stages, top).tolist()
    return unpack(host, top, logits.shape[-1], len(sel.stages))


def test_greedy_step_entropy_is_zero_and_raw_entropy_is_the_models():
    """Bug: the processed entropy taken from the raw distribution. At temperature 0 the selector draws from a point
    mass: entropy 0, prob 1, kept 1; the raw entropy stays H(0.1, 0.2, 0.3, 0.4) = 1.27985 nats."""
    n = traced(build_chain({"temperature": 0}), Z4)
    assert n.token_id == 3 and n.prob == 1.0 and n.kept == 1
    assert n.entropy == 0.0
    assert n.raw_entropy == pytest.approx(H4, rel=1e-6)
    assert n.raw_prob == pytest.approx(0.4, rel=1e-6) and n.raw_rank == 1


def test_sampled_step_entropy_is_the_processed_distributions():
    """Temperature 1, top-k 2 keeps 0.3 and 0.4 -> 3/7, 4/7: entropy of that, not of the raw four."""
    n = traced(build_chain({"temperature": 1.0, "top-k": 2}), Z4)
    q = (3 / 7, 4 / 7)
    assert n.entropy == pytest.approx(-sum(p * math.log(p) for p in q), rel=1e-5)
    assert n.raw_entropy == pytest.approx(H4, rel=1e-6) and n.kept == 2


# --- alternatives: kept candidates first ------------------------------------------------------------------------


def test_removed_candidates_rank_below_every_kept_one():
    """Bug: alternatives ranked by one mixed score, so a removed token with a high raw probability comes before a
    kept one. Raw 0.1, 0.2, 0.3, 0.4 with token 3 banned: kept 1/6, 2/6, 3/6 (ids 0, 1, 2), removed id 3 (raw 0.4).
    Expected order: 2, 1, 0 (processed), then 3; with top 2, only the kept 2, 1."""
    banned = LogitBias({3: -INF})(None, Z4)
    probs, raw = softmax(banned)[0], softmax(Z4)[0]
    keep = torch.isfinite(banned[0])
    assert ranked_alternatives(probs, raw, keep, 4).tolist() == [2, 1, 0, 3]
    assert ranked_alternatives(probs, raw, keep, 2).tolist() == [2, 1]
    # two removed: ids 3 and 2 banned -> kept 1 (2/3), 0 (1/3), then removed by raw: 3 (0.4), 2 (0.3)
    two = LogitBias({3: -INF, 2: -INF})(None, Z4)
    assert ranked_alternatives(softmax(two)[0], raw, torch.isfinite(two[0]), 4).tolist() == [1, 0, 3, 2]
    # and through the packed trace, with both probabilities labelled
    n = traced(build_chain({"bias": {3: -INF}}), Z4)
    assert [a[0] for a in n.alternatives] == [2, 1, 0, 3]
    assert [round(a[1], 6) for a in n.alternatives] == [0.5, round(2 / 6, 6), round(1 / 6, 6), 0.0]
    assert [round(a[2], 6) for a in n.alternatives] == [0.3, 0.2, 0.1, 0.4]


# --- mass_removed: under the distribution before the stage -------------------------------------------------------


def test_mass_removed_is_measured_before_the_stage_not_on_the_raw_distribution():
    """Bug: mass_removed measured against the raw distribution. Temperature 1/2 squares the probabilities:
    0.01, 0.04, 0.09, 0.16 over 0.30. Top-k 2 then removes ids 0 and 1: 5/30 = 1/6 of the tempered mass (0.3 of
    the raw). Top-p 0.5 after it: 9/25 and 16/25; 16/25 >= 0.5 alone, so it removes 9/25 = 0.36."""
    chain = build_chain({"temperature": 0.5, "top-k": 2, "top-p": 0.5})
    _, stages = chain.run_recorded(None, Z4)
    stats = stage_stats(stages).tolist()
    kept_counts = [int(k) for k, _, _ in stats]
    masses = [m for _, _, m in stats]
    assert kept_counts == [4, 4, 2, 1]
    assert masses == pytest.approx([0.0, 0.0, 1 / 6, 9 / 25], abs=1e-6)
    # a stage after one that already removed a token: that token is not counted again
    chain = build_chain({"bias": {0: -INF}, "top-k": 2})
    _, stages = chain.run_recorded(None, Z4)
    masses = [m for _, _, m in stage_stats(stages).tolist()]
    assert masses == pytest.approx([0.0, 0.1, 2 / 9], abs=1e-6)  # bias: 0.1; top-k drops id 1: 0.2 / 0.9


# --- speculative sampling draws from the run's generator ----------------------------------------------------------


def test_speculative_draws_come_from_the_runs_generator():
    """Bug: u (or the residual draw) taken from torch's global generator. The n-gram proposer draws nothing, so
    the first round's u are exactly the first g uniforms of a fresh generator with the run's seed, whatever the
    global seed is; and two runs with the same seed agree after the global RNG is reseeded differently."""
    target = random_model("llama", seed=0, vocab_size=64, scale=4.0)
    prompt = [3, 17, 42, 9, 30, 17, 42]  # "17 42" recurs: the n-gram proposer drafts 9, 30, 17 in round 1
    chain = build_chain({"temperature": 1.0})

    def run(global_seed: int):
        torch.manual_seed(global_seed)
        sp = Speculator(target, NGramProposer(3), prompt, chain, StopRules(12, ignore_eos=True), 3,
                        make_generator(11, "cpu"), token_text=str, detok=None, top=3)
        rounds = list(sp)
        return sp.new_ids, rounds

    ids_a, rounds_a = run(0)
    ids_b, rounds_b = run(12345)
    first = rounds_a[0]
    assert [t.token_id for t in first.proposed] == [9, 30, 17]
    expected_u = torch.rand(3, generator=make_generator(11, "cpu")).tolist()
    judged = [t.u for t in first.proposed if t.reached]
    assert judged == pytest.approx(expected_u[: len(judged)], abs=0)
    assert ids_a == ids_b
    assert [[t.u for t in r.proposed] for r in rounds_a] == [[t.u for t in r.proposed] for r in rounds_b]


# --- CSV: column names and exact values ---------------------------------------------------------------------------


CSV_COLUMNS = ["index", "position", "token_id", "token", "prob", "logprob", "raw_prob", "raw_logprob", "raw_rank",
               "entropy", "raw_entropy", "kept", "alternatives", "decided_by", "why"]  # the last two added by #11


def test_csv_rows_keep_the_contract_names_and_every_digit():
    """Bug: a column renamed, or values rounded. The header is the contract's field names in order, and every
    float reads back bit for bit (Python's shortest repr round-trips)."""
    from decodelab.cli.view.render import print_rows, step_rows

    step = Step(index=0, position=7, token_id=42, token=" hi", prob=0.123456789012, logprob=math.log(0.123456789012),
                raw_prob=0.0987654321, raw_logprob=math.log(0.0987654321), raw_rank=3, entropy=1.23456789,
                raw_entropy=2.3456789, kept=17,
                alternatives=[Alternative(5, "a", 0.56789, 0.4), Alternative(6, "\n", 0.00001, 0.2)])
    rows = step_rows([step])
    assert list(rows[0]) == CSV_COLUMNS
    buf = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(buf):
        print_rows(rows, "csv")
    lines = buf.getvalue().splitlines()
    assert lines[0] == ",".join(CSV_COLUMNS)
    got = next(csv.DictReader(io.StringIO(buf.getvalue())))
    for key in ("prob", "logprob", "raw_prob", "raw_logprob", "entropy", "raw_entropy"):
        assert float(got[key]) == getattr(step, key), key
    assert [got[k] for k in ("index", "position", "token_id", "raw_rank", "kept")] == ["0", "7", "42", "3", "17"]
    assert got["token"] == " hi"  # the token's real text: csv quotes what needs quoting, nothing is replaced
    alternatives = json.loads(got["alternatives"])  # one JSON cell, every digit kept (was "a:0.5679 \\n:0.0000")
    assert alternatives == [{"token_id": 5, "token": "a", "prob": 0.56789, "raw_prob": 0.4},
                            {"token_id": 6, "token": "\n", "prob": 0.00001, "raw_prob": 0.2}]
