"""Beam search against transformers `generate`, against hand-computed log-probability tables, and through the CLI."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import BUNDLED_TOKENIZER, ROOT, random_model

from decodelab.core.engine import warmup
from decodelab.core.errors import ConfigError
from decodelab.core.methods.beam import (
    BeamSearch,
    BeamSettings,
    ModelStepper,
    beam_search,
    beam_stepper,
    build_beam,
    length_norm,
    sweep_length_penalty,
)
from decodelab.core.sampling.chain import build_chain

EOS = 3
PROMPT = [5, 9, 17, 2]
EARLY = {True: "true", False: "false", "never": "never"}
# (arch, seed, EOS logit bias): EOS competes, so hypotheses finish at different lengths and the winner changes with
# the length penalty (checked below, so the oracle grid is never vacuous)
EOS_MODELS = [("llama", 0, 2.0), ("qwen2", 0, 2.0), ("gpt2", 1, 3.0)]


def with_eos_bias(model, eos: int, bias: float):
    """Add ``bias`` to the EOS logit inside the model (a hook on the LM head), so both decoders see it."""

    def hook(module, inputs, output):
        output = output.clone()
        output[..., eos] += bias
        return output

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def eos_model(arch: str, seed: int, bias: float):
    return with_eos_bias(random_model(arch, seed=seed, vocab_size=64, scale=4.0, eos_token_id=EOS), EOS, bias)


def settings(beams=3, lp=1.0, early=False, n=10, num_return=None, norm="hf"):
    return BeamSettings(beams=beams, num_return=num_return, length_penalty=lp, early_stopping=EARLY[early],
                        max_new_tokens=n, length_norm=norm)


def generate(model, prompt, beams, lp, early, nret, n, eos=EOS, **extra):
    return model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          num_beams=beams, num_return_sequences=nret, length_penalty=lp, early_stopping=early,
                          do_sample=False, max_new_tokens=n, output_scores=True, return_dict_in_generate=True,
                          eos_token_id=eos, **{"pad_token_id": eos, **extra})


def assert_same_as_generate(hyps, out, prompt_len, nret, eos=EOS):
    """Token-for-token (padding after a short hypothesis is EOS) and score equality to 1e-4."""
    assert len(hyps) == nret == out.sequences.shape[0]
    for h, seq, score in zip(hyps, out.sequences, out.sequences_scores):
        ref = seq[prompt_len:].tolist()
        assert h.token_ids == ref[: h.length]
        assert all(t == eos for t in ref[h.length:])
        assert h.score == pytest.approx(score.item(), abs=1e-4)


# --- oracle: transformers generate --------------------------------------------------------------------------


@pytest.mark.parametrize("early", [True, False, "never"])
@pytest.mark.parametrize("arch,seed,bias", EOS_MODELS)
def test_beam_equals_generate(arch, seed, bias, early):
    model = eos_model(arch, seed, bias)
    lengths, winners, reasons = set(), {}, set()
    for beams, lp in itertools.product([2, 3, 4], [0.0, 0.5, 1.0, 2.0, -1.0]):
        nret = min(3, beams)
        search = beam_search(model, PROMPT, build_chain({}), settings(beams, lp, early, 10, nret), eos_ids=(EOS,))
        out = generate(model, PROMPT, beams, lp, early, nret, 10)
        assert_same_as_generate(search.hypotheses, out, len(PROMPT), nret)
        lengths.update(h.length for h in search.hypotheses)
        winners.setdefault(beams, set()).add(tuple(search.hypotheses[0].token_ids))
        reasons.add(search.stop_reason)
    assert len(lengths) >= 3  # hypotheses finished at different lengths
    assert any(len(w) > 1 for w in winners.values())  # the winner changed with the penalty
    assert reasons - {"length"}  # some searches stopped before the last allowed length
    # and by this mode's own rule, so the grid reaches the early-stopping test of every mode
    assert {True: "all-finished", False: "no-improvement", "never": "no-improvement"}[early] in reasons, reasons


def test_beam_with_processors_equals_generate():
    """The chain runs on log-probabilities in transformers' order: sequence bias, repetition penalty, n-grams."""
    model = eos_model("llama", 0, 2.0)
    chain = build_chain({"bias": {7: 1.5}, "repetition-penalty": 1.3, "no-repeat-ngram": 2},
                        ["bias", "repetition-penalty", "no-repeat-ngram"])
    prompt = PROMPT + [5]
    for beams, lp in [(2, 0.0), (4, 1.0), (3, 2.0)]:
        search = beam_search(model, prompt, chain, settings(beams, lp, False, 12, 2), eos_ids=(EOS,))
        out = generate(model, prompt, beams, lp, False, 2, 12, sequence_bias={(7,): 1.5}, repetition_penalty=1.3,
                       no_repeat_ngram_size=2)
        assert_same_as_generate(search.hypotheses, out, len(prompt), 2)
        for h in search.hypotheses:
            seq = prompt + h.token_ids
            grams = [tuple(seq[i:i + 2]) for i in range(len(seq) - 1)]
            assert len(grams) == len(set(grams))


def test_beam_on_gemma2_sliding_cache_equals_generate():
    """Gemma 2's sliding-window layers are reordered with the rest, past the window (16) too."""
    model = with_eos_bias(random_model("gemma2", seed=0, vocab_size=64, scale=4.0, eos_token_id=EOS), EOS, -3.0)
    prompt = list(range(4, 16))
    search = beam_search(model, prompt, build_chain({}), settings(3, 1.0, "never", 10, 3), eos_ids=(EOS,))
    assert_same_as_generate(search.hypotheses, generate(model, prompt, 3, 1.0, "never", 3, 10), len(prompt), 3)


def test_two_eos_ids_widen_the_candidate_pool_as_generate_does():
    """With E EOS ids transformers ranks (1 + E) * beams candidates per step; either id finishes a hypothesis."""
    model = with_eos_bias(eos_model("llama", 0, 2.0), 7, 1.5)
    for beams, lp, early in [(2, 1.0, False), (3, 0.0, "never"), (4, 2.0, True)]:
        search = beam_search(model, PROMPT, build_chain({}), settings(beams, lp, early, 10, beams), eos_ids=(3, 7))
        out = generate(model, PROMPT, beams, lp, early, beams, 10, eos=[3, 7], pad_token_id=3)
        assert_same_as_generate(search.hypotheses, out, len(PROMPT), beams, eos=3)


def test_context_limit_caps_the_search():
    model = random_model("gpt2", seed=0, vocab_size=64, scale=4.0)  # 128 positions
    search = beam_search(model, list(range(4, 64)) * 2, build_chain({}), settings(2, 1.0, False, 20), eos_ids=(),
                         context_length=128)
    assert search.n_steps == 8 and search.stop_reason == "context"
    assert all(h.length == 8 and h.reason == "context" for h in search.hypotheses)


