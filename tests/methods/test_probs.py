"""`probs` core: the next-token views after each stage, on a model or on a distribution typed in by hand.

mutation run of core/methods/probs.py (2026-12-02): the numbers below are worked by hand (a distribution typed in)
or recomputed from one forward of the model, not read back from the code.
"""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.engine.forward import forward
from decodelab.core.engine.models import LoadedModel
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.probs import (ProbsSettings, build_probs, dist_stages, given_logits, next_token_stages,
                                          stage_views)
from decodelab.core.sampling.biases import MinNewTokens
from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.settings import ChainSettings

from conftest import random_model

P4 = "0.1,0.2,0.3,0.4"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def last_probs(model, ids: list[int]) -> torch.Tensor:
    """The next-token distribution after ``ids`` (positions 0..n-1) from one forward."""
    z = forward(model, torch.tensor([ids]), None, torch.arange(len(ids)).unsqueeze(0), logits_to_keep=0)[0, -1]
    return torch.softmax(z.float(), -1)


def test_views_of_a_typed_distribution_by_hand():
    """P = (0.1, 0.2, 0.3, 0.4) through top-k 2: the raw view lists all four by probability, top-k keeps 3 and 2
    renormalized (4/7, 3/7) with their logits log 0.4 and log 0.3; every token is followed through both stages."""
    r = dist_stages(ChainSettings(top_k=2), given_logits(dist=P4))
    assert r.chain == ["top-k"] and r.vocab == 4 and r.state == {}
    raw, top_k = r.stages
    assert (raw.name, raw.kept, top_k.name, top_k.kept) == ("raw", 4, "top-k", 2)
    assert raw.entropy == pytest.approx(-sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4)), rel=1e-5)
    assert top_k.entropy == pytest.approx(-(4 / 7) * math.log(4 / 7) - (3 / 7) * math.log(3 / 7), rel=1e-5)
    assert raw.mass_removed == 0 and top_k.mass_removed == pytest.approx(0.3, abs=1e-6)
    assert [(t.token_id, t.token) for t in raw.top] == [(3, "3"), (2, "2"), (1, "1"), (0, "0")]
    assert [t.prob for t in raw.top] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert [t.logit for t in raw.top] == pytest.approx([math.log(p) for p in (0.4, 0.3, 0.2, 0.1)])
    assert [(t.token_id, t.token) for t in top_k.top] == [(3, "3"), (2, "2")]  # the removed ones are not listed
    assert [t.prob for t in top_k.top] == pytest.approx([4 / 7, 3 / 7])
    assert [t.logit for t in top_k.top] == pytest.approx([math.log(0.4), math.log(0.3)])
    assert [(t.token_id, t.token) for t in r.tokens] == [(3, "3"), (2, "2"), (1, "1"), (0, "0")]
    assert [t.logit for t in r.tokens] == pytest.approx([math.log(p) for p in (0.4, 0.3, 0.2, 0.1)])
    assert [t.raw_prob for t in r.tokens] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert [t.probs["top-k"] for t in r.tokens] == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert [t.ranks for t in r.tokens] == [{"raw": 1, "top-k": 1}, {"raw": 2, "top-k": 2}, {"raw": 3, "top-k": None},
                                           {"raw": 4, "top-k": None}]
    assert r.probs() == pytest.approx([0, 0, 3 / 7, 4 / 7]) and r.probs(0) == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_views_rank_ties_alike_and_list_top_per_stage():
    """A rank is 1 + the tokens strictly more likely: a tie shares its rank. ``top`` tokens per stage; the tokens
    followed are the union of every stage's top."""
    r = dist_stages(ChainSettings(), given_logits(dist="0.25,0.25,0.5"))
    assert [(t.token_id, t.ranks["raw"]) for t in r.tokens] == [(2, 1), (0, 2), (1, 2)]
    two = dist_stages(ChainSettings(temperature=0.5), given_logits(dist="0.1,0.2,0.3,0.4"), top=2)
    assert [[t.token_id for t in v.top] for v in two.stages] == [[3, 2], [3, 2]]
    assert [t.token_id for t in two.tokens] == [3, 2]
    # T = 0.5 squares the probabilities: 16/30 and 9/30 of the sum of squares 0.30
    assert [t.probs["temperature"] for t in two.tokens] == pytest.approx([0.16 / 0.30, 0.09 / 0.30])
    # sorted by the last stage's probability, then the raw one
    flat = dist_stages(ChainSettings(top_k=1), given_logits(logits="0,1,2"), top=3)
    assert [t.token_id for t in flat.tokens] == [2, 1, 0]


