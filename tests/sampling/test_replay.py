"""The replay (decodelab.core.sampling.replay): the chain at each position of a given sequence, as the run that
produced it applied it; the model's teacher-forced rows for given tokens."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.errors import ConfigError
from decodelab.core.methods.sample import SampleSettings
from decodelab.core.sampling import replay


@pytest.fixture(scope="module")
def lm():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


def test_forced_logits_are_the_models_own_forward(lm):
    logits = replay.forced_logits(lm.model, [4, 5, 6], [7, 8])
    with torch.no_grad():
        expected = lm.model(torch.tensor([[4, 5, 6, 7, 8]])).logits[0, 2:4].float()  # rows that drew 7 and 8
    assert logits.shape == (2, lm.vocab_size) and logits.dtype == torch.float32
    assert torch.allclose(logits, expected, atol=1e-5)


def test_the_replay_counts_the_output_from_the_prompts_end(lm):
    from decodelab.core.sampling.chain import make_chain

    vocab = lm.vocab_size
    # vLLM's presence and frequency penalties count the output only: prompt [1, 2], output [3, 3, 1]; row i sees
    # the output before it: nothing, one 3 (0.5 + 0.25), two 3s (0.5 + 2 x 0.25); 1 is in the prompt, never counted
    chain = make_chain(lm, SampleSettings(presence_penalty=0.5, frequency_penalty=0.25, semantics="vllm"))
    rows = replay.along(chain, [1, 2], [3, 3, 1], torch.zeros(3, vocab))
    assert [(float(r[3]), float(r[1]), float(r[2])) for r in rows] == [(0.0, 0.0, 0.0), (-0.75, 0.0, 0.0),
                                                                        (-1.0, 0.0, 0.0)]
    assert all(r.shape == (vocab,) for r in rows)
    recorded = replay.along(chain, [1, 2], [3, 3, 1], torch.zeros(3, vocab), record=True)
    assert [[name for name, _ in stages] for stages in recorded] == [["raw", "frequency-penalty",
                                                                      "presence-penalty"]] * 3
    assert all(torch.equal(stages[-1][1], row) and stages[0][1].shape == (vocab,)
               for stages, row in zip(recorded, rows))
    # the repetition penalty counts the prompt too: 1 and 2 halved from the first row, 3 once generated
    chain = make_chain(lm, SampleSettings(repetition_penalty=2.0, semantics="vllm"))
    rows = replay.along(chain, [1, 2], [3, 3, 1], torch.ones(3, vocab))
    assert [[float(r[t]) for t in (1, 2, 3, 4)] for r in rows] == [[0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 0.5, 1.0],
                                                                   [0.5, 0.5, 0.5, 1.0]]
    with pytest.raises(ConfigError) as err:
        replay.along(make_chain(lm, SampleSettings(mirostat_tau=5.0)), [1], [2], torch.zeros(1, vocab))
    assert str(err.value) == ("the chain [mirostat] carries state from step to step (xtc, mirostat): it cannot be "
                              "replayed over given tokens")


def test_the_fast_path_is_the_chain_row_by_row():
    """A chain that reads no ids is applied to the whole block at once; one that does (a penalty) row by row, each
    row after its own prefix: both equal the chain applied to each row by hand, recorded stages included."""
    from decodelab.core.sampling.chain import build_chain

    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = torch.randn(4, 10)
    for values in ({"temperature": 0.7, "top-k": 3}, {"repetition-penalty": 1.8, "top-p": 0.8}):
        chain = build_chain(values)
        chain.reset(2)
        want = [chain.apply(ids[:, : 3 + r], logits[r : r + 1])[0] for r in range(4)]
        assert torch.equal(replay.processed(chain, ids, logits, 3), torch.stack(want))
        stages = replay.recorded(chain, ids, logits, 3)
        assert [[n for n, _ in s] for s in stages] == [["raw"] + chain.names] * 4
        assert all(torch.equal(s[-1][1], w) and torch.equal(s[0][1], logits[r])
                   for r, (s, w) in enumerate(zip(stages, want)))
    # the penalty sees each row's own prefix ids[:, :3 + r]: 1 is in every one, 9 only in row 3's (3 1 4 1 5 9)
    chain = build_chain({"repetition-penalty": 2.0})
    rows = replay.processed(chain, ids, torch.ones(4, 10), 3)
    assert rows[:, 1].tolist() == [0.5] * 4 and rows[:, 9].tolist() == [1.0, 1.0, 1.0, 0.5]


def test_a_chain_with_its_own_coin_is_refused(lm):
    from decodelab.core.sampling.chain import make_chain

    chain = make_chain(lm, SampleSettings(xtc_probability=0.5, xtc_threshold=0.1))
    with pytest.raises(ConfigError) as err:
        replay.start(chain, 1)
    assert str(err.value) == ("the chain [xtc] carries state from step to step (xtc, mirostat): it cannot be "
                              "replayed over given tokens")