def test_raw_sum_logprob_is_the_models_own_log_probability():
    """raw_sum_logprob = the teacher-forced log-probability of the tokens under the model; sum_logprob = the same
    tokens' log-probabilities after the chain (not renormalized), as transformers scores beams."""
    model = eos_model("qwen2", 0, 2.0)
    chain = build_chain({"repetition-penalty": 1.5, "bias": {EOS: -0.5}})
    search = beam_search(model, PROMPT, chain, settings(3, 1.0, False, 8), eos_ids=(EOS,))
    for h in search.hypotheses:
        ids = torch.tensor([PROMPT + h.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        raw = processed = 0.0
        for i, t in enumerate(h.token_ids):
            row = len(PROMPT) - 1 + i
            raw += float(logp[row, t])
            processed += float(chain(ids[:, : row + 1], logp[row : row + 1])[0, t])
        assert h.raw_sum_logprob == pytest.approx(raw, abs=1e-4)
        assert h.sum_logprob == pytest.approx(processed, abs=1e-4)
        assert h.score == pytest.approx(h.sum_logprob / h.length, rel=1e-6)
    assert any(abs(h.sum_logprob - h.raw_sum_logprob) > 0.1 for h in search.hypotheses)


def test_prompt_is_prefilled_once_and_each_step_feeds_one_token_per_beam():
    """The run's forwards, counted apart from the warm-up's (engine/warmup.py: those run before the model is marked
    warm, at the search's shapes: a one-row prefill and 4-row decodes)."""
    model = eos_model("llama", 0, 2.0)
    calls = []  # (input shape, whether the model was warm: False for the warm-up's own forwards)
    model.model.embed_tokens.register_forward_hook(
        lambda m, i, o: calls.append((tuple(i[0].shape), warmup.is_warm(model))))
    search = beam_search(model, PROMPT, build_chain({}), settings(4, 1.0, "never", 6), eos_ids=())
    shapes = [shape for shape, warm in calls if warm]  # the run's
    assert search.n_steps == 6 and search.stop_reason == "length"
    assert shapes == [(1, len(PROMPT))] + [(4, 1)] * 5  # no recompute: the cache rows follow the beams
    assert [shape for shape, warm in calls if not warm] == [(1, warmup.WARM_TOKENS)] + [(4, 1)] * warmup.WARM_DECODES
    assert calls[:warmup.WARM_DECODES + 1] == [(shape, False) for shape, warm in calls if not warm]  # first


# --- hand-built log-probability tables ----------------------------------------------------------------------

E, A, B = 0, 1, 2  # a three-token vocabulary: EOS, "a", "b"
# p(next | generated prefix); any other prefix: OTHER
TABLE = {
    (): [0.30, 0.69, 0.01],
    (A,): [0.40, 0.59, 0.01],
    (A, A): [0.50, 0.49, 0.01],
}
OTHER = [0.2, 0.5, 0.3]


class TableStepper:
    """A fake model: fixed next-token probabilities per generated prefix (logits = log p)."""

    def __init__(self, table, other):
        self.table, self.other, self.prefixes = table, other, [()]

    def logits(self):
        return torch.log(torch.tensor([self.table.get(p, self.other) for p in self.prefixes], dtype=torch.float32))

    def start(self, prompt_ids):
        return self.logits()

    def advance(self, parents, parents_t, tokens):
        rows = [p if len(self.prefixes) > 1 else 0 for p in parents]
        self.prefixes = [self.prefixes[p] + (t,) for p, t in zip(rows, tokens.tolist())]
        return self.logits()


def run_table(s, prompt=(7, 8), table=TABLE, other=OTHER, chain=None, record=False):
    search = BeamSearch(TableStepper(table, other), list(prompt), chain or build_chain({}), s, eos_ids=(E,),
                        record=record)
    search.run()
    return search


# The three hypotheses that matter, by hand: H1 = [E], H2 = [a, E], H3 = [a, a, E]
H1, H2, H3 = [E], [A, E], [A, A, E]
HAND_SUMS = {
    tuple(H1): math.log(0.30),
    tuple(H2): math.log(0.69) + math.log(0.40),
    tuple(H3): math.log(0.69) + math.log(0.59) + math.log(0.50),
}


def hand_score(norm: str, tokens: tuple, prompt_len: int, a: float) -> float:
    length = len(tokens)
    denominator = {"hf": length ** a, "gnmt": ((5 + length) / 6) ** a, "prompt-inclusive": (prompt_len + length) ** a,
                   "none": 1.0}[norm]
    return HAND_SUMS[tokens] / denominator


@pytest.mark.parametrize("norm", ["hf", "gnmt", "prompt-inclusive", "none"])
@pytest.mark.parametrize("prompt_len", [2, 4])
def test_hand_table_winner_under_each_normalization(norm, prompt_len):
    expected = max(HAND_SUMS, key=lambda t: hand_score(norm, t, prompt_len, 1.0))
    search = run_table(settings(3, 1.0, "never", 3, norm=norm), prompt=range(10, 10 + prompt_len))
    best = search.hypotheses[0]
    assert tuple(best.token_ids) == expected
    assert best.sum_logprob == pytest.approx(HAND_SUMS[expected], abs=1e-5)
    assert best.raw_sum_logprob == pytest.approx(HAND_SUMS[expected], abs=1e-5)
    assert best.score == pytest.approx(hand_score(norm, expected, prompt_len, 1.0), abs=1e-5)
    assert best.length == len(expected)


def test_hand_table_was_built_so_the_norms_disagree():
    """none (raw sum) picks the shortest, gnmt the middle, hf the longest: the table really tests the formulas."""
    winners = {norm: max(HAND_SUMS, key=lambda t: hand_score(norm, t, 2, 1.0)) for norm in ("none", "gnmt", "hf")}
    assert winners == {"none": tuple(H1), "gnmt": tuple(H2), "hf": tuple(H3)}
    for norm, tokens in winners.items():
        assert tuple(run_table(settings(3, 1.0, "never", 3, norm=norm)).hypotheses[0].token_ids) == tokens


def test_length_norm_formulas():
    assert length_norm("hf", 4, 10, 1.5) == 4 ** 1.5
    assert length_norm("gnmt", 4, 10, 0.6) == (9 / 6) ** 0.6
    assert length_norm("prompt-inclusive", 4, 10, 1.0) == 14.0
    assert length_norm("none", 4, 10, 2.0) == 1.0


def test_early_stopping_modes_on_a_hand_table():
    # beams 2, hf, penalty 1: after step 2 the pool holds [E] (-1.204) and [a, E] (-1.287 / 2 = -0.644)
    true = run_table(settings(2, 1.0, True, 3))
    assert true.stop_reason == "all-finished" and true.n_steps == 2
    assert true.hypotheses[0].token_ids == H2
    # false: the best live beam [a, a] scores log(.69 * .59) / 2 = -0.449 > -1.204, so the search goes on and
    # finds [a, a, E] (-1.592 / 3 = -0.531)
    false = run_table(settings(2, 1.0, False, 3))
    assert false.n_steps == 3 and false.hypotheses[0].token_ids == H3
    # a table where false's heuristic stops too early and never does not:
    # [E] -0.693; [a, E] = log(.49 * .5) / 2 = -0.703; live [a, a] = log(.49 * .49) / 2 = -0.714 <= -0.703: stop.
    # never tests [a, a] at the longest length: -1.427 / 4 = -0.357 > -0.703, goes on, [a, a, E] = -0.482 wins.
    table = {(): [0.5, 0.49, 0.01], (A,): [0.5, 0.49, 0.01], (A, A): [0.98, 0.01, 0.01]}
    false = run_table(settings(2, 1.0, False, 4), table=table)
    assert false.stop_reason == "no-improvement" and false.n_steps == 2
    assert false.hypotheses[0].token_ids == [E]
    never = run_table(settings(2, 1.0, "never", 4), table=table)
    assert never.hypotheses[0].token_ids == [A, A, E]
    assert never.hypotheses[0].score == pytest.approx((math.log(0.49 * 0.49 * 0.98)) / 3, abs=1e-5)


def test_never_with_a_negative_penalty_bounds_by_the_current_length():
    """transformers bounds the best live beam by the longest length only when the penalty is positive; with a < 0
    a longer hypothesis only scores lower, so "never" bounds by the current length, as "false" does. hf norm, a = -1
    (score = sum x L), beams 2, at most 8 tokens. After step 2 the pool holds [a, E] (log(.94 * .3) x 2 = -2.532)
    and [E] (log .05 = -2.996); the live [a, a] has sum log(.94 * .69) = -0.433. Bounded at the current length,
    -0.433 x 2 = -0.866 > -2.996: the search goes on and finds [a, a, E] = log(.94 * .69 * .98) x 3 = -1.360.
    Bounded at the longest length, -0.433 x 8 = -3.46 would stop at step 2 with [a, E]."""
    table = {(): [0.05, 0.94, 0.01], (A,): [0.3, 0.69, 0.01], (A, A): [0.98, 0.01, 0.01]}
    for early in ("never", False):
        search = run_table(settings(2, -1.0, early, 8), table=table)
        assert search.n_steps == 3 and search.hypotheses[0].token_ids == [A, A, E]
        assert search.hypotheses[0].score == pytest.approx(math.log(0.94 * 0.69 * 0.98) * 3, abs=1e-5)
        assert search.hypotheses[1].token_ids == [A, E]
        assert search.hypotheses[1].score == pytest.approx(math.log(0.94 * 0.3) * 2, abs=1e-5)
    # with a > 0 the longest length does bound "never" (the table of test_early_stopping_modes_on_a_hand_table)


def test_hand_table_trace_and_processed_vs_raw_labels():
    """A +0.5 bias on EOS enters sum_logprob (the decoding score) but not raw_sum_logprob (the model's)."""
    chain = build_chain({"bias": {E: 0.5}})
    search = run_table(settings(3, 1.0, "never", 3), chain=chain, record=True)
    for h in search.hypotheses:
        raw = sum(math.log(((TABLE.get(tuple(h.token_ids[:i]), OTHER))[t])) for i, t in enumerate(h.token_ids))
        assert h.raw_sum_logprob == pytest.approx(raw, abs=1e-5)
        assert h.sum_logprob == pytest.approx(raw + 0.5 * h.token_ids.count(E), abs=1e-5)
    first = search.steps[0]
    by_token = {c.token_id: c for c in first.candidates if c.parent == 0}
    assert by_token[E].fate == "finished" and by_token[E].finishes
    assert by_token[E].logprob == pytest.approx(math.log(0.30) + 0.5, abs=1e-5)
    assert by_token[E].raw_logprob == pytest.approx(math.log(0.30), abs=1e-5)
    assert by_token[A].fate == "live" and by_token[B].fate == "live"
    assert [h.token_ids for h in first.finished] == [H1]
    assert [c.rank for c in first.candidates] == list(range(1, len(first.candidates) + 1))
    assert len(first.candidates) == 2 * 3 and len(first.beams) == 3
    last = search.steps[-1]
    assert all(c.finishes for c in last.candidates)  # the last allowed length: every candidate finishes
    assert [h.rank for h in last.finished] == [1, 2, 3]
    assert [h.score for h in last.finished] == sorted((h.score for h in last.finished), reverse=True)


# --- the sweep ---------------------------------------------------------------------------------------------


def test_sweep_marks_where_the_winner_flips_on_a_hand_table():
    rows = sweep_length_penalty(lambda: TableStepper(TABLE, OTHER), [7, 8], build_chain({}),
                                settings(3, 1.0, "never", 3), [0.0, 1.0, 2.0], eos_ids=(E,))
    assert [r.winner.token_ids for r in rows] == [H1, H3, H3]
    assert [r.changed for r in rows] == [False, True, False]
    assert rows[1].winner.score == pytest.approx(HAND_SUMS[tuple(H3)] / 3, abs=1e-5)


def test_sweep_winners_equal_generate_and_flips_are_marked():
    model = eos_model("qwen2", 0, 2.0)
    penalties = [0.0, 0.5, 1.0, 2.0]
    rows = sweep_length_penalty(lambda: ModelStepper(model), PROMPT, build_chain({}), settings(3, 0.0, False, 10),
                                penalties, eos_ids=(EOS,))
    for row, lp in zip(rows, penalties):
        out = generate(model, PROMPT, 3, lp, False, 1, 10)
        assert_same_as_generate([row.winner], out, len(PROMPT), 1)
    flips = [a.winner.token_ids != b.winner.token_ids for a, b in zip(rows, rows[1:])]
    assert [r.changed for r in rows] == [False] + flips
    assert any(flips)


# --- the bundled model -------------------------------------------------------------------------------------

TINY = ROOT / "presets" / "models" / "tiny"


def test_bundled_tiny_equals_generate():
    """The trained model; a +7 EOS bias (transformers: sequence_bias) makes hypotheses end at different lengths."""
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    lm = load_model("tiny", device="cpu")
    eos = lm.eos_ids[0]
    prompt = lm.encode("Once upon a time, a little fox")
    winners = {}
    for beams, lp, early, bias in [(4, 1.0, False, 0.0), (4, 0.0, False, 7.0), (4, 2.0, "never", 7.0),
                                   (3, 1.0, True, 7.0)]:
        chain = build_chain({"bias": {eos: bias}} if bias else {})
        extra = {"sequence_bias": {(eos,): bias}} if bias else {}
        search = beam_search(lm.model, prompt, chain, settings(beams, lp, early, 16, beams), eos_ids=(eos,))
        out = generate(lm.model, prompt, beams, lp, early, beams, 16, eos=eos, **extra)
        assert_same_as_generate(search.hypotheses, out, len(prompt), beams, eos=eos)
        winners[lp] = search.hypotheses[0]
    assert winners[0.0].length < winners[2.0].length  # the penalty flips the winner from short to long


# --- the command line --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_toy_dir(tmp_path_factory):
    """A saved random Llama with the bundled tokenizer whose EOS row is boosted: for 'Once upon a time' with 3
    beams and 8 new tokens the winner is 7 tokens long (EOS included) at penalty 0 and 0.5, and 8 at 1 and 2."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("beamtoy")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUNDLED_TOKENIZER / name).exists():
            shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    tok = AutoTokenizer.from_pretrained(folder)
    model = random_model("llama", seed=1, vocab_size=len(tok), scale=4.0, eos_token_id=tok.eos_token_id,
                         max_position_embeddings=64)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 4.0
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def run_json(cli, *args):
    code, out, err = cli("beam", *args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_cli_json_hypotheses_steps_sweep_and_generate(cli, eos_toy_dir):
    doc = run_json(cli, "Once upon a time", "-m", eos_toy_dir, "-b", "3", "--return", "2", "-n", "8",
                   "--sweep-length-penalty", "0,0.5,1,2", "--device", "cpu")
    for key in ("command", "model", "config", "chain", "prompt", "steps", "text", "token_ids", "hypotheses",
                "summary", "sweep"):
        assert key in doc
    assert doc["command"] == "beam" and doc["config"]["beams"] == 3 and doc["config"]["length_norm"] == "hf"
    hyps = doc["hypotheses"]
    assert [h["rank"] for h in hyps] == [1, 2]
    assert doc["text"] == hyps[0]["text"] and doc["token_ids"] == hyps[0]["token_ids"]
    for h in hyps:
        assert set(h) >= {"rank", "text", "token_ids", "sum_logprob", "raw_sum_logprob", "length", "score"}
        assert h["length"] == len(h["token_ids"])
        assert h["score"] == pytest.approx(h["sum_logprob"] / h["length"], rel=1e-6)
        assert h["raw_sum_logprob"] == pytest.approx(h["sum_logprob"], abs=1e-4)  # no processors here
    assert hyps[0]["score"] >= hyps[1]["score"]
    for i, step in enumerate(doc["steps"]):
        assert step["index"] == i and step["length"] == i + 1
        assert len(step["beams"]) == 3 and len(step["candidates"]) == 6
        assert {c["fate"] for c in step["candidates"]} <= {"live", "finished", "rejected", "pruned"}
        assert sum(c["fate"] == "live" for c in step["candidates"]) == 3 or i == len(doc["steps"]) - 1
        assert all(len(b["token_ids"]) == i + 1 for b in step["beams"])
    summary = doc["summary"]
    assert summary["beams"] == 3 and summary["steps"] == len(doc["steps"]) and summary["returned"] == 2
    assert summary["stop_reason"] in ("length", "no-improvement", "all-finished")
    assert summary["tokens_per_s"] > 0
    sweep = doc["sweep"]
    assert [r["length_penalty"] for r in sweep] == [0, 0.5, 1, 2]
    assert [r["changed"] for r in sweep] == [False, False, True, False]
    assert sweep[0]["winner"]["token_ids"][-1] == 0 and sweep[2]["winner"]["length"] == 8
    for r in sweep:
        assert set(r["winner"]) >= {"text", "token_ids", "length", "score", "sum_logprob", "raw_sum_logprob"}
    # the same search through transformers on the saved folder
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eos_toy_dir).eval()
    out = generate(model, doc["prompt"]["token_ids"], 3, 1.0, False, 2, 8, eos=0)
    for h, seq, score in zip(hyps, out.sequences, out.sequences_scores):
        assert h["token_ids"] == seq[len(doc["prompt"]["token_ids"]):].tolist()[: h["length"]]
        assert h["score"] == pytest.approx(score.item(), abs=1e-4)
    for r in sweep:
        out = generate(model, doc["prompt"]["token_ids"], 3, r["length_penalty"], False, 1, 8, eos=0)
        assert r["winner"]["score"] == pytest.approx(out.sequences_scores[0].item(), abs=1e-4)


def test_cli_norms_and_processor_labels(cli, eos_toy_dir):
    a = run_json(cli, "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "6", "--length-norm", "gnmt",
                 "--length-penalty", "0.6", "--early-stopping", "never")
    for h in a["hypotheses"]:
        assert h["score"] == pytest.approx(h["sum_logprob"] / ((5 + h["length"]) / 6) ** 0.6, rel=1e-6)
    p = len(a["prompt"]["token_ids"])
    b = run_json(cli, "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "6", "--length-norm",
                 "prompt-inclusive", "--repetition-penalty", "1.5", "--no-repeat-ngram", "2")
    assert b["chain"] == ["repetition-penalty", "no-repeat-ngram"]
    for h in b["hypotheses"]:
        assert h["score"] == pytest.approx(h["sum_logprob"] / (p + h["length"]), rel=1e-6)
        assert h["sum_logprob"] <= h["raw_sum_logprob"] + 1e-4  # the penalty only lowers log-probabilities
    c = run_json(cli, "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "6", "--length-norm", "none",
                 "--length-penalty", "3")
    for h in c["hypotheses"]:
        assert h["score"] == pytest.approx(h["sum_logprob"], rel=1e-6)


def test_cli_jsonl_markdown_csv_and_table(cli, eos_toy_dir):
    code, out, err = cli("beam", "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "4", "-f", "jsonl")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["type"] for x in lines] == ["step"] * (len(lines) - 1) + ["summary"]
    assert lines[-1]["hypotheses"][0]["token_ids"] == lines[-1]["token_ids"]
    code, out, err = cli("beam", "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "4", "-f", "csv",
                         "--sweep-length-penalty", "0,1")
    assert code == 0, err
    assert out.splitlines()[0].startswith("length_penalty,text,length,raw_sum_logprob,sum_logprob,score,changed")
    assert len(out.splitlines()) == 3
    code, out, err = cli("beam", "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "4", "-f", "markdown")
    assert code == 0, err
    header = out.splitlines()[0].split("|")
    assert out.startswith("|") and [h.strip() for h in header[1:4]] == ["rank", "text", "length"]  # was only in
    # the assert message before, so never checked
    code, out, err = cli("beam", "Once upon a time", "-m", eos_toy_dir, "-b", "2", "-n", "4",
                         "--sweep-length-penalty", "0,1")
    assert code == 0, err
    assert "finished hypotheses" in out and "winner per length penalty" in out and "●" in out


@pytest.mark.parametrize("args,needle", [
    (["-b", "0"], "--beams 0"),
    (["-b", "2", "--return", "3"], "--return 3"),
    (["--length-norm", "log"], "--length-norm 'log'"),
    (["--early-stopping", "sometimes"], "--early-stopping 'sometimes'"),
    (["--sweep-length-penalty", "0,x"], "--sweep-length-penalty"),
    (["--set", "top_p=0.9"], "--top-p 0.9"),
    (["-n", "0"], "--max-new-tokens 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2_before_loading(cli, args, needle):
    code, out, err = cli("beam", "hi", "-m", "/nonexistent/model", *args)  # a load would fail differently
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


# --- how many finished, how many beams (issue 13 item 6) ------------------------------------------------------------


def test_summary_finished_is_the_pool_never_more_than_beams():
    """Beams 2 on the hand table: [E], [a, E], [a, a, E] and [a, a, a] enter the pool in turn and the better ones push
    the worse out; transformers keeps the best num_beams finished too (_update_finished_beams: top-k, k = num_beams):
    4 entered, 2 finished."""
    search = run_table(settings(2, 1.0, "never", 3))
    s = search.summary()
    assert s.finished == len(search.hypotheses) == 2 <= s.beams
    assert s.entered == 4


def test_beams_beyond_the_vocabulary_are_refused():
    """5 beams over a 3-token vocabulary: the first step has only 3 continuations, so two returned hypotheses extend
    transformers' -1e9 placeholder rows. build_beam refuses it, one line, once the vocabulary is known."""
    from decodelab.core.methods.beam import check_beams_fit_vocabulary
    from decodelab.core.errors import ConfigError

    garbage = run_table(settings(5, 1.0, "never", 1)).hypotheses
    assert sum(h.score < -1e8 for h in garbage) == 2
    with pytest.raises(ConfigError, match=r"--beams 5: must be at most the model's vocabulary size \(3\)"):
        check_beams_fit_vocabulary(5, 3)
    check_beams_fit_vocabulary(3, 3)


def test_readme_sweep_example_shows_the_winner_changing(cli):
    """The README's length-penalty sweep example, run as written on the bundled tiny: at least two winners (one
    ending in EOS, so the lengths differ), and the change marked."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("decodelab beam ") and "--sweep-length-penalty" in x)
    import shlex

    args = shlex.split(line.split("#")[0])[1:]
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    sweep = json.loads(out)["sweep"]
    assert len({tuple(r["winner"]["token_ids"]) for r in sweep}) >= 2
    assert any(r["changed"] for r in sweep)
    assert len({r["winner"]["length"] for r in sweep}) >= 2 and any(r["winner"]["reason"] == "eos" for r in sweep)


# --- mutation run of core/methods/beam.py (2026-12-01, helper mutbeam): what its survivors asked for ------------------


def test_summary_figures_on_the_hand_table_by_hand():
    """Beams 2, hf, a = 1, 3 tokens on TABLE: the search runs all 3 steps (2 beams a step: 6 forward tokens); the pool
    ends as [a, a, E] (log(.69 * .59 * .50) / 3 = -0.531) and [a, a, a] (-0.538), so the best is 3 tokens long."""
    search = run_table(settings(2, 1.0, "never", 3))
    s = search.summary()
    assert (s.beams, s.steps, s.finished, s.entered, s.returned) == (2, 3, 2, 4, 2)
    assert (s.best_length, s.forward_tokens, s.stop_reason) == (3, 6, "length")
    assert s.best_score == pytest.approx(HAND_SUMS[tuple(H3)] / 3, abs=1e-6)
    assert s.best_score == search.hypotheses[0].score
    assert all(h.step == h.length - 1 for h in search.hypotheses)  # a hypothesis of L tokens finished at step L - 1
    assert [(h.token_ids, h.reason) for h in search.hypotheses] == [(H3, "eos"), ([A, A, A], "length")]
    timing = search.watch.timing
    assert s.seconds == timing.total_s > 0 and s.prefill_s == timing.prefill_s >= 0
    assert s.tokens_per_s == pytest.approx(6 / s.seconds)
    assert s.decode_tokens_per_s == timing.decode_tokens_per_s(6) > 0
    assert run_table(settings(2, 1.0, "never", 3, num_return=1)).summary().returned == 1


def test_summary_of_a_search_stopped_before_anything_finished():
    """EOS ignored and the search left after its first step: the pool is empty, so no best hypothesis: length 0,
    score NaN, and the first step's 2 beams are the forward tokens."""
    s = BeamSettings(beams=2, length_penalty=1.0, early_stopping="never", max_new_tokens=3, ignore_eos=True)
    search = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), s, eos_ids=(E,))
    next(iter(search))
    summary = search.summary()
    assert (summary.finished, summary.returned, summary.best_length, summary.steps, summary.forward_tokens) == \
        (0, 0, 0, 1, 2)
    assert math.isnan(summary.best_score)


