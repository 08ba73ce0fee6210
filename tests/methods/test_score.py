"""`score` against oracles that do not use the score machinery: a banded-mask forward for a window cache (what a
decoding step under `window:size=W` attends to), and per-chunk perplexities of a full forward when the chunk size
does not divide the text."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from conftest import random_model

from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.score import Scorer, ScoreSettings, score_feed, validate_score
from decodelab.core.sampling.chain import build_chain

IDS = [int(i) for i in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))]


def banded_logprobs(model, ids: list[int], span: int) -> torch.Tensor:
    """log softmax of one forward in which query i attends to keys max(0, i - span + 1) .. i only, at the tokens'
    own positions: what a decoding step sees under `window:size=span-1,positions=keep` (the W cached tokens and
    itself). Independent of the runtime and the cache classes."""
    t = len(ids)
    i = torch.arange(t)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - span)
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=mask).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def scored(logp: torch.Tensor, ids: list[int]) -> list[float]:
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_a_window_cache_is_scored_as_decoding_sees_it_by_default():
    """The bug: the whole text in one forward never reads what window:size=W keeps, so `--against-cache full`
    reported KL 0. By default a policy that acts between forwards is fed one token a forward, and every token's
    log-probability is the banded-mask forward's."""
    model = random_model("llama", seed=6, scale=2.0)
    window = 6
    settings = ScoreSettings(cache=f"window:size={window}", against_cache="full")
    scorer = Scorer(model, IDS, build_chain({}), str, settings, cache=parse_cache_spec(settings.cache),
                    reference=model, reference_cache=parse_cache_spec("full"), reference_name="full")
    rows = list(scorer)
    summary = scorer.summary()
    assert summary.feed == 1
    assert [r.raw_logprob for r in rows] == pytest.approx(scored(banded_logprobs(model, IDS, window + 1), IDS),
                                                          abs=1e-4)
    assert [r.reference_logprob for r in rows] == pytest.approx(scored(full_logprobs(model, IDS), IDS), abs=1e-4)
    assert summary.kl_mean > 1e-3 and summary.top1_agreement < 1
    # the first window + 1 tokens see everything before them: no cost there
    assert max(r.kl for r in rows[:window]) == pytest.approx(0.0, abs=1e-5)


def test_the_feed_is_the_whole_text_only_when_every_policy_is_feed_invariant():
    full, window = parse_cache_spec("full"), parse_cache_spec("window:size=4")
    assert score_feed(None, [full, None], 40) == 39
    assert score_feed(None, [parse_cache_spec("static"), parse_cache_spec("recompute:size=5")], 40) == 39
    for lossy in ("window:size=4", "sinks:sinks=1,recent=3", "int8", "int4-kivi", "h2o:size=4", "knorm:size=4,"
                  "compress=decode"):
        assert score_feed(None, [full, parse_cache_spec(lossy)], 40) == 1, lossy
        assert score_feed(None, [parse_cache_spec(lossy), None], 40) == 1, lossy
    assert score_feed(7, [window, None], 40) == 7  # --feed wins


@pytest.mark.parametrize("cache", ["snapkv:ratio=0.5", "pyramidkv:ratio=0.5", "knorm:ratio=0.5"])
def test_a_press_that_compresses_once_needs_feed(cache):
    """compress=prefill acts after the first forward only; a scored text has no prompt, so --feed says where it
    ends (fed one token a forward, it would compress one token and never evict anything)."""
    with pytest.raises(ConfigError, match=rf"^--cache {cache.split(':')[0]}:.*compresses once.*give --feed N"):
        validate_score(ScoreSettings(cache=cache))
    with pytest.raises(ConfigError, match=r"^--against-cache .*give --feed N"):
        validate_score(ScoreSettings(against_cache=cache))
    validate_score(ScoreSettings(cache=cache, feed=16))


