"""The step's selection (core/sampling/step.py `select`) and the selectors (core/sampling/select.py): the chain sees
the ids, stages are recorded only when asked, greedy is the per-row arg-max, and the sampler's Exp(1) race is float32
whatever the logits' dtype."""

from __future__ import annotations

import torch

from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.distribution import softmax

from conftest import NEG


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_select_gives_the_chain_the_ids_and_records_only_when_asked():
    """Repetition penalty 4 on token 0 (seen): logits (2, 1) become (1/2, 1), so greedy picks 1; without the ids it
    would pick 0. finite is per row: row 1 has no finite logit left."""
    from decodelab.core.sampling.select import Greedy
    from decodelab.core.sampling.step import select

    chain = build_chain({"repetition-penalty": 4.0})
    ids, logits = torch.tensor([[0], [0]]), torch.tensor([[2.0, 1.0], [NEG, NEG]])
    plain = select(chain, Greedy(), ids, logits)
    assert plain.token.tolist() == [1, 0] and plain.stages is None
    assert plain.processed.tolist() == [[0.5, 1.0], [NEG, NEG]] and plain.finite.tolist() == [True, False]
    recorded = select(chain, Greedy(), ids, logits, record=True)
    assert recorded.token.tolist() == [1, 0] and recorded.finite.tolist() == [True, False]
    assert [name for name, _ in recorded.stages] == ["raw", "repetition-penalty"]
    assert recorded.stages[1][1].tolist() == [[0.5, 1.0], [NEG, NEG]]


def test_the_selectors_on_probabilities_and_the_race_dtype():
    """Greedy on probabilities is the per-row arg-max; a fresh sampler has drawn nothing; its Exp(1) race is float32
    whatever the logits' dtype (bfloat16 draws would tie and bias the draw), so a seed draws the same token from
    bfloat16 and float32 copies of the same logits."""
    from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

    assert Greedy()(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])).tolist() == [1, 0]
    assert Multinomial(make_generator(0, "cpu")).last_race is None
    z = torch.linspace(-2.0, 2.0, 64)[None]
    for seed in range(4):
        low, full = Multinomial(make_generator(seed, "cpu")), Multinomial(make_generator(seed, "cpu"))
        assert low.from_logits(z.bfloat16()).tolist() == full.from_logits(z.bfloat16().float()).tolist()
        assert low.last_race.dtype == torch.float32
        assert low(softmax(z).double()).tolist() == full(softmax(z)).tolist() and low.last_race.dtype == torch.float32