def test_a_token_only_a_later_stage_lists_is_followed_from_its_column():
    """Stage views list their own top tokens; a token first listed by a later stage is still followed through every
    stage, with its own raw logit and probabilities (top 1: raw lists 0, the min-new-tokens ban lists 1)."""
    r = dist_stages(ChainSettings(min_new_tokens=2), given_logits(dist="0.6,0.3,0.1"), [], top=1, stop_ids=(0,))
    assert [[t.token_id for t in v.top] for v in r.stages] == [[0], [1]]
    assert [t.token_id for t in r.tokens] == [1, 0]
    one, zero = r.tokens
    assert one.logit == pytest.approx(math.log(0.3)) and one.raw_prob == pytest.approx(0.3)
    assert one.probs == pytest.approx({"raw": 0.3, "min-new-tokens": 0.75}) and one.ranks == {"raw": 2,
                                                                                            "min-new-tokens": 1}
    assert zero.probs == pytest.approx({"raw": 0.6, "min-new-tokens": 0.0}) and zero.ranks == {
        "raw": 1, "min-new-tokens": None}


def test_history_counts_as_generated_output():
    """--min-new-tokens 2 bans the stop id 3 until two tokens were generated: one token of history is not enough,
    two are (the history is output, not prompt)."""
    banned = dist_stages(ChainSettings(min_new_tokens=2), given_logits(dist=P4), [0], stop_ids=(3,))
    assert banned.probs() == pytest.approx([1 / 6, 2 / 6, 3 / 6, 0])
    free = dist_stages(ChainSettings(min_new_tokens=2), given_logits(dist=P4), [0, 1], stop_ids=(3,))
    assert free.probs() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert dist_stages(ChainSettings(min_new_tokens=2), given_logits(dist=P4), [0]).probs() == pytest.approx(
        [0.1, 0.2, 0.3, 0.4])  # no stop id given: nothing to ban


def test_history_out_of_range_and_the_seed_of_the_coin():
    for history, bad in (([0, 4], 4), ([-1], -1)):
        with pytest.raises(ConfigError) as info:
            dist_stages(ChainSettings(), given_logits(dist=P4), history)
        assert str(info.value) == f"--history {bad}: token id out of range [0, 4)"
    assert dist_stages(ChainSettings(), given_logits(dist=P4), [3]).vocab == 4
    xtc = ChainSettings(xtc_probability=0.5, xtc_threshold=0.1)
    for seed in (0, 3):
        coin = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
        r = dist_stages(xtc, given_logits(dist=P4), seed=seed)
        assert r.state == {"xtc.coin": pytest.approx(coin)} and isinstance(r.state["xtc.coin"], float)
        assert r.plan.selector == "multinomial" and r.plan.settings.chain == ("xtc",)


def test_given_logits_by_source():
    torch.testing.assert_close(given_logits(dist="0.5,0,0.5"),
                               torch.tensor([[math.log(0.5), -math.inf, math.log(0.5)]]))
    assert given_logits(dist="1,3").dtype == torch.float32
    torch.testing.assert_close(given_logits(logits="1,-inf,2.5"), torch.tensor([[1.0, -math.inf, 2.5]]))
    assert given_logits(dist="0,1").shape == (1, 2) and given_logits(logits="0").shape == (1, 1)