def test_the_last_chunk_of_a_text_the_chunk_size_does_not_divide():
    """39 scored tokens in chunks of 10: the last chunk holds 9 tokens and its perplexity is theirs alone."""
    model = random_model("qwen2", seed=5, scale=2.0)
    nll = [-x for x in scored(full_logprobs(model, IDS), IDS)]
    scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings(chunk=10))
    list(scorer)
    chunks = scorer.summary().chunks
    assert [(c.start, c.end) for c in chunks] == [(1, 11), (11, 21), (21, 31), (31, 40)]
    expected = [math.exp(sum(nll[a : a + 10]) / len(nll[a : a + 10])) for a in range(0, 39, 10)]
    assert [c.perplexity for c in chunks] == pytest.approx(expected, rel=1e-5)


def test_cli_score_against_full_under_a_window_reports_its_cost(cli, toy_model_dir):
    text = "Once upon a time there was a compiler that read every line twice and then once more."
    args = ("score", text, "-m", toy_model_dir, "--cache", "window:size=4", "--against-cache", "full", "-f", "json")
    code, out, err = cli(*args)
    assert code == 0, err
    default = json.loads(out)["summary"]
    code, out, err = cli(*args, "--feed", "1")
    assert code == 0, err
    one = json.loads(out)["summary"]
    assert default["feed"] == 1 and default["kl_mean"] > 0 and default["kl_mean"] == pytest.approx(one["kl_mean"])
    code, _, err = cli("score", text, "-m", toy_model_dir, "--cache", "knorm:ratio=0.5")
    assert code == 2 and err.startswith("error: --cache knorm:") and "--feed N" in err and "\n" not in err.strip()


@pytest.mark.parametrize("cache", ["h2o:size=6", "tova:size=6", "knorm:size=6,compress=decode", "int4-kivi",
                                   "sinks:sinks=2,recent=4"])
def test_every_policy_that_acts_between_forwards_shows_a_cost_by_default(cache):
    """The presses that compress after every forward, the quantized cache and the sinks, against the full cache on
    the same model: fed one token a forward by default, each costs something (fed the whole text at once, each
    would report KL 0)."""
    model = random_model("llama", seed=6, scale=2.0)
    kl = {}
    for feed in (None, len(IDS) - 1):
        settings = ScoreSettings(cache=cache, against_cache="full", feed=feed)
        validate_score(settings)
        scorer = Scorer(model, IDS, build_chain({}), str, settings, cache=parse_cache_spec(cache), reference=model,
                        reference_cache=parse_cache_spec("full"), reference_name="full")
        list(scorer)
        kl[scorer.summary().feed] = scorer.summary().kl_mean
    assert kl[len(IDS) - 1] < 1e-12 < 1e-9 < kl[1]


def test_a_summary_before_any_token_and_the_mean_nll():
    """Interrupted before the first block: no tokens, every figure NaN, no chunks. After a run: mean_nll is the
    mean of -raw_logprob and perplexity its exp."""
    model = random_model("llama", seed=6, scale=2.0)
    empty = Scorer(model, IDS, build_chain({}), str, ScoreSettings()).summary()
    assert empty.tokens == 0 and empty.chunks == [] and math.isnan(empty.perplexity) and math.isnan(empty.mean_nll)
    assert math.isnan(empty.processed_mean_logprob) and empty.kl_mean is None
    scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings())
    rows = list(scorer)
    s = scorer.summary()
    assert s.mean_nll == pytest.approx(-sum(r.raw_logprob for r in rows) / len(rows))
    assert s.perplexity == pytest.approx(math.exp(s.mean_nll)) and [(c.start, c.end) for c in s.chunks] == [(1, 40)]


