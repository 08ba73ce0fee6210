"""Loading a model: never a socket (a hub id is looked up in the local cache by path), and a model folder checked
before anything is built from it and after it is loaded. Each hostile folder is made here from the toy model; each
problem is one line naming the file and the field, exit status 2, and no network is needed to prove no network."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from safetensors.torch import load_file, save_file

from decodelab.core.engine.models import load_model
from decodelab.core.errors import ModelLoadError


def one_line_error(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


# --- offline -------------------------------------------------------------------------------------------------------


def test_the_network_guard_catches_a_hub_lookup(no_network):
    """The guard itself: a lookup the hub would make in a fresh process (its agent registry) is caught."""
    import socket

    with pytest.raises(OSError):
        socket.getaddrinfo("huggingface.co", 443)
    assert no_network == [("huggingface.co", 443)]


@pytest.mark.parametrize("args", [["sample", "Hi", "-m", "someorg/absent"],
                                  ["sample", "Hi", "-m", "meta-llama/Llama-3.1-8B-Instruct"],
                                  ["speculate", "Hi", "--draft", "someorg/absent", "-n", "2"],
                                  ["score", "Hello there", "--against", "gpt2"]])
def test_a_hub_id_absent_from_the_cache_is_refused_without_a_socket(cli, no_network, hf_cache, toy_model_dir, args):
    model = [] if "-m" in args else ["-m", str(toy_model_dir)]
    err = one_line_error(cli, *args, *model)
    assert "not a bundled name" in err and "never downloads" in err
    assert no_network == []


def test_a_hub_id_in_the_local_cache_loads_without_a_socket(cli, no_network, hf_cache, toy_model_dir):
    direct = json.loads(cli("sample", "Hi", "-m", toy_model_dir, "-n", "3", "-t", "0", "-f", "json")[1])
    code, out, err = cli("sample", "Hi", "-m", "someorg/toy", "-n", "3", "-t", "0", "-f", "json")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == direct["token_ids"]
    code, _, err = cli("speculate", "Hi", "-m", "someorg/toy", "--draft", "someorg/toy", "-n", "3", "-f", "json")
    assert code == 0, err
    assert no_network == []


def test_the_loader_itself_opens_no_socket(no_network, hf_cache):
    lm = load_model("someorg/toy", device="cpu")
    assert lm.name == "someorg/toy" and lm.folder.name == "0" * 40
    with pytest.raises(ModelLoadError, match="someorg/absent: not a bundled name"):
        load_model("someorg/absent", device="cpu")
    assert no_network == []


# --- hostile folders -----------------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path, toy_model_dir):
    """A copy of the toy model (2 Llama layers, 64 positions) to damage."""
    target = tmp_path / "model"
    shutil.copytree(toy_model_dir, target)
    return target


def edit_json(path, **values) -> None:
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.update(values)
    path.write_text(json.dumps(doc))


@pytest.fixture
def never_built(monkeypatch):
    """Fail the test if transformers is asked to build the model: the refusal must come before anything allocates."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built; the folder should have been refused first")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("values, needle", [
    ({"num_hidden_layers": 1_000_000_000}, "config.json num_hidden_layers 1000000000: must be an integer in [1, 1024]"),
    ({"num_hidden_layers": 3}, "config.json num_hidden_layers 3: the weights (model.safetensors) hold 2 layers"),
    ({"max_position_embeddings": -5}, "config.json max_position_embeddings -5: must be an integer in [1, 16777216]"),
    ({"hidden_size": "64"}, "config.json hidden_size '64': must be an integer"),
    ({"num_attention_heads": True}, "config.json num_attention_heads True: must be an integer"),
    ({"vocab_size": 10**6}, "config.json vocab_size 1000000: model.safetensors model.embed_tokens.weight has"),
    ({"eos_token_id": "</s>"}, "config.json eos_token_id '</s>': expected a token id"),
    ({"eos_token_id": [2, "x"]}, "config.json eos_token_id [2, 'x']: expected a token id"),
])
def test_a_damaged_config_is_refused_before_the_model_is_built(cli, folder, never_built, values, needle):
    edit_json(folder / "config.json", **values)
    err = one_line_error(cli, "sample", "Hi", "-m", folder, "-n", "530")
    assert f"--model {folder}: " in err and needle in err


