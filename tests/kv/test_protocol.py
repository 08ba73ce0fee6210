"""The KV-policy protocol (core/kv/protocol.py) on its own: the base class, the spec's key parsers, the ``--cache``
parser's refusals word for word, the capability check, the registry listing and the policy lists, without a model.

Expected values are worked by hand from the registry as ``decodelab models`` lists it (the policies in import order,
then the aliases)."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.errors import ConfigError
from decodelab.core.kv import (POLICIES, CacheSpec, KVPolicy, ModelInfo, compresses_once, feed_invariant, listing,
                               make_policy, parse_cache_spec, parse_policy_list, policy_capabilities, register, require,
                               split_policy_list, tensor_nbytes)
from decodelab.core.kv.protocol import boolean, choice, non_negative_int, positive_int

# mutation run of core/kv/protocol.py (2026-12-02)

NAMES = ("full, paged, quant, recompute, static, window, sinks, h2o, knorm, snapkv, pyramidkv, tova, keydiff, "
         "expected-attention, turbo, int8, fp8, int4, int4-kivi, int2-kivi")


def cpu_info() -> ModelInfo:
    return ModelInfo(config=None, device=torch.device("cpu"), dtype=torch.float32, rotary=None, num_layers=2,
                     kv_heads=1, head_dim=4)


def refusal(text, option="--cache") -> str:
    with pytest.raises(ConfigError) as exc:
        parse_cache_spec(text, option)
    return str(exc.value)


def test_a_spec_prints_its_name_then_sorted_keys_with_booleans_as_words():
    assert CacheSpec().name == "full" and str(CacheSpec()) == "full" and CacheSpec().options == {}
    spec = CacheSpec("x", (("a", True), ("b", False), ("c", 1), ("d", 0.5)))
    assert str(spec) == "x:a=true,b=false,c=1,d=0.5"
    assert spec.options == {"a": True, "b": False, "c": 1, "d": 0.5}


def test_the_base_policy_counts_seen_and_leaves_the_tensors_to_subclasses():
    info = cpu_info()
    policy = KVPolicy(info, 7, needs=frozenset({"rows"}))
    assert (policy.info, policy.capacity, policy.needs, policy.seen) == (info, 7, frozenset({"rows"}), 0)
    bare = KVPolicy(info)
    assert bare.capacity is None and bare.needs == frozenset()
    assert (KVPolicy.name, KVPolicy.capabilities, KVPolicy.summary, KVPolicy.params) == ("?", frozenset(), "", {})
    assert KVPolicy.feed_invariant is False and KVPolicy.compresses_once({"compress": "prefill"}) is False
    policy.seen = 3
    positions = policy.positions(2)
    assert positions.tolist() == [[3, 4]] and positions.device == info.device
    assert policy.attention_mask(2) is None
    policy.after_forward(2)
    assert policy.seen == 5
    for call in (lambda: policy.stored, lambda: policy.truncate(1), lambda: policy.reorder(torch.tensor([0])),
                 policy.layer_nbytes, policy.nbytes, policy.describe):
        with pytest.raises(NotImplementedError):
            call()


def test_nbytes_sums_the_layers_and_describe_reports_seen_and_stored():
    class Two(KVPolicy):
        name = "two"

        @property
        def stored(self) -> int:
            return self.seen - 1

        def layer_nbytes(self) -> list[int]:
            return [3, 4]

    policy = Two(cpu_info())
    policy.after_forward(6)
    assert policy.nbytes() == 7
    assert policy.describe() == {"policy": "two", "seen": 6, "stored": 5}


def test_tensor_nbytes_is_elements_times_element_size_and_none_is_zero():
    assert tensor_nbytes(None) == 0
    assert tensor_nbytes(torch.zeros(2, 3, dtype=torch.float16)) == 2 * 3 * 2
    assert tensor_nbytes(torch.zeros(5, dtype=torch.int8)) == 5


def test_integer_keys_take_the_bounds_and_refuse_in_one_line():
    assert positive_int("size", "1") == 1 and positive_int("size", " 12 ") == 12
    assert positive_int("size", str(2**40)) == 2**40
    assert non_negative_int("sinks", "0") == 0
    for parse, key, text, lo in ((positive_int, "size", "0", 1), (non_negative_int, "sinks", "-1", 0),
                                 (positive_int, "size", str(2**40 + 1), 1)):
        with pytest.raises(ValueError) as exc:
            parse(key, text)
        assert str(exc.value) == f"{key} must be an integer >= {lo}"
    with pytest.raises(ValueError) as exc:
        positive_int("size", "4.0")
    assert str(exc.value) == "size must be an integer >= 1, not '4.0'"
    with pytest.raises(ValueError) as exc:
        non_negative_int("recent", "x")
    assert str(exc.value) == "recent must be an integer >= 0, not 'x'"


def test_boolean_keys_take_four_words_each_way_in_any_case():
    for text in ("true", "1", "yes", "on", " TRUE ", "On"):
        assert boolean("symmetric", text) is True
    for text in ("false", "0", "no", "off", " FALSE ", "Off"):
        assert boolean("symmetric", text) is False
    with pytest.raises(ValueError) as exc:
        boolean("symmetric", "maybe")
    assert str(exc.value) == "symmetric must be true or false"


def test_choice_keys_take_only_the_allowed_words_as_typed():
    parse = choice("keep", "rerotate")
    assert parse("positions", "keep") == "keep" and parse("positions", "rerotate") == "rerotate"
    for text in ("KEEP", " keep", "other"):
        with pytest.raises(ValueError) as exc:
            parse("positions", text)
        assert str(exc.value) == "positions must be one of keep, rerotate"


def test_cache_specs_read_aliases_spaces_and_empty_items():
    assert parse_cache_spec(None) == CacheSpec()
    assert str(parse_cache_spec(" int8 ")) == "quant:axis=token,bits=8,residual=0,symmetric=true"
    assert parse_cache_spec("window :size =4") == CacheSpec("window", (("positions", "keep"), ("size", 4)))
    assert parse_cache_spec("window:, positions= rerotate ,,size=4,") == CacheSpec(
        "window", (("positions", "rerotate"), ("size", 4)))
    assert parse_cache_spec("full") == CacheSpec("full", ())


def test_cache_spec_refusals_name_the_option_and_the_text_word_for_word():
    assert refusal("  ") == (f"--cache '  ': names no policy; give one of {NAMES} (full keeps every position)")
    assert refusal("", option="--draft-cache") == (
        f"--draft-cache '': names no policy; give one of {NAMES} (full keeps every position)")
    assert refusal("nope:size=1") == f"--cache 'nope:size=1': unknown policy 'nope'; allowed: {NAMES}"
    assert refusal("window:positions=keep:x", option="--x") == (
        "--x 'window:positions=keep:x': positions must be one of keep, rerotate")
    assert refusal("window:size") == "--cache 'window:size': 'size' is not key=value"
    assert refusal("window:size= ") == "--cache 'window:size= ': 'size=' is not key=value"
    assert refusal("full:size=4") == "--cache 'full:size=4': full takes no 'size'; its keys: none"
    assert refusal("window:sinks=4") == "--cache 'window:sinks=4': window takes no 'sinks'; its keys: size, positions"
    assert refusal("window:size=0") == "--cache 'window:size=0': size must be an integer >= 1"
    assert refusal("h2o:size=4,recent=8") == "--cache 'h2o:size=4,recent=8': recent=8 is more than size=4"
    assert refusal("window") == "--cache 'window': window needs size=W (the tokens it keeps)"


def test_require_names_the_first_missing_capability_and_the_policies_that_can():
    require(parse_cache_spec("full"), {"truncate", "rows"}, "speculative decoding")  # nothing missing: no refusal
    require(parse_cache_spec("int8"), frozenset({"truncate"}), "speculative decoding")
    cases = (
        ("window:size=8", {"truncate"}, "--cache window:positions=keep,size=8: speculative decoding needs the cache "
         "to roll back (truncate), which window cannot; policies that can: full, quant, recompute, static, turbo"),
        ("paged", {"rows", "truncate"}, "--cache paged: speculative decoding needs the cache to roll back "
         "(truncate), which paged cannot; policies that can: full, quant, recompute, static, turbo"),
        ("paged", {"reorder"}, "--cache paged: speculative decoding needs the cache to reorder rows, which paged "
         "cannot; policies that can: full, quant, recompute, static, window, sinks, h2o, knorm, snapkv, pyramidkv, "
         "tova, keydiff, expected-attention, turbo"),
        ("paged", {"rows"}, "--cache paged: speculative decoding needs the cache to hold several rows, which paged "
         "cannot; policies that can: full, quant, recompute, static, window, sinks, h2o, knorm, snapkv, pyramidkv, "
         "tova, keydiff, expected-attention, turbo"),
        ("full", {"compile", "reorder", "rows", "truncate"}, "--cache full: speculative decoding needs the cache to "
         "be compiled, which full cannot; policies that can: static"),
        # quant's capabilities narrow with its options: kivi keeps a residual and cannot roll back
        ("int4-kivi", {"truncate"}, "--cache quant:axis=kivi,bits=4,residual=32,residual_dtype=16,symmetric=false: "
         "speculative "
         "decoding needs the cache to roll back (truncate), which quant cannot; policies that can: full, quant, "
         "recompute, static, turbo"),
    )
    for text, needs, message in cases:
        with pytest.raises(ConfigError) as exc:
            require(parse_cache_spec(text), needs, "speculative decoding")
        assert str(exc.value) == message
    with pytest.raises(ConfigError) as exc:
        require(parse_cache_spec("window:size=8"), {"truncate"}, "speculate", option="--draft-cache")
    assert str(exc.value).startswith("--draft-cache window:positions=keep,size=8: speculate needs")


def test_capabilities_feed_invariance_and_compress_once_follow_the_spec():
    assert policy_capabilities(parse_cache_spec("int8")) == frozenset({"reorder", "rows", "truncate"})
    assert policy_capabilities(parse_cache_spec("int4-kivi")) == frozenset({"reorder", "rows"})
    assert policy_capabilities(parse_cache_spec("static")) == frozenset({"compile", "reorder", "rows", "truncate"})
    assert [feed_invariant(parse_cache_spec(t)) for t in ("full", "paged", "int8", "window:size=4")] == [
        True, True, False, False]
    assert compresses_once(parse_cache_spec("snapkv:size=64")) is True
    assert compresses_once(parse_cache_spec("h2o:size=64,compress=prefill")) is True
    assert compresses_once(parse_cache_spec("h2o:size=64,compress=decode")) is False
    assert compresses_once(parse_cache_spec("full")) is False


def test_make_policy_hands_the_options_capacity_and_needs_to_the_class(monkeypatch):
    calls = []

    class Spy(KVPolicy):
        name = "spy"

        def __init__(self, info, capacity=None, needs=frozenset(), **options):
            super().__init__(info, capacity, needs)
            calls.append((capacity, needs, options))

    monkeypatch.setitem(POLICIES, "spy", Spy)
    info = cpu_info()
    policy = make_policy(CacheSpec("spy", (("a", 1), ("b", "x"))), info, 9, needs={"rows"})
    assert isinstance(policy, Spy) and policy.info is info
    assert calls[-1] == (9, frozenset({"rows"}), {"a": 1, "b": "x"}) and isinstance(calls[-1][1], frozenset)
    make_policy(CacheSpec("spy"), info)
    assert calls[-1] == (None, frozenset(), {})


def test_register_files_the_class_under_its_name(monkeypatch):
    class Spy(KVPolicy):
        name = "spy"

    monkeypatch.setitem(POLICIES, "spy", None)  # undone after the test: the registry keeps its fifteen policies
    assert register(Spy) is Spy and POLICIES["spy"] is Spy


def test_listing_rows_are_the_policies_then_the_aliases():
    rows = listing()
    assert [row["name"] for row in rows] == NAMES.split(", ")
    assert rows[0] == {"name": "full", "summary": POLICIES["full"].summary, "keys": [],
                       "capabilities": ["truncate", "reorder", "rows"]}
    static = next(row for row in rows if row["name"] == "static")
    assert static["capabilities"] == ["truncate", "reorder", "rows", "compile"]
    window = next(row for row in rows if row["name"] == "window")
    assert window["keys"] == ["size", "positions"] and window["capabilities"] == ["reorder", "rows"]
    assert rows[15] == {"name": "int8", "summary": "alias of quant:bits=8,axis=token,symmetric=true", "keys": [],
                        "capabilities": []}


def test_policy_lists_split_where_a_new_name_begins():
    assert split_policy_list("snapkv:ratio=0.5,window=8,h2o:size=64,full") == [
        "snapkv:ratio=0.5,window=8", "h2o:size=64", "full"]
    assert split_policy_list(" full , ,int8 ") == ["full", "int8"]
    assert split_policy_list("window:size=4,positions=keep;full") == ["window:size=4,positions=keep", "full"]
    assert split_policy_list("size=4,full") == ["size=4", "full"]
    assert split_policy_list("window:size=4,positions=x:y") == ["window:size=4,positions=x:y"]
    # only the text before the first '=' decides: 'positions=a:b=c' is a key of the policy before it
    assert split_policy_list("window:size=4,positions=a:b=c") == ["window:size=4,positions=a:b=c"]
    assert split_policy_list(" ; ") == []


def test_policy_lists_keep_the_typed_text_and_refuse_empties_and_repeats():
    out = parse_policy_list("int8, window:size=4")
    window = CacheSpec("window", (("positions", "keep"), ("size", 4)))
    assert out == {"int8": parse_cache_spec("int8"), "window:size=4": window}
    with pytest.raises(ConfigError) as exc:
        parse_policy_list(" , ")
    assert str(exc.value) == ("--policies ' , ': names no policy; give specs such as "
                              "snapkv:ratio=0.5,h2o:size=64")
    with pytest.raises(ConfigError) as exc:
        parse_policy_list("int8;quant:bits=8,axis=token,symmetric=true", option="--compare")
    assert str(exc.value) == ("--compare 'int8;quant:bits=8,axis=token,symmetric=true': "
                              "quant:axis=token,bits=8,residual=0,symmetric=true is named twice")
    with pytest.raises(ConfigError) as exc:
        parse_policy_list("full,nope")
    assert str(exc.value) == f"--policies 'nope': unknown policy 'nope'; allowed: {NAMES}"


# mutation run of core/kv/protocol.py (2026-12-02, the first run's survivors)


def test_positions_are_made_on_the_models_device():
    info = ModelInfo(config=None, device=torch.device("meta"), dtype=torch.float32, rotary=None, num_layers=1,
                     kv_heads=1, head_dim=4)  # meta: a device that is not the default, on any machine
    assert KVPolicy(info).positions(3).device.type == "meta"


def test_a_spec_refused_without_an_option_names_the_cache_option():
    with pytest.raises(ConfigError) as exc:
        parse_cache_spec("nope")
    assert str(exc.value) == f"--cache 'nope': unknown policy 'nope'; allowed: {NAMES}"


def test_a_key_is_split_from_its_value_at_the_first_equals_sign():
    # key 'positions', value 'a=b' (not key 'positions=a'): the value is what is refused
    assert refusal("window:positions=a=b") == "--cache 'window:positions=a=b': positions must be one of keep, rerotate"