@pytest.mark.parametrize("settings, message", [
    (ScoreSettings(limit=0), "--limit 0: must be an integer >= 1"),
    (ScoreSettings(chunk=0), "--chunk 0: must be an integer >= 1"),
    (ScoreSettings(feed=-2), "--feed -2: must be an integer >= 1"),
    (ScoreSettings(top=-1), "--top -1: must be >= 0"),
    (ScoreSettings(cache="snapkv:ratio=0.5"), "--cache snapkv:kernel=5,pool=max,ratio=0.5,window=32: it compresses "
     "once, after the prompt, and a scored text has no prompt; give --feed N or --prefill N (the first N tokens are "
     "the prompt it compresses, the rest are scored as decoded) or compress=decode where the press has it"),
    (ScoreSettings(prefill=0), "--prefill 0: must be an integer >= 1"),
])
def test_score_refusals_are_whole_lines(settings, message):
    with pytest.raises(ConfigError) as err:
        validate_score(settings)
    assert str(err.value) == message
    validate_score(ScoreSettings(limit=1, chunk=1, feed=1, top=0))


def test_cli_score_against_another_model_reads_it_under_the_full_cache(cli, toy_model_dir):
    """--against alone: the reference is that model under the full cache, named with its cache; the same model as
    reference gives KL 0."""
    code, out, err = cli("score", "Once upon a time there was a compiler.", "-m", toy_model_dir, "--against",
                         toy_model_dir, "--cache", "window:size=4", "-f", "json")
    assert code == 0, err
    s = json.loads(out)["summary"]
    assert s["reference"].endswith("(cache full)") and s["feed"] == 1 and s["kl_mean"] > 0
    code, out, err = cli("score", "Once upon a time there was a compiler.", "-m", toy_model_dir, "--against",
                         toy_model_dir, "-f", "json")
    s = json.loads(out)["summary"]
    assert code == 0 and s["kl_mean"] == pytest.approx(0.0, abs=1e-9) and s["feed"] > 1


def test_ranks_entropies_and_the_summary_against_a_full_forward():
    """Per token: raw_rank = 1 + the tokens the model ranks strictly above it, raw_entropy = H of its softmax,
    logprob = log softmax of the chain's logits (temperature 0.7). The summary: means of the rows, the reference's
    name as given, and most_different's fields for the 3 largest |difference|."""
    model = random_model("llama", seed=6, scale=2.0)
    logp = full_logprobs(model, IDS)
    chain = build_chain({"temperature": 0.7})
    window = parse_cache_spec("window:size=6")
    scorer = Scorer(model, IDS, chain, str, ScoreSettings(top=3), reference=model, reference_cache=window,
                    reference_name="ref")
    rows = list(scorer)
    s = scorer.summary()
    z = torch.log_softmax(logp / 0.7, dim=-1)  # (z - c) / T renormalized: the tempered distribution
    for r in rows:
        row = logp[r.position - 1]
        assert r.raw_rank == 1 + int((row > row[r.token_id]).sum())
        assert r.raw_entropy == pytest.approx(float(-(row.exp() * row).sum()), abs=1e-4)
        assert r.logprob == pytest.approx(float(z[r.position - 1, r.token_id]), abs=1e-4)
    assert [r.reference_logprob for r in rows] == pytest.approx(scored(banded_logprobs(model, IDS, 7), IDS), abs=1e-4)
    assert s.processed_mean_logprob == pytest.approx(sum(r.logprob for r in rows) / len(rows))
    assert s.kl_mean == pytest.approx(sum(r.kl for r in rows) / len(rows)) and s.kl_mean > 0
    assert s.top1_agreement == sum(r.agree for r in rows) / len(rows) and s.reference == "ref"
    assert s.reference_perplexity == pytest.approx(math.exp(-sum(r.reference_logprob for r in rows) / len(rows)))
    assert s.stop_reason == "end" and 0 < s.tokens_per_s < float("inf") and s.feed == 1
    ranked = sorted(rows, key=lambda r: -abs(r.raw_logprob - r.reference_logprob))[:3]
    assert s.most_different == [{"position": r.position, "token_id": r.token_id, "token": r.token,
                                 "raw_logprob": r.raw_logprob, "reference_logprob": r.reference_logprob,
                                 "difference": r.raw_logprob - r.reference_logprob, "kl": r.kl} for r in ranked]
    assert [r.raw_rank for r in rows].count(1) < len(rows)  # not every token is the model's favourite