def test_sweep_rows_carry_the_context_cap_the_detokenizer_and_the_steps():
    """The context of 4 tokens leaves a 2-token prompt 2 new tokens of the 10 asked: every row stops for "context"
    after 2 steps, where every candidate finishes: [a, a] (log(.69 * .59) = -0.898) beats [E] (-1.204) and [a, E]
    (-1.287) under a = 0 and, halved, under a = 1 too; its reason is the cap and its text the sweep's own
    detokenizer's."""
    rows = sweep_length_penalty(lambda: TableStepper(TABLE, OTHER), [7, 8], build_chain({}),
                                settings(3, 1.0, "never", 10), [0.0, 1.0], eos_ids=(E,),
                                detok=lambda ids: "".join("Eab"[t] for t in ids), context_length=4)
    assert [(r.stop_reason, r.steps) for r in rows] == [("context", 2), ("context", 2)]
    assert [r.winner.token_ids for r in rows] == [[A, A], [A, A]] and [r.winner.text for r in rows] == ["aa", "aa"]
    assert [r.winner.reason for r in rows] == ["context", "context"]
    assert rows[1].winner.score == pytest.approx(math.log(0.69 * 0.59) / 2, abs=1e-6)
    rows = sweep_length_penalty(lambda: TableStepper(TABLE, OTHER), [7, 8], build_chain({}),
                                settings(2, 1.0, True, 3), [1.0], eos_ids=(E,))
    assert [(r.stop_reason, r.steps) for r in rows] == [("all-finished", 2)]


