"""The verify-width audit: both paths against a full forward (the rows align with the right tokens), width 1 is the
plain path itself (drift 0), and a planted width-dependent perturbation is reported exactly, with its flips exactly
where the margin is below it."""

from __future__ import annotations

import json

import pytest
import torch

from decodelab.core.engine.forward import forward
from decodelab.core.methods.speculative.width import audit_width, plain_rows, verify_rows

from conftest import random_model

PROMPT = [3, 17, 42, 9, 100]
TEXT = [17, 42, 5, 77, 8, 9, 100, 3, 200, 11, 17]


@pytest.fixture(scope="module")
def target():
    return random_model("llama", seed=0, vocab_size=256, scale=20.0)


def test_both_paths_match_a_full_forward_row_for_row(target):
    ids = PROMPT + TEXT
    full = forward(target, torch.tensor([ids]), logits_to_keep=0)[0][len(PROMPT) - 1 : -1]
    for rows in (plain_rows(target, ids, len(PROMPT)), verify_rows(target, ids, len(PROMPT), 4)):
        assert rows.shape == full.shape
        assert torch.allclose(rows, full, atol=1e-3), float((rows - full).abs().max())


def test_width_one_is_the_plain_path(target):
    a = audit_width(target, PROMPT, TEXT, 1)
    assert a.max_drift == 0.0 and a.identical == len(TEXT) and a.flips == 0 and a.row == [0] * len(TEXT)


def test_a_planted_width_dependent_offset_is_measured_with_its_flips(target):
    """+delta on token 5's logit in every forward of more than one row: the audit's drift is delta at every
    position, and the argmax flips exactly where token 5 was within delta of the top (and not already top)."""
    delta = 3.0
    head = target.get_output_embeddings()

    def hook(module, inputs, output):
        if output.shape[1] > 1:
            output = output.clone()
            output[..., 5] += delta
        return output

    ids = PROMPT + TEXT
    plain = plain_rows(target, ids, len(PROMPT))
    handle = head.register_forward_hook(hook)
    try:
        a = audit_width(target, PROMPT, TEXT, 4)
    finally:
        handle.remove()
    assert a.max_drift == pytest.approx(delta, abs=1e-3) and min(a.drift) == pytest.approx(delta, abs=1e-3)
    top = plain.argmax(-1)
    expect = [i for i in range(len(TEXT)) if top[i] != 5 and plain[i, 5] + delta > plain[i, top[i]]]
    assert a.flip_at == expect and a.flips == len(expect)
    assert all(a.margin[i] < delta for i in a.flip_at)
    assert a.row == [i % 4 for i in range(len(TEXT))]


def test_cli_audit_width(cli, toy_model_dir):
    code, out, err = cli("speculate", "Once upon", "-n", "6", "-t", "0", "--draft", "ngram", "--audit-width",
                         "--gamma", "2", "--speedup-rounds", "1", "-m", toy_model_dir, "-f", "json")
    assert code == 0, err
    audit = json.loads(out)["width_audit"]
    assert audit["width"] == 3 and audit["tokens"] == 6 and len(audit["drift"]) == 6
    code, out, err = cli("speculate", "Once upon", "-n", "6", "-t", "0", "--draft", "ngram", "--audit-width",
                         "--speedup-rounds", "1", "-m", toy_model_dir)
    assert code == 0, err and "verify-width audit" in out