def test_a_static_cache_scores_as_the_full_one():
    """static preallocates the text's length (the scorer says how long): the same log-probabilities as full."""
    model = random_model("qwen2", seed=5, scale=2.0)
    rows = list(Scorer(model, IDS, build_chain({}), str, ScoreSettings(cache="static"),
                       cache=parse_cache_spec("static")))
    assert [r.raw_logprob for r in rows] == pytest.approx(scored(full_logprobs(model, IDS), IDS), abs=1e-4)


def test_a_press_under_prefill_alone_compresses_the_prompt_then_scores_one_token_a_forward():
    """--prefill N without --feed: the first N tokens are one forward (the prompt the press compresses), then one
    token a forward (score_feed: a press acts between forwards). The same rows as --prefill N --feed 1; the
    prompt's rows are the full cache's (one forward sees itself exactly) and the later ones read what it kept."""
    model = random_model("llama", seed=7, scale=2.0)
    spec, full = parse_cache_spec("snapkv:ratio=0.25,window=4"), parse_cache_spec("full")
    validate_score(ScoreSettings(cache="snapkv:ratio=0.25,window=4", prefill=16))
    runs = {}
    for feed in (None, 1):
        scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings(feed=feed, prefill=16), cache=spec,
                        reference=model, reference_cache=full, reference_name="full")
        runs[feed] = list(scorer)
        assert scorer.summary().feed == 1
    assert [r.raw_logprob for r in runs[None]] == [r.raw_logprob for r in runs[1]]
    assert max(r.kl for r in runs[None][:16]) == pytest.approx(0.0, abs=1e-5)
    assert max(r.kl for r in runs[None][16:]) > 1e-4  # the press evicted 3/4 of the prompt


def test_the_shortest_text_is_two_tokens_and_one_is_refused_in_one_line():
    """Two tokens: the first is context, one token is scored, from one forward of one token (score_feed gives 1,
    the text minus its last token, never 2). One token: nothing to score, refused with the count."""
    model = random_model("llama", seed=8, scale=2.0)
    assert score_feed(None, [None], 2) == 1
    scorer = Scorer(model, IDS[:2], build_chain({}), str, ScoreSettings())
    rows = list(scorer)
    assert [r.position for r in rows] == [1] and scorer.summary().feed == 1
    assert rows[0].raw_logprob == pytest.approx(scored(full_logprobs(model, IDS[:2]), IDS[:2])[0], abs=1e-5)
    with pytest.raises(ConfigError) as err:
        Scorer(model, IDS[:1], build_chain({}), str, ScoreSettings())
    assert str(err.value) == "TEXT: 1 token(s); scoring needs at least 2 (the first is context)"


# --- mutation run of core/methods/score.py (2026-12-01, helper mutbeam): what its survivors asked for -----------------


def test_blocks_cover_every_fed_position_once_by_hand():
    """Positions 0 .. T - 2 are fed (the last token never is): in blocks of `feed`, the last one shorter when feed
    does not divide T - 1; a prefill block first when given, cut to T - 1 when longer than the text."""
    from decodelab.core.methods.score import blocks

    assert blocks(10, 3) == [(0, 3), (3, 6), (6, 9)]
    assert blocks(11, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert blocks(10, 3, prefill=5) == [(0, 5), (5, 8), (8, 9)]
    assert blocks(10, 3, prefill=20) == [(0, 9)]
    assert blocks(10, 100) == [(0, 9)] and blocks(2, 5) == [(0, 1)] and blocks(3, 1) == [(0, 1), (1, 2)]
    assert blocks(1, 3) == [] and blocks(1, 3, prefill=2) == []  # one token: no position is fed (helper mutcs)


def test_chunks_of_one_token_and_of_the_whole_text():
    """--chunk 1: one chunk per scored token, its perplexity exp(-raw_logprob); --chunk 39 and 100 on 39 scored
    tokens: one chunk, the text's perplexity."""
    model = random_model("qwen2", seed=5, scale=2.0)
    for chunk in (1, 39, 100):
        scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings(chunk=chunk))
        rows = list(scorer)
        s = scorer.summary()
        if chunk == 1:
            assert [(c.start, c.end) for c in s.chunks] == [(r.position, r.position + 1) for r in rows]
            assert [c.perplexity for c in s.chunks] == pytest.approx([math.exp(-r.raw_logprob) for r in rows])
        else:
            assert [(c.start, c.end) for c in s.chunks] == [(1, 40)]
            assert s.chunks[0].perplexity == pytest.approx(s.perplexity)