def test_parse_penalties_bounds_and_messages():
    from decodelab.core.errors import ConfigError
    from decodelab.core.methods.beam import parse_penalties

    assert parse_penalties(" 0, 0.5 ,-10,10") == [0.0, 0.5, -10.0, 10.0]  # the bounds themselves are allowed
    with pytest.raises(ConfigError) as bad:
        parse_penalties("0,x")
    assert str(bad.value) == ("--sweep-length-penalty '0,x': 'x' is not a number; give comma-separated penalties, "
                              "e.g. 0,0.5,1,2")
    for text in ("0,10.5", "-11", "nan"):
        with pytest.raises(ConfigError) as bad:
            parse_penalties(text)
        assert str(bad.value) == f"--sweep-length-penalty {text!r}: every penalty must be in [-10, 10]"


def test_a_sampling_only_setting_is_refused_in_one_whole_line():
    from decodelab.core.errors import ConfigError
    from decodelab.core.methods.beam import validate_beam

    with pytest.raises(ConfigError) as bad:
        validate_beam(BeamSettings(top_k=5))
    assert str(bad.value) == ("--top-k 5: not used by beam search (transformers applies it only when sampling; every "
                              "beam scores all tokens); allowed processors: --repetition-penalty, --no-repeat-ngram, "
                              "--logit-bias, a constraint")