@pytest.mark.parametrize("values, needle", [
    ({"eos_token_id": "2"}, "generation_config.json eos_token_id '2': expected a token id"),
    ({"eos_token_id": -1}, "generation_config.json eos_token_id -1: expected a token id"),
    ({"top_k": "50"}, "generation_config.json top_k '50': expected an integer >= 0"),
    ({"temperature": "hot"}, "generation_config.json temperature 'hot': expected a finite number"),
    ({"do_sample": "yes"}, "generation_config.json do_sample 'yes': expected true, false or null"),
])
def test_a_generation_config_field_of_the_wrong_type(cli, folder, never_built, values, needle):
    edit_json(folder / "generation_config.json", **values)
    assert needle in one_line_error(cli, "sample", "Hi", "-m", folder, "-n", "2")


def test_config_nested_past_the_bound_and_not_an_object(cli, folder, never_built):
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "config.json: nested deeper than 64 levels" in one_line_error(cli, "sample", "Hi", "-m", folder)
    (folder / "config.json").write_text("[1, 2]")
    assert "config.json is not a JSON object" in one_line_error(cli, "sample", "Hi", "-m", folder)


def test_a_truncated_checkpoint_is_refused_from_its_header(cli, folder, never_built):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    err = one_line_error(cli, "sample", "Hi", "-m", folder)
    assert f"{weights}: tensor " in err and "(the file is truncated)" in err


@pytest.mark.parametrize("make, needle", [
    (lambda data: data[:5], "too short to be a safetensors file"),
    (lambda data: struct.pack("<Q", 2**40) + data[8:], "its header claims 1099511627776 bytes"),
    (lambda data: struct.pack("<Q", 4) + b"[1] " + data[12:], "the header is not a JSON object"),
])
def test_a_safetensors_header_that_lies(cli, folder, never_built, make, needle):
    weights = folder / "model.safetensors"
    weights.write_bytes(make(weights.read_bytes()))
    assert needle in one_line_error(cli, "sample", "Hi", "-m", folder)


def test_a_shard_index_naming_a_missing_or_outside_file(cli, folder, never_built):
    index = folder / "model.safetensors.index.json"
    for shard, needle in (("model-00002.safetensors", "names 'model-00002.safetensors', which is not a file"),
                          ("../../etc/passwd", "names '../../etc/passwd', which is not a file")):
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
        assert needle in one_line_error(cli, "sample", "Hi", "-m", folder)


def test_a_checkpoint_missing_parameters_is_refused_naming_them(cli, folder):
    """The weights of layer 1 removed: transformers would initialise them at random (and say so only in a log
    decodelab silences); the run is refused with the names of what is missing."""
    weights = folder / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if ".layers.1.mlp." not in k}, weights, metadata={"format": "pt"})
    err = one_line_error(cli, "sample", "Hi", "-m", folder)
    assert "the checkpoint (model.safetensors) does not cover 3 parameter(s) of config.json" in err
    assert "model.layers.1.mlp.down_proj.weight" in err and "freshly initialised" in err


@pytest.mark.parametrize("command", [["sample", "Hi", "-n", "2"], ["score", "Hello there"]])
def test_a_tokenizer_beyond_the_embedding_rows(cli, folder, command):
    """A token id past the embedding's rows used to end in 'IndexError: index out of range in self'."""
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": rows + 50, "content": "<|beyond|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    err = one_line_error(cli, *command, "-m", folder)
    assert f"{folder / 'tokenizer.json'}: token '<|beyond|>' has id" in err and f"{rows} embedding rows" in err


def test_an_eos_id_beyond_the_embedding_rows(cli, folder):
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    edit_json(folder / "generation_config.json", eos_token_id=rows + 7)
    err = one_line_error(cli, "sample", "Hi", "-m", folder)
    assert f"generation_config.json eos_token_id {rows + 7}: beyond the model's {rows} embedding rows" in err


def test_an_import_error_while_loading_is_reported_as_itself(cli, folder, monkeypatch):
    """Only a missing accelerate under --device-map is about accelerate; any other import error is named."""
    from transformers import AutoModelForCausalLM

    def fails(*args, **kwargs):
        raise ImportError("No module named 'flash_attn'", name="flash_attn")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fails)
    err = one_line_error(cli, "sample", "Hi", "-m", folder)
    assert "loading it needs a module that failed to import: No module named 'flash_attn'" in err
    assert "accelerate" not in err


def test_the_bundled_and_toy_folders_pass_every_check(toy_model_dir):
    from decodelab.core.engine.folder import check_folder
    from decodelab.core.engine.models import bundled_dir

    for name, path in (("tiny", bundled_dir("tiny")), ("tiny-draft", bundled_dir("tiny-draft")),
                       ("toy", toy_model_dir)):
        checked = check_folder(name, path)
        assert checked.weight_files == ["model.safetensors"] and checked.tensors