def test_given_logits_from_a_file(tmp_path):
    path = tmp_path / "z.txt"
    path.write_text("1 2\n-inf, 0.5\n")
    torch.testing.assert_close(given_logits(logits_file=path), torch.tensor([[1.0, 2.0, -math.inf, 0.5]]))
    path.write_text("1 inf")
    with pytest.raises(ConfigError) as info:
        given_logits(logits_file=path)
    assert str(info.value) == f"--logits-file {path}: +inf is not a logit (use -inf to remove a candidate)"
    path.write_text("-inf -inf")
    with pytest.raises(ConfigError) as info:
        given_logits(logits_file=path)
    assert str(info.value) == f"--logits-file {path}: every logit is -inf; give at least one finite value"


def test_given_logits_refusals_word_for_word(tmp_path):
    def refusal(**kwargs) -> str:
        with pytest.raises(ConfigError) as info:
            given_logits(**kwargs)
        return str(info.value)

    assert refusal() == "--dist: give exactly one of --dist, --logits, --logits-file"
    assert refusal(dist="1", logits="1") == "--dist and --logits: give exactly one of --dist, --logits, --logits-file"
    assert refusal(logits="1", logits_file=tmp_path) == (
        "--logits and --logits-file: give exactly one of --dist, --logits, --logits-file")
    assert refusal(dist="0.5,-0.1") == "--dist -0.1: probabilities must be finite and >= 0"
    assert refusal(dist="0.5,inf") == "--dist inf: probabilities must be finite and >= 0"
    assert refusal(dist="0,0") == "--dist: the probabilities sum to 0; give at least one positive value"
    assert refusal(logits="1,inf") == "--logits: +inf is not a logit (use -inf to remove a candidate)"
    assert refusal(logits="-inf") == "--logits: every logit is -inf; give at least one finite value"
    assert given_logits(dist="0,1e-30").shape == (1, 2)  # a tiny positive sum is a distribution


def test_next_token_stages_on_a_model_by_hand():
    model = random_model("llama", seed=9, scale=4.0)
    p = last_probs(model, PROMPT)
    views, tracked = next_token_stages(model, PROMPT, build_chain({"top-k": 3}), lambda t: f"<{t}>")
    assert [v.name for v in views] == ["raw", "top-k"] and len(views[0].top) == 10  # top 10 by default
    want = p.topk(10)
    assert [t.token_id for t in views[0].top] == want.indices.tolist()
    assert [t.prob for t in views[0].top] == pytest.approx(want.values.tolist(), rel=1e-4)
    assert views[0].top[0].token == f"<{int(want.indices[0])}>"
    kept = want.values[:3] / want.values[:3].sum()
    assert [t.prob for t in views[1].top] == pytest.approx(kept.tolist(), rel=1e-4) and views[1].kept == 3
    assert [t.token_id for t in tracked[:3]] == want.indices[:3].tolist()


def test_next_token_stages_under_a_cache_and_the_context():
    """recompute:size=3 re-encodes the last 3 tokens from position 0: the forward of those 3 alone."""
    model = random_model("llama", seed=9, scale=4.0)
    views, _ = next_token_stages(model, PROMPT, build_chain({}), str, top=3, cache=parse_cache_spec("recompute:size=3"))
    want = last_probs(model, PROMPT[-3:]).topk(3)
    assert [t.token_id for t in views[0].top] == want.indices.tolist()
    assert [t.prob for t in views[0].top] == pytest.approx(want.values.tolist(), rel=1e-4)
    next_token_stages(model, PROMPT, build_chain({}), str, context_length=9)
    with pytest.raises(ConfigError, match="the prompt is 8 tokens but the model's context is 8"):
        next_token_stages(model, PROMPT, build_chain({}), str, context_length=8)