def test_validate_beam_bounds_and_the_cache_refusal():
    """The edges of --beams [1, 256], --return [1, beams], --length-penalty [-10, 10] and -n >= 1 are allowed, past
    them refused, each in one whole line; a cache that can neither reorder nor hold rows (paged) is refused naming
    the first missing ability and every policy with both."""
    from decodelab.core.errors import ConfigError
    from decodelab.core.kv.protocol import POLICIES
    from decodelab.core.methods.beam import validate_beam

    for ok in (dict(beams=1), dict(beams=256), dict(beams=3, num_return=1), dict(beams=3, num_return=3),
               dict(length_penalty=10.0), dict(length_penalty=-10.0), dict(max_new_tokens=1)):
        validate_beam(BeamSettings(**ok))
    for bad, message in [(dict(length_norm="log"), "--length-norm 'log': allowed: hf, gnmt, prompt-inclusive, none"),
                         (dict(length_penalty=-10.5), "--length-penalty -10.5: must be a number in [-10, 10] "
                                                      "(norm(L) = L^a must stay a finite float)"),
                         (dict(max_new_tokens=0), "--max-new-tokens 0: must be >= 1"),
                         (dict(beams=0), "--beams 0: must be an integer in [1, 256]"),
                         (dict(beams=257), "--beams 257: must be an integer in [1, 256]"),
                         (dict(beams=3, num_return=0), "--return 0: must be between 1 and --beams (3)"),
                         (dict(beams=3, num_return=4), "--return 4: must be between 1 and --beams (3)")]:
        with pytest.raises(ConfigError) as err:
            validate_beam(BeamSettings(**bad))
        assert str(err.value) == message
    able = [name for name, cls in POLICIES.items() if {"reorder", "rows"} <= set(cls.capabilities)]
    assert "full" in able and "paged" not in able
    with pytest.raises(ConfigError) as err:
        validate_beam(BeamSettings(cache="paged:block=4"))
    assert str(err.value) == ("--cache paged:block=4: beam search needs the cache to reorder rows, which paged cannot; "
                              f"policies that can: {', '.join(able)}")


def test_a_static_cache_is_preallocated_for_the_prompt_and_every_step():
    """The search tells its stepper the positions it may need (prompt + max new tokens): a static cache sized so
    searches as the full one (the same hypotheses as generate); sized for less it would refuse mid-search."""
    from decodelab.core.kv import parse_cache_spec

    model = eos_model("llama", 0, 2.0)
    s = settings(3, 1.0, "never", 10, 3)
    search = beam_search(model, PROMPT, build_chain({}), s, eos_ids=(EOS,), cache=parse_cache_spec("static"))
    assert search.stepper.capacity == len(PROMPT) + 10
    assert_same_as_generate(search.hypotheses, generate(model, PROMPT, 3, 1.0, "never", 3, 10), len(PROMPT), 3)


def test_two_eos_ids_rank_three_candidates_a_beam_so_every_beam_stays_live():
    """Two EOS ids (E and b) that are the likeliest tokens everywhere (0.45 each): K = max(2, 1 + 2) * B = 6
    candidates a step, so after the 2 finishing ones of each beam B = 2 non-finishing ones are left; with only 2B,
    the first step's top 4 (E, b, a of the prompt, then a -1e9 placeholder's E) would leave one live beam. The
    first step finishes [E] and [b], both log .45."""
    table = {}
    s = settings(2, 1.0, "never", 3)
    search = BeamSearch(TableStepper(table, [0.45, 0.10, 0.45]), [7, 8], build_chain({}), s, eos_ids=(E, B),
                        record=True)
    search.run()
    assert [(len(step.candidates), len(step.beams)) for step in search.steps] == [(6, 2)] * len(search.steps)
    assert sorted(h.token_ids for h in search.steps[0].finished) == [[E], [B]]
    assert [h.score for h in search.steps[0].finished] == pytest.approx([math.log(0.45)] * 2, abs=1e-6)


