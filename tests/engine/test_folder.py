"""core/engine/folder.py without the CLI: each check of a model folder called on a folder made here (a config, a stand-in
tokenizer file, safetensors weights written by the safetensors library or headers written by hand), and the checks of a
loaded model on stand-in objects. Each refusal is compared word for word once, its bounds at both edges."""

from __future__ import annotations

# mutation run of core/engine/folder.py (2026-12-02)

import json
import struct
import types

import pytest
import torch
from safetensors.torch import save_file

from decodelab.core.engine import folder as fd
from decodelab.core.errors import ModelLoadError

W = "--model m"


def refusal(call, *args) -> str:
    with pytest.raises(ModelLoadError) as err:
        call(*args)
    return str(err.value)


def model_dir(tmp_path, config=None, tensors=None, tokenizer="tokenizer.json"):
    """A folder with config.json, a tokenizer file (its content is not read by these checks) and model.safetensors."""
    (tmp_path / "config.json").write_text(json.dumps(config if config is not None else {"vocab_size": 10}))
    if tokenizer:
        (tmp_path / tokenizer).write_text("{}")
    if tensors is None:
        tensors = {"model.embed_tokens.weight": torch.zeros(10, 4), "model.layers.0.w.weight": torch.zeros(4, 4),
                   "model.layers.1.w.weight": torch.zeros(4, 4)}
    if tensors:
        save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def raw_safetensors(path, header, data_bytes: int, length: int | None = None):
    """A .safetensors file written by hand: the 8-byte length, the JSON header, then ``data_bytes`` zero bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data_bytes))
    return path


# --- the files -----------------------------------------------------------------------------------------------------


def test_a_folder_needs_a_config_weights_and_a_tokenizer(tmp_path):
    assert refusal(fd.check_files, W, tmp_path) == f"{W}: {tmp_path} has no config.json, so it is not a model folder"
    (tmp_path / "config.json").write_text("{}")
    assert refusal(fd.check_files, W, tmp_path) == (
        f"{W}: {tmp_path} has no .safetensors weights (decodelab loads safetensors only)")
    assert refusal(fd.check_files, W, tmp_path, False) == (
        f"{W}: {tmp_path} has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        "vocab.json, vocab.txt)")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "has no tokenizer" in refusal(fd.check_files, W, tmp_path)


def test_each_tokenizer_file_is_enough_and_weights_may_be_absent_for_a_served_engine(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt"):
        (tmp_path / name).write_text("{}")
        fd.check_files(W, tmp_path, weights=False)
        assert fd.tokenizer_file(tmp_path) == str(tmp_path / name)
        (tmp_path / name).unlink()
    (tmp_path / "vocab.txt").write_text("a")
    (tmp_path / "tokenizer.model").write_text("a")
    assert fd.tokenizer_file(tmp_path) == str(tmp_path / "tokenizer.model")  # the first of the list
    (tmp_path / "vocab.txt").unlink()
    (tmp_path / "tokenizer.model").unlink()
    assert fd.tokenizer_file(tmp_path) == f"the tokenizer in {tmp_path}"


def test_a_json_file_of_the_folder_is_named_once(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert refusal(fd.read_json, W, path) == f"{W}: {path}: not JSON (Expecting property name enclosed in double " \
                                             "quotes at line 1)"
    path.write_text('{"a": 1}')
    assert fd.read_json(W, path) == {"a": 1}


def test_a_config_too_large_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(" " * (16 * 2**20) + "{}")
    message = refusal(fd.read_json, W, path)
    assert message.startswith(f"{W}: {path}:") and f"{path} {path}" not in message


# --- the config ----------------------------------------------------------------------------------------------------


BOUNDS = {  # the sizes a config may give: every key each family spells it with, its lowest and highest
    "num_hidden_layers": (1, 1024), "n_layer": (1, 1024), "num_layers": (1, 1024), "n_layers": (1, 1024),
    "hidden_size": (1, 131072), "n_embd": (1, 131072), "d_model": (1, 131072),
    "intermediate_size": (1, 1048576), "n_inner": (1, 1048576), "ffn_dim": (1, 1048576),
    "num_attention_heads": (1, 4096), "n_head": (1, 4096), "num_heads": (1, 4096),
    "num_key_value_heads": (1, 4096), "num_kv_heads": (1, 4096), "head_dim": (1, 4096),
    "vocab_size": (1, 16777216),
    "max_position_embeddings": (1, 16777216), "n_positions": (1, 16777216), "n_ctx": (1, 16777216),
    "max_sequence_length": (1, 16777216), "seq_length": (1, 16777216), "sliding_window": (1, 16777216),
}


def test_every_size_is_checked_at_both_edges():
    for key, (lo, hi) in BOUNDS.items():
        fd.check_sizes(W, "config.json", {key: lo})
        fd.check_sizes(W, "config.json", {key: hi})
        fd.check_sizes(W, "config.json", {key: None})
        for bad in (lo - 1, hi + 1, True, "8", 8.0):
            assert refusal(fd.check_sizes, W, "config.json", {key: bad}) == (
                f"{W}: config.json {key} {bad!r}: must be an integer in [{lo}, {hi}] (or absent); the folder's "
                "config is damaged or not a model's")
    fd.check_sizes(W, "config.json", {"other": -1})


def test_token_ids_are_integers_from_zero_or_lists_of_them():
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id"):
        for good in (0, 5, [0, 3], [], None):
            fd.check_token_ids(W, "lbl", {key: good})
        for bad in (-1, [1, -1], [1, "2"], "2", True, [False], 2.0):
            assert refusal(fd.check_token_ids, W, "lbl", {key: bad}) == (
                f"{W}: lbl {key} {bad!r}: expected a token id (an integer >= 0), a list of them, or null")


def test_a_multimodal_config_has_its_text_config_checked_too():
    text = {"vocab_size": 5}
    assert fd.configs({"a": 1, "text_config": text}) == [({"a": 1, "text_config": text}, "config.json"),
                                                         (text, "config.json text_config")]
    assert fd.configs({"text_config": "no"}) == [({"text_config": "no"}, "config.json")]


def test_a_nested_text_config_out_of_bounds_is_named(tmp_path):
    model_dir(tmp_path, config={"vocab_size": 10, "text_config": {"num_hidden_layers": 0}})
    assert refusal(fd.check_folder, "m", tmp_path) == (
        f"{W}: config.json text_config num_hidden_layers 0: must be an integer in [1, 1024] (or absent); the "
        "folder's config is damaged or not a model's")
    model_dir(tmp_path, config={"vocab_size": 10, "text_config": {"eos_token_id": -2}})
    assert "config.json text_config eos_token_id -2: expected a token id" in refusal(fd.check_folder, "m", tmp_path)


def test_a_config_that_is_not_an_object(tmp_path):
    model_dir(tmp_path, config=[1])
    assert refusal(fd.check_folder, "m", tmp_path) == f"{W}: {tmp_path / 'config.json'} is not a JSON object"


def generation_refusal(path, **values) -> str:
    path.write_text(json.dumps(values))
    return refusal(fd.check_generation_config, W, path)


def generation_passes(path, **values) -> None:
    path.write_text(json.dumps(values))
    fd.check_generation_config(W, path)


def test_the_generation_configs_integers(tmp_path):
    path = tmp_path / "generation_config.json"
    generation_passes(path, max_length=0, top_k=0, temperature=0, top_p=1.0, do_sample=False, use_cache=True,
                      eos_token_id=[1, 2])
    for key in ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "top_k", "num_beams",
                "num_return_sequences", "no_repeat_ngram_size"):
        generation_passes(path, **{key: None})
        for bad in (-1, 1.5, True, "3"):
            assert generation_refusal(path, **{key: bad}) == (
                f"{W}: generation_config.json {key} {bad!r}: expected an integer >= 0 or null")
    assert generation_refusal(path, eos_token_id=-1) == (
        f"{W}: generation_config.json eos_token_id -1: expected a token id (an integer >= 0), a list of them, or null")
    path.write_text("[]")
    assert refusal(fd.check_generation_config, W, path) == f"{W}: {path} is not a JSON object"


def test_the_generation_configs_numbers_and_flags(tmp_path):
    path = tmp_path / "generation_config.json"
    for key in ("temperature", "top_p", "typical_p", "min_p", "repetition_penalty", "length_penalty"):
        generation_passes(path, **{key: -2, "do_sample": None, "use_cache": None})
        generation_passes(path, **{key: 0.5})
        for bad in (True, "0.5", [1]):
            assert generation_refusal(path, **{key: bad}) == (
                f"{W}: generation_config.json {key} {bad!r}: expected a finite number or null")
        path.write_text('{"%s": Infinity}' % key)
        assert f"{key} inf: expected a finite number" in refusal(fd.check_generation_config, W, path)
        path.write_text('{"%s": NaN}' % key)
        assert f"{key} nan: expected a finite number" in refusal(fd.check_generation_config, W, path)
    for key in ("do_sample", "use_cache"):
        for bad in (1, 0, "true"):
            assert generation_refusal(path, **{key: bad}) == (
                f"{W}: generation_config.json {key} {bad!r}: expected true, false or null")


def test_check_folder_reads_the_generation_config_when_there(tmp_path):
    model_dir(tmp_path)
    assert sorted(fd.check_folder("m", tmp_path).tensors) == [
        "model.embed_tokens.weight", "model.layers.0.w.weight", "model.layers.1.w.weight"]
    (tmp_path / "generation_config.json").write_text('{"top_k": -1}')
    assert "generation_config.json top_k -1" in refusal(fd.check_folder, "m", tmp_path)


# --- the weights ---------------------------------------------------------------------------------------------------


def test_the_weight_files_an_index_names_else_model_safetensors_else_all(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "b.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    assert fd.weight_files(W, tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert fd.weight_files(W, tmp_path) == [tmp_path / "model.safetensors"]
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
    assert fd.weight_files(W, tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_an_index_whose_map_is_not_names_to_files(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    for doc in ([], {"weight_map": []}, {"weight_map": {"x": 3}}, {}):
        index.write_text(json.dumps(doc))
        assert refusal(fd.weight_files, W, tmp_path) == (
            f"{W}: {index} weight_map: expected an object of tensor name -> shard file")
    (tmp_path / "sub").mkdir()
    save_file({"a": torch.zeros(1)}, tmp_path / "sub" / "s.safetensors")
    index.write_text(json.dumps({"weight_map": {"x": "sub/s.safetensors"}}))
    assert refusal(fd.weight_files, W, tmp_path) == (
        f"{W}: {index} weight_map names 'sub/s.safetensors', which is not a file of the folder")


def test_an_index_naming_a_tensor_its_shard_lacks(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "s1.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "s2.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    tensors = fd.read_weights(W, tmp_path)
    assert tensors == {"a": fd.Tensor("s1.safetensors", "F32", (1,)), "b": fd.Tensor("s2.safetensors", "F32", (2,))}
    index.write_text(json.dumps({"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors"}}))
    assert refusal(fd.read_weights, W, tmp_path) == (
        f"{W}: {index} weight_map puts 'a' in s2.safetensors, whose header has no such tensor (a shard is missing "
        "or damaged)")
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "c": "s2.safetensors"}}))
    assert "puts 'c' in s2.safetensors" in refusal(fd.read_weights, W, tmp_path)


def test_a_tensor_in_two_shards_is_the_first_shards(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "s1.safetensors")
    save_file({"a": torch.zeros(3)}, tmp_path / "s2.safetensors")
    assert fd.read_weights(W, tmp_path) == {"a": fd.Tensor("s1.safetensors", "F32", (1,))}


def test_a_header_read_against_the_files_size(tmp_path):
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"1234567")
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file} is 7 bytes, too short to be a safetensors file (truncated?)")
    # a header exactly as long as the rest of the file is read; one byte longer is refused
    raw_safetensors(file, {}, 0)
    assert fd.read_header(W, file) == {}
    size = file.stat().st_size
    raw_safetensors(file, {}, 0, length=size - 7)
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file}: its header claims {size - 7} bytes but the file holds {size - 8} after the length (truncated, "
        "or not a safetensors file)")
    raw_safetensors(file, {"__metadata__": {"format": "pt"}, "t": {"dtype": "F32", "shape": [2],
                                                                   "data_offsets": [0, 8]}}, 8)
    assert fd.read_header(W, file) == {"t": fd.Tensor("w.safetensors", "F32", (2,))}
    raw_safetensors(file, {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 7)
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file}: tensor 't' ends at byte 8 of the data but the file holds 7 (the file is truncated)")


def test_a_header_past_the_limit_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "HEADER_BYTES", 16)  # the safetensors library's 100 MiB, scaled down
    file = tmp_path / "w.safetensors"
    file.write_bytes(struct.pack("<Q", 17) + b" " * 40)
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file}: its header claims 17 bytes but the file holds 40 after the length (truncated, or not a "
        "safetensors file)")
    raw_safetensors(file, {"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, 30)
    monkeypatch.setattr(fd, "HEADER_BYTES", file.stat().st_size - 38)
    assert fd.read_header(W, file) == {"t": fd.Tensor("w.safetensors", "U8", (1,))}


def test_a_header_that_is_not_json(tmp_path):
    file = tmp_path / "w.safetensors"
    file.write_bytes(struct.pack("<Q", 3) + b"{x}")
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file}: the header: not JSON (Expecting property name enclosed in double quotes at line 1)")
    raw_safetensors(file, [1], 0)
    assert refusal(fd.read_header, W, file) == f"{W}: {file}: the header is not a JSON object"


def test_a_header_entry_checked_field_by_field(tmp_path):
    file = tmp_path / "w.safetensors"
    bad = f"{W}: {file}: tensor 't'"

    def entry(value):
        return refusal(fd.header_entry, W, file, "t", value)

    assert entry([1]) == f"{bad}: its header entry is not an object"
    for dtype, shape in ((None, [1]), ("F32", None), ("F32", (1,)), ("F32", [-1]), ("F32", [True]), ("F32", [1.0])):
        assert entry({"dtype": dtype, "shape": shape, "data_offsets": [0, 4]}) == (
            f"{bad}: dtype {dtype!r} and shape {shape!r}: expected a dtype name and a list of sizes >= 0")
    for offsets in (None, [0], [0, 4, 8], [0, 4.0], [-1, 3], [5, 4], [True, 4]):
        assert entry({"dtype": "F32", "shape": [1], "data_offsets": offsets}) == (
            f"{bad}: data_offsets {offsets!r}: expected [start, end] with 0 <= start <= end")
    assert entry({"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 27]}) == (
        f"{bad}: F32 [2, 3] needs 24 bytes but its offsets span 23")
    assert fd.header_entry(W, file, "t", {"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 28]}) == (
        fd.Tensor("w.safetensors", "F32", (2, 3)), 28)
    assert fd.header_entry(W, file, "t", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})[1] == 0
    # a dtype of unknown width is left unchecked
    assert fd.header_entry(W, file, "t", {"dtype": "F4", "shape": [3], "data_offsets": [2, 4]})[1] == 4


def test_each_dtypes_width():
    widths = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
              "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}
    file = types.SimpleNamespace(name="w")
    for dtype, width in widths.items():
        assert fd.header_entry(W, file, "t", {"dtype": dtype, "shape": [3], "data_offsets": [0, 3 * width]})[1] == (
            3 * width)
        with pytest.raises(ModelLoadError):
            fd.header_entry(W, file, "t", {"dtype": dtype, "shape": [3], "data_offsets": [0, 3 * width + 1]})


def test_the_parameters_of_a_file_from_its_header(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16), "c": torch.zeros(())},
              tmp_path / "w.safetensors")
    assert fd.parameters_in(tmp_path / "w.safetensors") == 12 + 5 + 1


# --- the config against the weights --------------------------------------------------------------------------------


def checked(*names_shapes):
    return fd.Checked({name: fd.Tensor(file, "F32", shape) for name, shape, file in names_shapes})


def test_no_more_layers_than_the_weights_hold():
    weights = checked(("model.layers.0.w", (1,), "a.safetensors"), ("model.layers.2.w", (1,), "b.safetensors"),
                      ("lm_head.weight", (1,), "a.safetensors"))
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        fd.check_against_weights(W, {key: 3}, weights)
        assert refusal(fd.check_against_weights, W, {key: 4}, weights) == (
            f"{W}: config.json {key} 4: the weights (a.safetensors, b.safetensors) hold 3 layers; decodelab never "
            "runs layers the checkpoint lacks")
    assert "config.json text_config num_layers 4" in refusal(
        fd.check_against_weights, W, {"num_layers": 1, "text_config": {"num_layers": 4}}, weights)
    # weights without numbered layers, or a layer count that is not an integer, are not compared
    fd.check_against_weights(W, {"num_hidden_layers": 99}, checked(("lm_head.weight", (1,), "a")))
    fd.check_against_weights(W, {"num_hidden_layers": "99"}, weights)


def test_each_layer_naming_counts():
    for name in ("layers.4.w", "model.h.4.attn", "blocks.4.x", "encoder.layer.4.y", "block.4.z"):
        weights = checked((name, (1,), "a"))
        fd.check_against_weights(W, {"n_layer": 5}, weights)
        assert "hold 5 layers" in refusal(fd.check_against_weights, W, {"n_layer": 6}, weights)
    fd.check_against_weights(W, {"n_layer": 6}, checked(("xlayers.4.w", (1,), "a")))
    fd.check_against_weights(W, {"n_layer": 6}, checked(("layers.4", (1,), "a")))


def test_the_embedding_rows_equal_the_vocabulary():
    for name in ("model.embed_tokens.weight", "transformer.wte.weight", "word_embeddings.weight", "gpt.embed_in.weight",
                 "tok_embeddings.weight"):
        weights = checked((name, (10, 4), "a.safetensors"))
        fd.check_against_weights(W, {"vocab_size": 10}, weights)
        assert refusal(fd.check_against_weights, W, {"vocab_size": 11}, weights) == (
            f"{W}: config.json vocab_size 11: a.safetensors {name} has 10 rows; the config does not describe these "
            "weights")
    fd.check_against_weights(W, {"vocab_size": 11}, checked(("embed_tokens.weight", (10,), "a")))
    fd.check_against_weights(W, {"vocab_size": 11}, checked(("embed_tokens.bias", (10, 4), "a")))
    fd.check_against_weights(W, {"vocab_size": "10"}, checked(("embed_tokens.weight", (9, 4), "a")))
    assert "config.json text_config vocab_size 12" in refusal(
        fd.check_against_weights, W, {"vocab_size": 10, "text_config": {"vocab_size": 12}},
        checked(("embed_tokens.weight", (10, 4), "a")))


def test_check_folder_compares_the_config_with_the_weights(tmp_path):
    model_dir(tmp_path, config={"vocab_size": 10, "num_hidden_layers": 3})
    assert "num_hidden_layers 3: the weights (model.safetensors) hold 2 layers" in refusal(
        fd.check_folder, "m", tmp_path)
    assert fd.Checked().weight_files == []


# --- the loaded model ----------------------------------------------------------------------------------------------


class Emb:
    def __init__(self, rows):
        self.weight = torch.zeros(rows, 1)


def loaded(inputs=10, outputs=10, gen_eos=None, eos=None, vocab=None):
    model = types.SimpleNamespace(get_input_embeddings=lambda: Emb(inputs), get_output_embeddings=lambda: Emb(outputs),
                                  generation_config=types.SimpleNamespace(eos_token_id=gen_eos),
                                  config=types.SimpleNamespace(eos_token_id=eos))
    tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 9} if vocab is None else vocab)
    return model, tokenizer


def test_a_checkpoint_missing_parameters_names_three_and_counts_the_rest(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "b.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    model, tok = loaded()
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {"missing_keys": ["z", "y", "x", "w", "v"]}) == (
        f"{W}: the checkpoint (a.safetensors, b.safetensors) does not cover 5 parameter(s) of config.json: v, w, x "
        "and 2 more; decodelab never runs freshly initialised weights")
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {"missing_keys": ["c", "a", "b"]}).endswith(
        "does not cover 3 parameter(s) of config.json: a, b, c; decodelab never runs freshly initialised weights")
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {"missing_keys": {"q"}, "mismatched_keys": ["x"]}) \
        .endswith("does not cover 1 parameter(s) of config.json: q; decodelab never runs freshly initialised weights")
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok,
                   {"missing_keys": [], "mismatched_keys": [("d", 1), "c", "b", "a"]}) == (
        f"{W}: 4 tensor(s) of the checkpoint (a.safetensors, b.safetensors) do not have the shapes config.json gives: "
        "('d', 1), a, b")
    fd.check_loaded("m", tmp_path, model, tok, {"missing_keys": None, "mismatched_keys": None})
    fd.check_loaded("m", tmp_path, model, tok, {})


def test_the_tokenizers_top_id_needs_a_row_in_both_embeddings(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    model, tok = loaded(inputs=10, outputs=12)
    fd.check_loaded("m", tmp_path, model, tok, {})
    model, tok = loaded(inputs=12, outputs=9)
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {}) == (
        f"{W}: {tmp_path / 'vocab.json'}: token 'b' has id 9, beyond the model's 9 embedding rows (); the tokenizer "
        "does not belong to these weights")
    model, tok = loaded(inputs=9, outputs=12, vocab={"z": 8, "hi": 9, "a": 1})
    assert "token 'hi' has id 9, beyond the model's 9 embedding rows" in refusal(
        fd.check_loaded, "m", tmp_path, model, tok, {})
    model, tok = loaded(inputs=1, vocab={})
    fd.check_loaded("m", tmp_path, model, tok, {})


def test_the_end_ids_need_a_row(tmp_path):
    for gen_eos, eos, label, value in ((10, None, "generation_config.json", "10"),
                                       ([1, 10], None, "generation_config.json", "[1, 10]"),
                                       ((1, 10), 1, "generation_config.json", "(1, 10)"),
                                       (None, 12, "config.json", "12"), ([2], [3, 11], "config.json", "[3, 11]")):
        model, tok = loaded(gen_eos=gen_eos, eos=eos)
        assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {}) == (
            f"{W}: {label} eos_token_id {value}: beyond the model's 10 embedding rows")
    model, tok = loaded(gen_eos=[9], eos=9)
    fd.check_loaded("m", tmp_path, model, tok, {})
    model, tok = loaded(eos=9)
    del model.generation_config
    fd.check_loaded("m", tmp_path, model, tok, {})
    model.config.eos_token_id = 10
    assert "config.json eos_token_id 10" in refusal(fd.check_loaded, "m", tmp_path, model, tok, {})


def test_the_embedding_rows_are_the_smaller_of_input_and_output():
    model, _ = loaded(inputs=7, outputs=5)
    assert fd.embedding_rows(model) == 5 and type(fd.embedding_rows(model)) is int
    model.get_output_embeddings = lambda: None
    assert fd.embedding_rows(model) == 7
    model.get_output_embeddings = lambda: types.SimpleNamespace(weight=None)
    assert fd.embedding_rows(model) == 7
    model.get_input_embeddings = lambda: types.SimpleNamespace()
    model.get_output_embeddings = lambda: Emb(3)
    assert fd.embedding_rows(model) == 3


# the first run's survivors (2026-12-02): every check that check_folder runs names the model, and the edges of the
# missing-parameters line


def test_each_refusal_of_check_folder_names_the_model(tmp_path):
    def names_the_model(setup, needle):
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        model_dir(folder)
        setup(folder)
        message = refusal(fd.check_folder, "m", folder)
        assert message.startswith(f"{W}: ") and needle in message, message

    names_the_model(lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer")
    names_the_model(lambda f: (f / "config.json").write_text("{x"), "config.json: not JSON")
    names_the_model(lambda f: (f / "config.json").write_text('{"eos_token_id": -1}'), "eos_token_id -1")
    names_the_model(lambda f: (f / "generation_config.json").write_text('{"top_k": -1}'), "top_k -1")
    names_the_model(lambda f: (f / "model.safetensors").write_bytes(b"short"), "too short")
    names_the_model(lambda f: (f / "config.json").write_text('{"vocab_size": 11}'), "vocab_size 11")


def test_the_parameters_of_a_damaged_file_name_its_folder(tmp_path):
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"short")
    assert refusal(fd.parameters_in, file) == (
        f"--model {tmp_path}: {file} is 5 bytes, too short to be a safetensors file (truncated?)")


def test_four_missing_parameters_are_three_named_and_one_more(tmp_path):
    model, tok = loaded()
    assert refusal(fd.check_loaded, "m", tmp_path, model, tok, {"missing_keys": ["d", "c", "b", "a"]}).endswith(
        "does not cover 4 parameter(s) of config.json: a, b, c and 1 more; decodelab never runs freshly initialised "
        "weights")


def test_each_file_read_names_the_model(tmp_path):
    gen = tmp_path / "generation_config.json"
    gen.write_text("{x")
    assert refusal(fd.check_generation_config, W, gen).startswith(f"{W}: {gen}: not JSON")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{x")
    assert refusal(fd.weight_files, W, tmp_path).startswith(f"{W}: {index}: not JSON")
    index.write_text("[]")
    assert refusal(fd.read_weights, W, tmp_path) == (
        f"{W}: {index} weight_map: expected an object of tensor name -> shard file")
    file = raw_safetensors(tmp_path / "w.safetensors", {"t": [1]}, 0)
    assert refusal(fd.read_header, W, file) == f"{W}: {file}: tensor 't': its header entry is not an object"


def test_a_header_length_past_a_signed_integer_is_refused(tmp_path):
    file = tmp_path / "w.safetensors"
    file.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    assert refusal(fd.read_header, W, file) == (
        f"{W}: {file}: its header claims {2**64 - 1} bytes but the file holds 2 after the length (truncated, or not a "
        "safetensors file)")