def test_an_interrupted_score_says_so_and_covers_the_rows_it_scored():
    """Interrupted after the first of four blocks (feed 10): the summary has its 10 rows and says "interrupted"."""
    model = random_model("llama", seed=6, scale=2.0)
    scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings(feed=10, chunk=4))
    rows = list(itertools.islice(scorer, 10))
    scorer.interrupt()
    s = scorer.summary()
    assert (s.stop_reason, s.tokens, s.feed) == ("interrupted", 10, 10)
    assert [(c.start, c.end) for c in s.chunks] == [(1, 5), (5, 9), (9, 11)]
    assert s.mean_nll == pytest.approx(-sum(r.raw_logprob for r in rows) / 10)


# --- mutation run of the rest of core/methods/score.py (2026-12-01, helper mutcs): what its survivors asked for ------

REPEATS = IDS[:9] * 3 + IDS[9:13]  # 31 tokens, each of the first 9 seen again: the penalty reaches them


def test_a_chain_that_reads_the_prefix_scores_each_row_against_its_own_prefix():
    """processed_logprobs and --kept-ids under the repetition penalty (a stage that reads the ids): row p is scored
    from the logits after positions 0 .. p - 1 with exactly the tokens 0 .. p - 1 penalised. Oracle: transformers'
    own RepetitionPenaltyLogitsProcessor and top-k over a full forward, prefix by prefix. Feed 4 over 31 tokens puts
    rows at r > 0 inside blocks that start past 0, the last block shorter (30 fed positions)."""
    from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

    model = random_model("llama", seed=6, scale=2.0)
    with torch.no_grad():
        logits = model(torch.tensor([REPEATS])).logits[0].float()
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    rows = list(Scorer(model, REPEATS, build_chain({"repetition-penalty": 1.8}), str, ScoreSettings(feed=4)))
    assert [r.position for r in rows] == list(range(1, len(REPEATS)))
    for r in rows:  # the whole distribution after the penalty: its normalizer sees every penalised token
        prefix = torch.tensor([REPEATS[: r.position]])
        expected = torch.log_softmax(penalty(prefix, logits[r.position - 1 : r.position].clone()), dim=-1)
        assert r.logprob == pytest.approx(float(expected[0, r.token_id]), abs=1e-4), r.position
    # a penalty below 1 multiplies a seen token's positive logit by 20: the top 3 are mostly the prefix's own
    # tokens, so the set changes with each token the prefix gains (the latest one included)
    boost, top_k = RepetitionPenaltyLogitsProcessor(0.05), TopKLogitsWarper(3)
    settings = ScoreSettings(feed=4, kept_ids=True)
    rows = list(Scorer(model, REPEATS, build_chain({"repetition-penalty": 0.05, "top-k": 3}), str, settings))
    for r in rows:
        prefix = torch.tensor([REPEATS[: r.position]])
        z = top_k(prefix, boost(prefix, logits[r.position - 1 : r.position].clone()))
        assert sorted(r.kept_sets[-1]["ids"]) == torch.isfinite(z[0]).nonzero()[:, 0].tolist(), r.position