def test_a_chain_that_removes_every_candidate_names_its_stages():
    """Only "a" allowed, and no-repeat-ngram 1 bans it once generated (the prompt is "b"): the second step has no
    candidate left."""
    from decodelab.core.sampling.chain import ChainError

    chain = build_chain({"allow": (A,), "no-repeat-ngram": 1})
    with pytest.raises(ChainError) as err:
        run_table(settings(1, 1.0, "never", 3), prompt=(B,), chain=chain)
    assert str(err.value) == (f"the chain [{', '.join(chain.names)}] removed every candidate token; loosen the "
                              "filters or bans")
    assert len(chain.names) == 2


# --- mutation run of core/methods/beam.py, the rest (2026-12-02, helper mbeam): what its survivors asked for ---------


def test_every_trace_record_of_the_hand_table_by_hand():
    """Beams 2, hf, a = 1, 3 tokens on TABLE, recorded, the detokenizer writing E, a, b (no token_text given: one
    token's text is the detokenizer's). K = 4 candidates a step (2 x beams, one EOS id).
    Step 0 (L = 1): a (log .69), E (log .3: finishes, enters the pool), b (log .01), then a row of the -1e9 placeholder
    beam: pruned. Step 1 (L = 2): [a]+a, [a]+E (enters: score / 2), [a]+b, then [b]+a (log .01 + log .5): pruned.
    Step 2 (L = 3, the last: every candidate finishes): only the first B may enter: [a, a, E] and [a, a, a] push [a, E]
    and [E] out; the two after them stay pruned; the live rows are the first two candidates."""
    lg = math.log
    search = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), settings(2, 1.0, "never", 3),
                        eos_ids=(E,), detok=lambda ids: "".join("Eab"[t] for t in ids), record=True)
    steps = list(search)
    assert steps == search.steps and [(s.index, s.length) for s in steps] == [(0, 0 + 1), (1, 2), (2, 3)]

    def cands(step):
        return [(c.rank, c.parent, c.token_id, c.token, c.finishes, c.fate) for c in step.candidates]

    def near(got, want):
        flat = [x for row in got for x in (row if isinstance(row, tuple) else (row,))]
        assert flat == pytest.approx([x for row in want for x in (row if isinstance(row, tuple) else (row,))], abs=1e-6)
        assert len(got) == len(want)

    s0, s1, s2 = steps
    assert cands(s0)[:3] == [(1, 0, A, "a", False, "live"), (2, 0, E, "E", True, "finished"),
                             (3, 0, B, "b", False, "live")]
    assert cands(s0)[3][0:2] == (4, 1) and cands(s0)[3][4:] == (False, "pruned")
    near([c.logprob for c in s0.candidates[:3]], [lg(.69), lg(.3), lg(.01)])
    near([c.raw_logprob for c in s0.candidates[:3]], [lg(.69), lg(.3), lg(.01)])
    near([c.sum_logprob for c in s0.candidates], [lg(.69), lg(.3), lg(.01), -1e9])
    near([c.score for c in s0.candidates], [lg(.69), lg(.3), lg(.01), -1e9])
    assert [(b.beam, b.parent, b.token_ids, b.text) for b in s0.beams] == [(0, 0, [A], "a"), (1, 0, [B], "b")]
    near([(b.sum_logprob, b.raw_sum_logprob, b.score) for b in s0.beams], [(lg(.69),) * 3, (lg(.01),) * 3])
    assert [(h.rank, h.text, h.token_ids, h.length, h.step, h.reason) for h in s0.finished] == [(1, "E", [E], 1, 0,
                                                                                                  "eos")]
    near([(h.sum_logprob, h.raw_sum_logprob, h.score) for h in s0.finished], [(lg(.3),) * 3])

    assert cands(s1) == [(1, 0, A, "a", False, "live"), (2, 0, E, "E", True, "finished"),
                         (3, 0, B, "b", False, "live"), (4, 1, A, "a", False, "pruned")]
    sums1 = [lg(.69 * .59), lg(.69 * .4), lg(.69 * .01), lg(.01 * .5)]
    near([c.logprob for c in s1.candidates], [lg(.59), lg(.4), lg(.01), lg(.5)])
    near([c.raw_logprob for c in s1.candidates], [lg(.59), lg(.4), lg(.01), lg(.5)])
    near([c.sum_logprob for c in s1.candidates], sums1)
    near([c.score for c in s1.candidates], [x / 2 for x in sums1])
    assert [(b.beam, b.parent, b.token_ids, b.text) for b in s1.beams] == [(0, 0, [A, A], "aa"), (1, 0, [A, B], "ab")]
    near([(b.sum_logprob, b.raw_sum_logprob, b.score) for b in s1.beams],
         [(sums1[0], sums1[0], sums1[0] / 2), (sums1[2], sums1[2], sums1[2] / 2)])
    assert [(h.rank, h.text, h.token_ids, h.step) for h in s1.finished] == [(1, "aE", [A, E], 1), (2, "E", [E], 0)]
    near([h.score for h in s1.finished], [sums1[1] / 2, lg(.3)])

    sums2 = [lg(.69 * .59 * .5), lg(.69 * .59 * .49), lg(.69 * .59 * .01), lg(.69 * .01 * .5)]
    assert cands(s2) == [(1, 0, E, "E", True, "finished"), (2, 0, A, "a", True, "finished"),
                         (3, 0, B, "b", True, "pruned"), (4, 1, A, "a", True, "pruned")]
    near([c.sum_logprob for c in s2.candidates], sums2)
    near([c.score for c in s2.candidates], [x / 3 for x in sums2])
    assert [(b.beam, b.parent, b.token_ids, b.text) for b in s2.beams] == [(0, 0, [A, A, E], "aaE"),
                                                                           (1, 0, [A, A, A], "aaa")]
    assert [(h.rank, h.text, h.token_ids, h.length, h.step, h.reason) for h in s2.finished] == \
        [(1, "aaE", [A, A, E], 3, 2, "eos"), (2, "aaa", [A, A, A], 3, 2, "length")]
    near([(h.sum_logprob, h.raw_sum_logprob, h.score) for h in s2.finished],
         [(sums2[0], sums2[0], sums2[0] / 3), (sums2[1], sums2[1], sums2[1] / 3)])
    assert search.new_ids == [A, A, E] and search.entered == 4 and search.stop_reason == "length"


def test_token_text_and_detokenizer_defaults_and_a_given_token_text():
    """Without a detokenizer, ids are written space-separated, and a token's text is that of the one-id list; a
    token_text of its own names the candidates while the detokenizer still writes the beams and hypotheses."""
    plain = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), settings(2, 1.0, "never", 2),
                       eos_ids=(E,), record=True)
    plain.run()
    assert [c.token for c in plain.steps[1].candidates] == ["1", "0", "2", "1"]
    assert [b.text for b in plain.steps[1].beams] == ["1 1", "1 0"]
    assert [h.text for h in plain.hypotheses] == ["1 1", "1 0"]
    named = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), settings(2, 1.0, "never", 2),
                       eos_ids=(E,), detok=lambda ids: "".join("Eab"[t] for t in ids),
                       token_text=lambda t: f"<{t}>", record=True)
    named.run()
    assert [c.token for c in named.steps[1].candidates] == ["<1>", "<0>", "<2>", "<1>"]
    assert [h.text for h in named.hypotheses] == ["aa", "aE"]


def test_an_unrecorded_search_yields_bare_steps_and_keeps_none():
    search = run_table(settings(2, 1.0, "never", 3))
    assert search.steps == [] and search.n_steps == 3
    bare = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), settings(2, 1.0, "never", 3),
                      eos_ids=(E,))
    assert [(s.index, s.length, s.beams, s.candidates, s.finished) for s in bare] == \
        [(0, 1, [], [], []), (1, 2, [], [], []), (2, 3, [], [], [])]


@pytest.fixture(scope="module")
def tiny_lm():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