def test_output_only_stages_do_not_see_the_prompt():
    """The model path counts nothing of the prompt as output: --min-new-tokens bans the stop id after it."""
    model = random_model("llama", seed=9, scale=4.0)
    p = last_probs(model, PROMPT)
    stop = int(p.argmax())
    views, _ = next_token_stages(model, PROMPT, Chain([MinNewTokens(1, (stop,))]), str, top=1)
    second = p.topk(2)
    assert views[1].top[0].token_id == int(second.indices[1])
    assert views[1].top[0].prob == pytest.approx(float(second.values[1] / (1 - second.values[0])), rel=1e-4)


def test_stage_views_take_logits_from_anywhere():
    views, tracked = stage_views(torch.zeros(1, 0, dtype=torch.long), torch.tensor([[0.0, math.log(3.0)]]),
                                 build_chain({}), str)
    assert [(t.token_id, t.prob) for t in views[0].top] == [(1, pytest.approx(0.75)), (0, pytest.approx(0.25))]
    assert len(tracked) == 2  # top 10 by default, at most the vocabulary


class IdText:
    def decode(self, ids, **kwargs) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_build_probs_takes_top_cache_and_context_from_the_settings():
    assert ProbsSettings().top == 10  # docs/commands.md: --top's default for probs
    model = random_model("llama", seed=9, scale=4.0, max_position_embeddings=9)
    lm = LoadedModel("hand", model, IdText(), torch.device("cpu"), torch.float32, [0])
    views, tracked = build_probs(lm, ProbsSettings(top=4, top_k=2, cache="recompute:size=3"), PROMPT)
    want = last_probs(model, PROMPT[-3:]).topk(4)
    assert [v.name for v in views] == ["raw", "top-k"]
    assert [t.token_id for t in views[0].top] == want.indices.tolist() and views[0].top[0].token.startswith("<")
    assert views[1].kept == 2 and len(tracked) == 4
    views, _ = build_probs(lm, ProbsSettings(), PROMPT, chain=build_chain({}))
    assert [v.name for v in views] == ["raw"] and len(views[0].top) == 10
    with pytest.raises(ConfigError, match="context is 9"):
        build_probs(lm, ProbsSettings(), PROMPT + [7])


# the survivors of the first run (2026-12-02)


def test_next_token_stages_preallocate_the_prompt():
    """--cache static preallocates what the prompt needs (a static cache refuses an unknown length)."""
    model = random_model("llama", seed=9, scale=4.0)
    views, _ = next_token_stages(model, PROMPT, build_chain({}), str, top=3, cache=parse_cache_spec("static"))
    want = last_probs(model, PROMPT).topk(3)
    assert [t.token_id for t in views[0].top] == want.indices.tolist()
    assert [t.prob for t in views[0].top] == pytest.approx(want.values.tolist(), rel=1e-4)


def test_stage_views_list_ten_by_default():
    raw = torch.arange(12, dtype=torch.float32).view(1, -1)
    views, tracked = stage_views(torch.zeros(1, 0, dtype=torch.long), raw, build_chain({}), str)
    assert [t.token_id for t in views[0].top] == list(range(11, 1, -1)) and len(tracked) == 10


def test_given_logits_name_their_option_in_a_bad_value(tmp_path):
    def refusal(**kwargs) -> str:
        with pytest.raises(ConfigError) as info:
            given_logits(**kwargs)
        return str(info.value)

    assert refusal(logits="1,x").startswith("--logits 'x'")
    path = tmp_path / "z.txt"
    path.write_text("1 x")
    assert refusal(logits_file=path).startswith(f"--logits-file {path} 'x'")
    assert refusal(logits_file=tmp_path / "absent.txt") == (
        f"--logits-file {tmp_path / 'absent.txt'}: no such file; give a text file")


def test_dist_stages_draw_from_seed_0_by_default():
    xtc = ChainSettings(xtc_probability=0.5, xtc_threshold=0.1)
    coin = float(torch.rand(1, generator=torch.Generator().manual_seed(0)))
    assert dist_stages(xtc, given_logits(dist=P4)).state == {"xtc.coin": pytest.approx(coin)}