def test_kl_agreement_and_kept_mass_together_against_a_full_and_a_banded_forward():
    """--renormalize with a reference (the reference's columns come after the two kept columns): per row,
    KL(ref || model) = sum_k p_ref(k) (log p_ref(k) - log p(k)), agree = the two argmaxes are equal, kept_mass =
    the raw mass of the top-4 set, from a full forward (the model) and a banded one (the reference under a window)."""
    model = random_model("llama", seed=6, scale=2.0)
    logp, ref = full_logprobs(model, IDS), banded_logprobs(model, IDS, 7)
    scorer = Scorer(model, IDS, build_chain({"top-k": 4}), str, ScoreSettings(renormalize=True), reference=model,
                    reference_cache=parse_cache_spec("window:size=6"), reference_name="ref")
    rows = list(scorer)
    agree = []
    for r in rows:
        p, q = logp[r.position - 1], ref[r.position - 1]
        assert r.kl == pytest.approx(float((q.exp() * (q - p)).sum()), abs=1e-4)
        assert r.agree == (int(p.argmax()) == int(q.argmax()))
        assert r.reference_logprob == pytest.approx(float(q[r.token_id]), abs=1e-4)
        assert r.kept_mass == pytest.approx(float(p.exp().topk(4).values.sum()), abs=1e-4)
        assert r.raw_logprob == pytest.approx(float(p[r.token_id]), abs=1e-4)
        assert r.token == str(r.token_id) == str(IDS[r.position])
        agree.append(r.agree)
    assert True in agree and False in agree  # both answers occur, so neither constant passes


def fake_lm(tokens: int, context: int | None):
    """What scored_ids reads of a loaded model: encode (one token a character here), name, context_length."""
    from types import SimpleNamespace

    return SimpleNamespace(encode=lambda text: list(range(len(text))), name="toy", context_length=context)


def test_scored_ids_takes_a_text_of_exactly_the_context_and_refuses_one_token_more():
    from decodelab.core.methods.score import UNKNOWN_CONTEXT_TOKENS, scored_ids

    assert scored_ids(fake_lm(8, 8), "x" * 8, ScoreSettings()) == list(range(8))  # len == context: taken
    assert scored_ids(fake_lm(9, 8), "x" * 9, ScoreSettings(limit=3)) == [0, 1, 2]  # --limit cuts first
    with pytest.raises(ConfigError) as e:
        scored_ids(fake_lm(9, 8), "x" * 9, ScoreSettings())
    assert str(e.value) == ("TEXT: 9 tokens, more than the context of 'toy' (8); pass --limit 8 to score the first 8, "
                            "or --limit 9 for all of them (memory grows with it), or score it under a bounded cache "
                            "with `decodelab stream --text-file`")
    n = UNKNOWN_CONTEXT_TOKENS  # a model that states no context length: 2**16
    assert len(scored_ids(fake_lm(n, None), "x" * n, ScoreSettings())) == n
    with pytest.raises(ConfigError) as e:
        scored_ids(fake_lm(n + 1, None), "x" * (n + 1), ScoreSettings(), option="--text-file")
    assert str(e.value).startswith(f"--text-file: {n + 1} tokens, more than what score takes without --limit ({n}); "
                                   f"pass --limit {n} to score the first {n}, or --limit {n + 1} for all")


def test_validate_score_checks_the_choice_settings():
    """--choice with another stage set is refused by validate_score itself (check_choice_settings on the settings)."""
    with pytest.raises(ConfigError, match=r"^--choice .*drop the top-k stage$"):
        validate_score(ScoreSettings(choice="yes,no", top_k=5))


def test_without_a_stage_the_processed_logprob_is_the_raw_one_of_a_full_forward():
    """The empty chain (processed_logprobs' first branch): logprob = raw_logprob = log softmax over the vocabulary
    of a full forward, in one block of 39 rows (a softmax over the rows instead would not sum to 1 per row)."""
    model = random_model("llama", seed=6, scale=2.0)
    scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings())
    rows = list(scorer)
    assert scorer.feed == len(IDS) - 1
    expected = scored(full_logprobs(model, IDS), IDS)
    assert [r.logprob for r in rows] == pytest.approx(expected, abs=1e-4)
    assert [r.raw_logprob for r in rows] == pytest.approx(expected, abs=1e-4)