def test_build_beam_on_the_bundled_model_writes_text_and_stops_at_the_context(tiny_lm):
    """A prompt 2 tokens short of the model's context (512): 5 new tokens asked, 2 searched, the reason "context";
    the hypotheses' and live beams' texts and each candidate's token are the model's own detokenizer's."""
    lm = tiny_lm
    prompt = (lm.encode("Once upon a time, a little fox") * 64)[: lm.context_length - 2]
    search = build_beam(lm, BeamSettings(beams=2, max_new_tokens=5, early_stopping="never", ignore_eos=True), prompt)
    search.run()
    assert (search.max_new, search.capped, search.n_steps, search.stop_reason) == (2, True, 2, "context")
    assert [h.reason for h in search.hypotheses] == ["context", "context"]
    assert all(h.text == lm.decode(h.token_ids) and h.length == 2 for h in search.hypotheses)
    assert all(b.text == lm.decode(b.token_ids) for step in search.steps for b in step.beams)
    assert all(c.token == lm.decode([c.token_id]) for step in search.steps for c in step.candidates)
    unrecorded = build_beam(lm, BeamSettings(beams=2, max_new_tokens=2, ignore_eos=True), prompt[:5], record=False)
    assert list(unrecorded)[0].candidates == [] and unrecorded.capped is False


def test_build_beam_refuses_a_stepwise_stage_naming_beam_search(tiny_lm):
    with pytest.raises(ConfigError) as err:
        build_beam(tiny_lm, BeamSettings(mirostat_tau=5.0), [5, 9])
    assert str(err.value) == ("--mirostat-tau/--mirostat-eta: beam search scores several continuations per step, and "
                              "mirostat draws its own coin or carries state from step to step; drop it for this "
                              "command")


def test_build_beam_searches_over_the_cache_policy_asked(tiny_lm):
    """A 4-token window changes what the model sees, so the hypotheses differ from the full cache's; the search built
    from the settings equals the one given that policy by hand."""
    from decodelab.core.kv import parse_cache_spec

    lm = tiny_lm
    prompt = lm.encode("Once upon a time, a little fox")
    s = BeamSettings(beams=2, max_new_tokens=6, early_stopping="never", ignore_eos=True, cache="window:size=4")
    built = build_beam(lm, s, prompt)
    built.run()
    by_hand = beam_search(lm.model, prompt, build_chain({}), s, cache=parse_cache_spec("window:size=4"))
    full = beam_search(lm.model, prompt, build_chain({}), s)
    assert [h.token_ids for h in built.hypotheses] == [h.token_ids for h in by_hand.hypotheses]
    assert [h.token_ids for h in built.hypotheses] != [h.token_ids for h in full.hypotheses]
    assert by_hand.steps == [] and len(built.steps) == 6  # beam_search records no trace unless asked; build_beam does
    assert beam_stepper(lm, s).spec == parse_cache_spec("window:size=4")


def test_beam_search_hands_the_search_its_detokenizer_token_text_context_and_record():
    """What beam_search is given reaches the search: a context 3 tokens past the prompt caps 6 new tokens at 3, the
    texts are the detokenizer's and the candidates' tokens the token_text's; record=False (the default) keeps no
    trace even with a token_text."""
    model = eos_model("llama", 0, 2.0)
    detok = lambda ids: "|".join(map(str, ids))  # noqa: E731
    search = beam_search(model, PROMPT, build_chain({}), settings(2, 1.0, "never", 6), eos_ids=(EOS,), detok=detok,
                         context_length=len(PROMPT) + 3, record=True, token_text=lambda t: f"<{t}>")
    assert (search.max_new, search.capped) == (3, True)
    assert all(h.text == detok(h.token_ids) for h in search.hypotheses)
    assert len(search.steps) == search.n_steps >= 1
    assert all(c.token == f"<{c.token_id}>" for step in search.steps for c in step.candidates)
    quiet = beam_search(model, PROMPT, build_chain({}), settings(2, 1.0, "never", 6), eos_ids=(EOS,),
                        token_text=lambda t: f"<{t}>")
    assert quiet.steps == [] and quiet.max_new == 6


def test_model_stepper_prefills_once_then_follows_the_parents_rows():
    """The stepper's logits against plain forwards of each beam's whole sequence: the prompt; three beams from it
    (row 0 gathered three times); then parents [2, 0, 0] (a reorder) and [0, 1, 2] (the rows as they are). Without
    a plan a static cache holds the prompt and one token; the policy is asked for reordering and rows."""
    from decodelab.core.kv import parse_cache_spec

    model = eos_model("llama", 0, 2.0)

    def ref(rows):
        with torch.no_grad():
            return torch.stack([model(torch.tensor([r])).logits[0, -1] for r in rows])

    def close(a, b):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    stepper = ModelStepper(model)
    stepper.plan(len(PROMPT) + 3)
    close(stepper.start(PROMPT), ref([PROMPT]))
    assert stepper.rows == 1 and stepper.runtime.policy.needs == frozenset({"reorder", "rows"})
    rows = [PROMPT + [t] for t in (1, 2, 3)]
    close(stepper.advance([0, 0, 0], torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3])), ref(rows))
    assert stepper.rows == 3
    rows = [rows[2] + [4], rows[0] + [5], rows[0] + [6]]
    close(stepper.advance([2, 0, 0], torch.tensor([2, 0, 0]), torch.tensor([4, 5, 6])), ref(rows))
    rows = [r + [7] for r in rows]
    close(stepper.advance([0, 1, 2], torch.tensor([0, 1, 2]), torch.tensor([7, 7, 7])), ref(rows))

    static = ModelStepper(model, parse_cache_spec("static"))
    close(static.start(PROMPT), ref([PROMPT]))
    assert static.runtime.policy.capacity == len(PROMPT) + 1
    close(static.advance([0, 0], torch.tensor([0, 0]), torch.tensor([1, 2])), ref([PROMPT + [1], PROMPT + [2]]))
    with pytest.raises(ConfigError, match=f"{len(PROMPT) + 2} positions exceed the preallocated {len(PROMPT) + 1}"):
        static.advance([0, 1], torch.tensor([0, 1]), torch.tensor([1, 2]))


def test_model_stepper_keeps_a_given_capacity_and_runtime():
    """A capacity given up front wins over the search's plan; a runtime given is the one fed (no other is made)."""
    from decodelab.core.engine.runtime import Runtime
    from decodelab.core.kv import parse_cache_spec

    model = eos_model("llama", 0, 2.0)
    sized = ModelStepper(model, parse_cache_spec("static"), capacity=len(PROMPT) + 5)
    sized.plan(len(PROMPT) + 9)
    sized.start(PROMPT)
    assert sized.capacity == sized.runtime.policy.capacity == len(PROMPT) + 5
    planned = ModelStepper(model, parse_cache_spec("static"))
    planned.plan(len(PROMPT) + 9)
    planned.start(PROMPT)
    assert planned.runtime.policy.capacity == len(PROMPT) + 9
    runtime = Runtime.create(model)
    given = ModelStepper(model, runtime=runtime)
    given.start(PROMPT)
    assert given.runtime is runtime and runtime.calls == 1 and runtime.seen == len(PROMPT)


def test_a_live_bound_equal_to_the_worst_finished_score_stops_the_search():
    """transformers stops when the best live beam cannot do strictly better. Beams 1, hf, a = 1, at most 2 tokens, p =
    (E .5, a .25, b .25): step 0 finishes [E] (log .5 / 1) and keeps a beam of log .25 = 2 log .5, whose bound at the
    longest length is log .25 / 2 = log .5 exactly: a tie, so "never" stops after one step."""
    search = run_table(settings(1, 1.0, "never", 2), table={(): [0.5, 0.25, 0.25]}, other=[0.5, 0.25, 0.25])
    assert (search.stop_reason, search.n_steps) == ("no-improvement", 1)
    assert search.hypotheses[0].token_ids == [E]


