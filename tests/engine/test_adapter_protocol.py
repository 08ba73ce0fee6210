"""Adding a served engine is one adapter class: a class declaring the members of the adapter protocol and registered
with ``register`` is found by the client (from ``owned_by`` or by kind) and used for every request, with no other
edit; ``register`` refuses a class that lacks a member or takes a kind or an owner already taken."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_server import models_answer, table_engine  # noqa: E402

from decodelab.core.engine.backend import Capabilities  # noqa: E402
from decodelab.core.engine.http.adapter import ADAPTERS, OWNERS, Adapter, register  # noqa: E402
from decodelab.core.engine.http.llamacpp import LlamacppAdapter  # noqa: E402
from decodelab.core.engine.http.sglang import SglangAdapter  # noqa: E402
from decodelab.core.engine.http.transport import EngineError, Transport  # noqa: E402
from decodelab.core.engine.http.vllm import VllmAdapter  # noqa: E402
from decodelab.core.engine.http.wire import RAW, Alternative, Position, SamplingSettings, rank_in_top  # noqa: E402


class ToyAdapter(Adapter):
    """An engine that answers {"steps": [[id, logprob, {alt: logprob}], ...], "end": reason} at /toy."""

    kind = "toy"
    owned_by = ("toy-lab",)
    default_mode = "raw_logprobs"
    path = "/toy"

    def __init__(self, logprobs_mode: str, max_top_n: int | None):
        if logprobs_mode != "raw_logprobs":
            raise EngineError(f"toy gives raw_logprobs only, not {logprobs_mode!r}")
        self.values = self.prompt_values = RAW
        self.capabilities = Capabilities(score=True, generate=True, seeded=False, prompt_ranks=False,
                                         full_logits=False, max_top_n=max_top_n)

    def check(self, s: SamplingSettings) -> str | None:
        return "top_k: the toy engine has none" if s.top_k else None

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        return {"score": list(ids), "n": top_n}

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        return {"ids": list(ids), "max": s.max_tokens, "t": s.temperature, "n": s.logprobs}

    def _positions(self, steps) -> tuple[Position, ...]:
        out = []
        for i, (token, lp, alts) in enumerate(steps):
            top = tuple(Alternative(int(k), v) for k, v in sorted(alts.items(), key=lambda kv: -kv[1]))
            out.append(Position(i, token, lp, rank_in_top(token, lp, top), top))
        return tuple(out)

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        return self._positions(resp["steps"])

    def read_generation(self, t: Transport, body: dict, resp: dict):
        steps = self._positions(resp["steps"])
        return tuple(p.token_id for p in steps), steps, resp["end"]


@pytest.fixture
def toy():
    register(ToyAdapter)
    yield ToyAdapter
    del ADAPTERS["toy"], OWNERS["toy-lab"]


ANSWER = {"steps": [[7, -0.5, {"7": -0.5, "3": -1.25}], [3, -2.0, {"9": -0.25, "3": -2.0}]], "end": "length"}


def test_a_registered_adapter_is_found_by_owned_by_and_used_for_every_request(toy):
    e, sent = table_engine({"/v1/models": models_answer("m", owned_by="Toy-Lab"), "/toy": ANSWER})
    assert type(e.adapter) is ToyAdapter and e.logprobs_mode == "raw_logprobs" and e.model == "m"
    g = e.generate([1, 2], SamplingSettings(max_tokens=2, temperature=0.5, logprobs=2))
    assert sent.sent[-1] == ("POST", "/toy", {"ids": [1, 2], "max": 2, "t": 0.5, "n": 2})
    assert g.token_ids == (7, 3) and g.finish_reason == "length" and g.prompt_ids == (1, 2)
    assert [p.rank for p in g.steps] == [1, 2] and g.steps[1].top[0] == Alternative(9, -0.25)
    assert g.labels.engine == "toy" and g.labels.values == RAW and g.cached_tokens is None
    s = e.score([1, 2, 3], top_n=2)
    assert sent.sent[-1] == ("POST", "/toy", {"score": [1, 2, 3], "n": 2}) and s.labels.engine == "toy"
    # the protocol's defaults: no tokenize endpoint, no prefix-cache counters, no model check on the answer
    assert e.tokenize("hi") is None and e.prefix_cache_counters() is None
    with pytest.raises(EngineError) as err:
        e.generate([1], SamplingSettings(top_k=4))
    assert str(err.value) == "--engine http://127.0.0.1:9: top_k: the toy engine has none"


def test_a_registered_adapter_is_named_among_the_kinds_and_can_be_given(toy):
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="openai"), "/toy": ANSWER}, kind="toy")
    assert type(e.adapter) is ToyAdapter
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="openai")})
    with pytest.raises(EngineError) as err:
        e.model
    assert str(err.value).endswith("give one of vllm, sglang, llamacpp, toy")
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="toy-lab")}, logprobs_mode="processed_logprobs")
    with pytest.raises(EngineError) as err:
        e.model
    assert str(err.value) == "--engine http://127.0.0.1:9: toy gives raw_logprobs only, not 'processed_logprobs'"


def test_register_refuses_a_class_lacking_a_member_and_a_second_claim(toy):
    class NoReader(Adapter):
        kind, owned_by, default_mode, path = "half", ("half",), "raw_logprobs", "/half"
        check = ToyAdapter.check
        score_body = ToyAdapter.score_body
        generate_body = ToyAdapter.generate_body
        read_score = ToyAdapter.read_score

    with pytest.raises(TypeError, match=r"NoReader lacks read_generation"):
        register(NoReader)

    class Again(ToyAdapter):
        owned_by = ("other",)

    with pytest.raises(ValueError, match="'toy' is registered already"):
        register(Again)

    class Owner(ToyAdapter):
        kind = "toy2"

    with pytest.raises(ValueError, match="owned_by 'toy-lab' names 'toy' already"):
        register(Owner)
    assert "half" not in ADAPTERS and "toy2" not in ADAPTERS and OWNERS["toy-lab"] == "toy"


def test_the_built_in_adapters_are_registered_in_order_each_under_its_owner():
    assert list(ADAPTERS)[:3] == ["vllm", "sglang", "llamacpp"]
    assert [ADAPTERS[k] for k in ("vllm", "sglang", "llamacpp")] == [VllmAdapter, SglangAdapter, LlamacppAdapter]
    assert {o: k for o, k in OWNERS.items() if k in ("vllm", "sglang", "llamacpp")} == {
        "vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}
    assert [a.default_mode for a in (VllmAdapter, SglangAdapter, LlamacppAdapter)] == [
        "raw_logprobs", "processed_logprobs", "raw_logprobs"]
    assert [a.answers_model for a in (VllmAdapter, SglangAdapter, LlamacppAdapter)] == [True, False, False]