def test_a_reference_model_in_one_block_of_many_rows_agrees_row_by_row():
    """--against another model under the full cache: one forward of 39 rows for each (score_feed), and per row
    agree = its own two argmaxes equal, KL and the reference's log-probability from two full forwards."""
    model, other = random_model("llama", seed=6, scale=2.0), random_model("llama", seed=7, scale=2.0)
    logp, ref = full_logprobs(model, IDS), full_logprobs(other, IDS)
    scorer = Scorer(model, IDS, build_chain({}), str, ScoreSettings(), reference=other, reference_cache=None)
    rows = list(scorer)
    assert scorer.feed == len(IDS) - 1
    assert [r.agree for r in rows] == (logp.argmax(dim=-1) == ref.argmax(dim=-1))[:-1].tolist()
    assert [r.kl for r in rows] == pytest.approx(((ref.exp() * (ref - logp)).sum(dim=-1))[:-1].tolist(), abs=1e-4)
    assert [r.reference_logprob for r in rows] == pytest.approx(scored(ref, IDS), abs=1e-4)
    assert True in [r.agree for r in rows] and False in [r.agree for r in rows]


# --- mutation run of core/methods/score.py, the rest (2026-12-02, helper mbeam) ------------------------------------


def test_a_scored_token_writes_only_the_fields_its_run_has():
    """The seven fields of every row; the reference's three only with a reference (kl set), the kept mass and its
    log-probability only under --renormalize, the kept sets only with --kept-ids."""
    from decodelab.core.methods.score import ScoredToken

    base = {"position": 3, "token_id": 7, "token": "x", "raw_logprob": -1.0, "raw_rank": 2, "raw_entropy": 0.5,
            "logprob": -1.25}
    assert ScoredToken(3, 7, "x", -1.0, 2, 0.5, -1.25).to_dict() == base
    with_ref = ScoredToken(3, 7, "x", -1.0, 2, 0.5, -1.25, reference_logprob=-0.75, kl=0.125, agree=False)
    assert with_ref.to_dict() == {**base, "reference_logprob": -0.75, "kl": 0.125, "agree": False}
    kept = ScoredToken(3, 7, "x", -1.0, 2, 0.5, -1.25, kept_mass=0.5, kept_logprob=-0.25)
    assert kept.to_dict() == {**base, "kept_mass": 0.5, "kept_logprob": -0.25}
    sets = [{"name": "top-k", "kept": 3, "ids": [1, 2, 7]}]
    assert ScoredToken(3, 7, "x", -1.0, 2, 0.5, -1.25, kept_sets=sets).to_dict() == {**base, "kept_sets": sets}


def test_build_scorer_scores_the_reference_under_its_own_cache_or_model():
    """--against-cache window:size=4 on the same model: the reference is that model under the window, so its
    log-probabilities are the banded forward's and the KL is not 0 past the window; --against another model: that
    model under the full cache, named with it."""
    from types import SimpleNamespace

    from decodelab.core.methods.score import build_scorer

    model = random_model("llama", scale=4.0)
    lm = SimpleNamespace(model=model, token_text=str, name="toy")
    scorer = build_scorer(lm, ScoreSettings(against_cache="window:size=4"), IDS[:12], build_chain({}))
    assert (scorer.reference, scorer.reference_cache) == (model, parse_cache_spec("window:size=4"))
    assert scorer.reference_name == f"toy (cache {parse_cache_spec('window:size=4')})"
    rows = list(scorer)
    banded = banded_logprobs(model, IDS[:12], 4 + 1)  # the 4 cached tokens and itself
    assert [r.reference_logprob for r in rows] == pytest.approx(scored(banded, IDS[:12]), abs=1e-4)
    assert max(r.kl for r in rows) > 1e-3
    other = SimpleNamespace(model=random_model("llama", seed=5), token_text=str, name="other")
    against = build_scorer(lm, ScoreSettings(against="other"), IDS[:12], build_chain({}), reference=other)
    assert (against.reference, against.reference_cache) == (other.model, parse_cache_spec("full"))
    assert against.reference_name == f"other (cache {parse_cache_spec('full')})"
    plain = build_scorer(lm, ScoreSettings(), IDS[:12], build_chain({}))
    assert (plain.reference, plain.reference_cache, plain.reference_name) == (None, None, None)