def test_length_norm_refuses_an_unknown_kind_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        length_norm("log", 3, 2, 1.0)
    assert str(err.value) == "--length-norm 'log': allowed: hf, gnmt, prompt-inclusive, none"
    assert length_norm("hf", 3, 2, 0.5) == 3 ** 0.5 and length_norm("gnmt", 1, 9, 2.0) == 1.0
    assert length_norm("prompt-inclusive", 3, 2, -1.0) == 1 / 5 and length_norm("none", 7, 2, -3.0) == 1.0


class ClockStepper(TableStepper):
    """TABLE's stepper on a fake clock: the prefill takes 1 s, each later forward 2 s."""

    def __init__(self, clock):
        super().__init__(TABLE, OTHER)
        self.clock = clock

    def start(self, prompt_ids):
        self.clock[0] += 1.0
        return super().start(prompt_ids)

    def advance(self, parents, parents_t, tokens):
        self.clock[0] += 2.0
        return super().advance(parents, parents_t, tokens)


def test_the_search_times_prefill_loop_and_trace_apart_and_never_the_consumer(monkeypatch):
    """On a fake clock, beams 2, 3 steps: 1 s of prefill, 2 x 2 s of forwards after it, and, recorded, the trace's
    token texts at 0.5 s each (4 candidates a step: 6 s); the 100 s the consumer spends on each step count nowhere."""
    from types import SimpleNamespace

    from decodelab.core.engine import run as run_mod

    clock = [0.0]
    monkeypatch.setattr(run_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def text(token):
        clock[0] += 0.5
        return str(token)

    for record, trace in ((True, 6.0), (False, 0.0)):
        search = BeamSearch(ClockStepper(clock), [7, 8], build_chain({}), settings(2, 1.0, "never", 3), eos_ids=(E,),
                            record=record, token_text=text)
        for _ in search:
            clock[0] += 100.0
        timing = search.watch.timing
        assert (timing.prefill_s, timing.loop_s, timing.trace_s) == (1.0, 4.0, trace), record
        assert search.summary().seconds == 5.0 + trace and search.summary().decode_tokens_per_s == 6 / 4.0


def test_the_context_caps_only_past_it_and_a_prompt_filling_it_is_refused():
    """A 2-token prompt and 3 new tokens fit a context of 5 exactly (not capped); a context of 4 leaves 2; a context of
    2 leaves none and is refused before anything runs. EOS ignored: E never finishes a hypothesis."""
    s = settings(2, 1.0, "never", 3)
    fits = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), s, eos_ids=(E,), context_length=5)
    assert (fits.max_new, fits.capped) == (3, False)
    fits.run()
    assert fits.stop_reason == "length" and [h.reason for h in fits.hypotheses] == ["eos", "length"]
    capped = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), s, eos_ids=(E,), context_length=4)
    assert (capped.max_new, capped.capped) == (2, True)
    with pytest.raises(ConfigError) as err:
        BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), s, eos_ids=(E,), context_length=2)
    assert str(err.value) == "PROMPT: the prompt is 2 tokens but the model's context is 2; shorten it"
    deaf = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), replace(s, ignore_eos=True), eos_ids=(E,))
    assert deaf.eos == frozenset() and fits.eos == frozenset({E})
    deaf.run()
    assert all(h.reason == "length" and h.length == 3 for h in deaf.hypotheses)
    assert (deaf.pool[0].token_ids, deaf.stop_reason) == ([A, A, E], "length")


def test_a_finishing_candidate_no_better_than_a_full_pool_is_rejected():
    """Beams 1, hf, a = 1. Table 1 (2 tokens): step 0 finishes [E] (log .6) and keeps [a]; step 1 (the last) ranks
    [a, E] (log(.4 x .6) / 2 = -0.714) first: worse than [E] (-0.511), so rejected, and [a, a] after it is pruned;
    1 entered. Table 2 (3 tokens): [E] (log .5), then [a, E] of log .25 / 2 = log .5 exactly: a tie, which the pool
    (strictly better only) rejects too, and the -inf candidate left live bounds nothing: "no-improvement"."""
    one = run_table(settings(1, 1.0, "never", 2), table={(): [0.6, 0.4, 0.0], (A,): [0.6, 0.4, 0.0]}, record=True)
    assert [[c.fate for c in step.candidates] for step in one.steps] == [["finished", "live"], ["rejected", "pruned"]]
    assert [c.token_id for c in one.steps[1].candidates] == [E, A]
    assert one.entered == 1 and one.summary().entered == 1 and [h.token_ids for h in one.hypotheses] == [[E]]
    assert one.steps[1].candidates[0].score == pytest.approx(math.log(0.4 * 0.6) / 2, abs=1e-6)
    tie = run_table(settings(1, 1.0, "never", 3), table={(): [0.5, 0.25, 0.25], (A,): [1, 0, 0], (B,): [1, 0, 0]},
                    record=True)
    first, second = tie.steps[1].candidates
    assert (first.token_id, first.fate, first.score) == (E, "rejected", tie.hypotheses[0].score)
    assert (second.fate, second.sum_logprob) == ("live", float("-inf"))
    assert (tie.entered, tie.stop_reason, tie.n_steps) == (1, "no-improvement", 2)
    assert [h.token_ids for h in tie.hypotheses] == [[E]]


def test_a_search_left_early_or_emptied_at_once_keeps_its_first_figures():
    """Left by its consumer after one step, a search's stop reason is still "length"; a chain that removes every
    token at the first step raises before any step counts: 0 steps, 0 forward tokens."""
    from decodelab.core.sampling.chain import ChainError

    left = BeamSearch(TableStepper(TABLE, OTHER), [7, 8], build_chain({}), settings(2, 1.0, "never", 3), eos_ids=(E,))
    assert left.stop_reason == "length" and left.n_steps == 0 and left.entered == 0 and left.pool == []
    next(iter(left))
    assert (left.stop_reason, left.n_steps) == ("length", 1)
    # only "a" allowed, and no-repeat-ngram 1 bans it already: the prompt is "a"
    empty = BeamSearch(TableStepper(TABLE, OTHER), [A], build_chain({"allow": (A,), "no-repeat-ngram": 1}),
                       settings(1, 1.0, "never", 3), eos_ids=(E,))
    with pytest.raises(ChainError):
        empty.run()
    assert (empty.n_steps, empty.summary().steps, empty.summary().forward_tokens) == (0, 0, 0)


def test_an_unrecorded_search_spends_no_time_on_a_trace():
    """On the real clock: the time after a step's last lap (building its bare record) counts as the loop's, never
    as a trace it did not build."""
    timing = run_table(settings(2, 1.0, "never", 3)).watch.timing
    assert timing.trace_s == 0.0 and timing.loop_s > 0
    assert run_table(settings(2, 1.0, "never", 3), record=True).watch.timing.trace_s > 0


def test_a_deep_beam_tree_is_readable_at_80_columns(cli, monkeypatch):
    """Issue 40: the README's beam example at 80 columns folded deep labels into 4-column slivers ("<|en" / "doft" /
    "ext|"). Past COLLAPSED_DEPTH levels a live beam's children restart at the left margin under "↳ step k,
    continued:", so every label is whole on one line and no line is wider than 80."""
    from rich.cells import cell_len

    from decodelab.cli.view.beam_view import COLLAPSED_DEPTH

    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("beam", "grok: vt. To", "-n", "24", "--beams", "4", "-m", "tiny", "--tree", "collapsed",
                         "--threads", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert any(line.startswith(f"↳ step {COLLAPSED_DEPTH - 1}, continued: ") for line in lines)
    tree = [line for line in lines if "Σ" in line or "── " in line]
    assert all("Σ" in line for line in tree), [line for line in tree if "Σ" not in line][:3]  # no folded label
