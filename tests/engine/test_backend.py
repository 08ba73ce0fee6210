"""The engine seam: capabilities declared per backend, a lacking one refused with one line naming the option;
a tokenizer loaded without weights for a served engine."""

from __future__ import annotations

import pytest

from decodelab.core.engine.backend import EMBEDDED, WHAT, Capabilities, refuse_lacking
from decodelab.core.engine.models import load_model, load_tokenizer
from decodelab.core.engine.http.llamacpp import LlamacppAdapter
from decodelab.core.engine.http.sglang import SglangAdapter
from decodelab.core.engine.http.vllm import VllmAdapter
from decodelab.core.errors import ConfigError


def test_the_embedded_runtime_can_do_everything():
    refuse_lacking(EMBEDDED, {name: "x" for name in ("score", "generate", "seeded", "prompt_ranks", "full_logits",
                                                    "replay", "kv_policies")}, "the embedded runtime")


def test_served_engines_declare_what_they_lack():
    for adapter in (VllmAdapter(), SglangAdapter(), LlamacppAdapter()):
        caps = adapter.capabilities
        assert not caps.full_logits and not caps.kv_policies and caps.generate
    assert VllmAdapter().capabilities.score and VllmAdapter().capabilities.replay
    assert not LlamacppAdapter().capabilities.score and not LlamacppAdapter().capabilities.replay


@pytest.mark.parametrize("capability", ["full_logits", "kv_policies", "score"])
def test_a_lacking_capability_is_one_line(capability):
    caps = Capabilities(score=False, generate=True, seeded=True, prompt_ranks=False, full_logits=False,
                        max_top_n=5)
    with pytest.raises(ConfigError) as err:
        refuse_lacking(caps, {"generate": "sample", capability: "--the-option"}, "the vllm server at http://h")
    assert str(err.value) == (f"--the-option: needs {WHAT[capability]}, which the vllm server at http://h cannot give; run it "
                              "without --engine")


def test_a_tokenizer_without_weights_is_the_models_tokenizer():
    t, m = load_tokenizer("tiny"), load_model("tiny", device="cpu")
    assert t.vocab_size == m.vocab_size and t.eos_ids == m.eos_ids and t.context_length == m.context_length
    assert t.encode("Once upon a time") == m.encode("Once upon a time") and t.token_text(261) == m.token_text(261)
    assert t.device is None and t.dtype is None


def test_a_tokenizer_folder_needs_no_weights(tmp_path):
    import shutil

    from decodelab.core.engine.models import bundled_dir

    for f in bundled_dir("tiny").iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    assert load_tokenizer(str(tmp_path)).encode("Once") == load_tokenizer("tiny").encode("Once")


def test_an_unknown_capability_is_a_programming_error_naming_it():
    """mutation run of core/engine/backend.py (2026-12-02, second round)"""
    with pytest.raises(ValueError, match="^unknown capability 'telepathy'$"):
        refuse_lacking(EMBEDDED, {"telepathy": "--x"}, "the embedded runtime")


def test_capabilities_are_a_plain_dict_of_their_fields():
    assert EMBEDDED.to_dict() == {"score": True, "generate": True, "seeded": True, "prompt_ranks": True,
                                  "full_logits": True, "max_top_n": None, "replay": True, "kv_policies": True}