def test_policies_by_option_and_a_bad_reference_cache_named_as_its_own_option():
    """--cache always; --against-cache when given, or the full cache when only --against is; a bad reference policy
    is refused naming --against-cache, not --cache."""
    from decodelab.core.methods.score import policies

    assert policies(ScoreSettings()) == {"--cache": parse_cache_spec("full")}
    assert policies(ScoreSettings(against="other")) == {"--cache": parse_cache_spec("full"),
                                                        "--against-cache": parse_cache_spec("full")}
    assert policies(ScoreSettings(cache="window:size=3", against_cache="static")) == \
        {"--cache": parse_cache_spec("window:size=3"), "--against-cache": parse_cache_spec("static")}
    with pytest.raises(ConfigError) as err:
        policies(ScoreSettings(against_cache="window:size=0"))
    assert str(err.value) == "--against-cache 'window:size=0': size must be an integer >= 1"


def test_stages_that_count_generated_tokens_count_from_the_second_token():
    """The first token is context: under min-new-tokens 2 with end id 3, the text [5, 3, 7, 3, 9] has its first 3
    (position 1, 0 tokens generated before it) removed, and its second (position 3, 2 generated before it) kept, at
    the model's own log-probability."""
    from decodelab.core.sampling.biases import MinNewTokens
    from decodelab.core.sampling.chain import Chain

    model = random_model("llama", scale=2.0)
    ids = [5, 3, 7, 3, 9]
    rows = list(Scorer(model, ids, Chain([MinNewTokens(2, (3,))]), str, ScoreSettings()))
    assert [r.position for r in rows] == [1, 2, 3, 4]
    assert rows[0].logprob == float("-inf")
    assert rows[2].logprob == pytest.approx(rows[2].raw_logprob, abs=1e-6)
    assert rows[2].raw_logprob == pytest.approx(scored(full_logprobs(model, ids), ids)[2], abs=1e-4)


def test_a_static_reference_cache_is_sized_for_the_text():
    """--against-cache static: the reference's cache is preallocated for the whole text (it knows its length), and
    the same model under it agrees with itself everywhere."""
    from types import SimpleNamespace

    from decodelab.core.methods.score import build_scorer

    lm = SimpleNamespace(model=random_model("llama", scale=4.0), token_text=str, name="toy")
    rows = list(build_scorer(lm, ScoreSettings(against_cache="static"), IDS[:12], build_chain({})))
    assert [r.reference_logprob for r in rows] == pytest.approx([r.raw_logprob for r in rows], abs=1e-4)
    assert max(r.kl for r in rows) == pytest.approx(0.0, abs=1e-5) and all(r.agree for r in rows)


def test_a_stage_with_its_own_coin_or_state_is_refused_before_the_model_loads(cli):
    """score replays the chain at each position of the text: xtc's coin and mirostat's state make a position
    depend on more than its prefix, so no replay of them is exact: one line, exit 2, before any model is loaded
    (the model folder does not exist)."""
    tail = "draws its own coin or carries state from step to step (no replay of it is exact); drop it for this command"
    code, _, err = cli("score", "some text", "-m", "/nonexistent/model", "--set", "xtc_probability=0.5")
    assert (code, err.strip()) == (2, f"error: --xtc-probability: score replays the chain over given tokens, and xtc "
                                      f"{tail}")
    code, _, err = cli("score", "some text", "-m", "/nonexistent/model", "--set", "mirostat_tau=5")
    assert (code, err.strip()) == (2, f"error: --mirostat-tau/--mirostat-eta: score replays the chain over given "
                                      f"tokens, and mirostat {tail}")
