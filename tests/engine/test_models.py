"""core/engine/models.py without the CLI: devices and dtypes by name, the context length under each config name, end
ids in their order of precedence, the failure lines, `decodelab models`' table against the files themselves, and a
draft's vocabulary check."""

from __future__ import annotations

# mutation run of core/engine/models.py (2026-12-02)

import json
import types

import pytest
import torch

from decodelab.core.engine import models
from decodelab.core.errors import ConfigError, ModelLoadError


def test_a_device_name_outside_the_list_is_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        models.resolve_device("tpu")
    assert str(err.value) == "--device 'tpu': allowed: auto, cpu, cuda, mps"


def test_cpu_is_cpu_and_auto_is_cpu_without_an_accelerator(monkeypatch):
    assert models.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert models.resolve_device("auto") == torch.device("cpu")


def test_auto_prefers_cuda_then_mps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert models.resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.resolve_device("auto").type == "mps"


def test_an_absent_accelerator_asked_for_by_name_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        models.resolve_device("cuda")
    assert str(err.value) == "--device cuda: no CUDA device is available here; use --device cpu or auto"
    with pytest.raises(ConfigError) as err:
        models.resolve_device("mps")
    assert str(err.value) == "--device mps: no MPS device is available here; use --device cpu or auto"


def test_a_present_accelerator_by_name_is_that_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert models.resolve_device("cuda") == torch.device("cuda")
    assert models.resolve_device("mps") == torch.device("mps")


def test_dtype_names_and_auto_per_device(monkeypatch):
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    assert models.resolve_dtype("float32", cuda) is torch.float32
    assert models.resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert models.resolve_dtype("float16", cpu) is torch.float16
    assert models.resolve_dtype("auto", cpu) is torch.float32
    assert models.resolve_dtype("auto", mps) is torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert models.resolve_dtype("auto", cuda) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert models.resolve_dtype("auto", cuda) is torch.float16
    with pytest.raises(ConfigError) as err:
        models.resolve_dtype("int8", cpu)
    assert str(err.value) == "--dtype 'int8': allowed: auto, float32, bfloat16, float16"


def test_the_context_length_under_each_architectures_name():
    ns = types.SimpleNamespace
    assert models.context_length_of(ns(max_position_embeddings=512, n_positions=99)) == 512
    assert models.context_length_of(ns(n_positions=1024)) == 1024
    assert models.context_length_of(ns(max_sequence_length=2048)) == 2048
    # a name present but unusable gives way to the next one
    assert models.context_length_of(ns(max_position_embeddings=0, n_positions=7)) == 7
    assert models.context_length_of(ns(max_position_embeddings="512", max_sequence_length=9)) == 9
    assert models.context_length_of(ns(max_position_embeddings=1)) == 1
    assert models.context_length_of(ns()) is None
    assert models.context_length_of(ns(max_position_embeddings=-3)) is None


def test_end_ids_take_the_first_source_that_names_any():
    ns = types.SimpleNamespace
    assert models.end_ids(ns(eos_token_id=5), ns(eos_token_id=6), ns(eos_token_id=7)) == [5]
    assert models.end_ids(ns(eos_token_id=[3, 4]), ns(eos_token_id=6), ns(eos_token_id=7)) == [3, 4]
    assert models.end_ids(None, ns(eos_token_id=6), ns(eos_token_id=7)) == [6]
    assert models.end_ids(ns(eos_token_id=None), ns(), ns(eos_token_id=7)) == [7]
    # an empty list names none: the next source is asked
    assert models.end_ids(ns(eos_token_id=[]), ns(eos_token_id=(8, 9)), ns(eos_token_id=7)) == [8, 9]
    assert models.end_ids(ns(eos_token_id=0), ns(eos_token_id=6), None) == [0]
    assert models.end_ids(None, ns(), ns()) == []
    ids = models.end_ids(ns(eos_token_id=[torch.tensor(2)]), None, None)
    assert ids == [2] and type(ids[0]) is int


def test_the_eos_ids_of_a_model_come_from_its_generation_config_first():
    ns = types.SimpleNamespace
    model = ns(generation_config=ns(eos_token_id=[1, 2]), config=ns(eos_token_id=3))
    assert models.eos_token_ids(model, ns(eos_token_id=4)) == [1, 2]
    assert models.eos_token_ids(ns(config=ns(eos_token_id=3)), ns(eos_token_id=4)) == [3]


def test_a_failed_load_is_its_first_line_without_a_trailing_colon(tmp_path):
    exc = OSError("  Can't load tokenizer for 'x':  \nmore detail\n")
    assert models._load_failure("m", tmp_path, "tokenizer", exc) == (
        f"--model m: cannot load the tokenizer from {tmp_path} (safetensors only): Can't load tokenizer for 'x'")
    assert models._load_failure("m", tmp_path, "model", ValueError("  ")) == (
        f"--model m: cannot load the model from {tmp_path} (safetensors only): ValueError")


def test_an_import_failure_names_accelerate_only_under_a_device_map():
    missing = ImportError("No module named 'accelerate.utils'", name="accelerate.utils")
    assert models.import_failure("m", "auto", missing) == (
        "--device-map auto: needs the 'accelerate' package: pip install 'decodelab[multi-device]' "
        "(No module named 'accelerate.utils')")
    assert models.import_failure("m", None, missing) == (
        "--model m: loading it needs a module that failed to import: No module named 'accelerate.utils'")
    other = ImportError("  No module named 'flash_attn'\nsecond line", name="flash_attn")
    assert models.import_failure("m", "auto", other) == (
        "--model m: loading it needs a module that failed to import: No module named 'flash_attn'")
    assert models.import_failure("m", "auto", ImportError()) == (
        "--model m: loading it needs a module that failed to import: ImportError")
    # a module named like accelerate but not it
    assert "failed to import" in models.import_failure("m", "auto", ImportError("x", name="accelerated"))


def test_the_bundled_table_against_the_files_themselves():
    from safetensors import safe_open

    rows = models.describe_bundled()
    assert [r["name"] for r in rows] == ["tiny", "tiny-draft", "tiny-recall"]
    for row in rows:
        folder = models.bundled_dir(row["name"])
        cfg = json.loads((folder / "config.json").read_text())
        with safe_open(folder / "model.safetensors", "pt") as f:
            parameters = sum(f.get_tensor(k).numel() for k in f.keys())
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        assert row == {
            "name": row["name"], "path": str(folder), "installed": True, "architecture": "LlamaForCausalLM",
            "parameters": parameters, "layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
            "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
            "context_length": 512, "trained_context": 256, "vocab_size": 4096, "file_bytes": size,
        }
    assert rows[0]["layers"] == 12 and rows[1]["layers"] == 1 and rows[0]["hidden_size"] == 128


def test_the_bundled_table_of_a_folder_without_its_files_or_names(tmp_path, monkeypatch):
    """A bundled folder without config.json is listed as not installed; a config without architectures or KV heads
    falls back to the model type and the attention heads."""
    (tmp_path / "tiny").mkdir()
    draft = tmp_path / "tiny-draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 6}))
    monkeypatch.setattr(models, "bundled_dir", lambda name: tmp_path / name)
    rows = models.describe_bundled()
    assert rows[0] == {"name": "tiny", "path": str(tmp_path / "tiny"), "installed": False}
    assert rows[1]["architecture"] == "gpt2" and rows[1]["kv_heads"] == 6 and rows[1]["parameters"] == 0
    assert rows[1]["layers"] is None and rows[1]["file_bytes"] == len((draft / "config.json").read_bytes())


def test_a_model_spec_is_a_bundled_name_a_folder_or_a_cached_hub_id(tmp_path, hf_cache):
    assert models.model_folder("tiny") == models.bundled_dir("tiny")
    assert models.model_folder(str(tmp_path)) == tmp_path
    assert models.model_folder("someorg/toy") == hf_cache / "models--someorg--toy" / "snapshots" / ("0" * 40)
    for spec in (str(tmp_path / "absent"), "./absent", "~/absent-decodelab-folder"):
        with pytest.raises(ModelLoadError) as err:
            models.model_folder(spec)
        assert str(err.value) == (f"--model {spec}: no model folder there; give a bundled name "
                                  "(tiny, tiny-draft, tiny-recall), "
                                  "a local model folder or a model id in the local Hugging Face cache")
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    with pytest.raises(ModelLoadError, match="no model folder there"):
        models.model_folder(str(a_file))


def test_a_bundled_name_whose_files_are_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "bundled_dir", lambda name: tmp_path / name)
    with pytest.raises(ModelLoadError) as err:
        models.model_folder("tiny-draft")
    assert str(err.value) == f"--model tiny-draft: the bundled model's files are missing from {tmp_path / 'tiny-draft'}"


def test_a_hub_id_not_in_the_cache_or_not_an_id(hf_cache):
    with pytest.raises(ModelLoadError) as err:
        models.cached_snapshot("someorg/absent")
    assert str(err.value) == ("--model someorg/absent: not a bundled name (tiny, tiny-draft, tiny-recall), a local "
                              "folder, or a "
                              "model in the local Hugging Face cache (decodelab never downloads)")
    with pytest.raises(ModelLoadError) as err:
        models.cached_snapshot("a/b/c/d")
    from huggingface_hub.utils import validate_repo_id

    with pytest.raises(ValueError) as invalid:  # the hub's own reason, its first line
        validate_repo_id("a/b/c/d")
    assert str(err.value) == ("--model a/b/c/d: not a bundled name (tiny, tiny-draft, tiny-recall), a local folder, "
                              "or a model in "
                              "the local Hugging Face cache (decodelab never downloads): "
                              + str(invalid.value).strip().splitlines()[0])


def test_hub_offline_sets_the_switches_for_this_process_and_its_children(monkeypatch):
    import huggingface_hub.constants as hub

    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(hub, name, False)
    models.hub_offline()
    assert hub.HF_HUB_OFFLINE is True and hub.HF_HUB_DISABLE_TELEMETRY is True
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1"


# --- the vocabulary, a loaded model and a tokenizer alone ------------------------------------------------------------


def test_a_one_token_text_and_the_texts_that_are_not_one_token():
    tok = models.load_tokenizer("tiny")
    space_ids = tok.tokenizer.encode(" the", add_special_tokens=False)
    assert len(space_ids) == 1
    assert tok.token_id(" the") == space_ids[0] and type(tok.token_id(" the")) is int
    ids = tok.tokenizer.encode("Once upon", add_special_tokens=False)
    with pytest.raises(ConfigError) as err:
        tok.token_id("Once upon")
    assert str(err.value) == (f"'Once upon' is {len(ids)} tokens for 'tiny' ({ids}); give a single-token text or a "
                              "token id")
    with pytest.raises(ConfigError, match="token"):
        tok.token_id("")


def test_token_texts_are_memoised_per_vocabulary():
    tok = models.load_tokenizer("tiny")
    assert tok.token_text(261) == tok.tokenizer.decode([261])
    tok._token_texts[261] = "remembered"
    assert tok.token_text(261) == "remembered"
    assert models.load_tokenizer("tiny").token_text(261) != "remembered"


def test_decode_keeps_special_tokens_and_spaces():
    tok = models.load_tokenizer("tiny")
    eot = tok.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tok.tokenizer.encode("a ,b", add_special_tokens=False) + [eot]
    assert tok.decode(ids) == "a ,b<|endoftext|>"


def test_a_tokenizers_vocabulary_size_falls_back_to_its_length():
    tok = models.load_tokenizer("tiny")
    alone = models.LocalTokenizer("x", tok.tokenizer, types.SimpleNamespace())
    assert alone.vocab_size == len(tok.tokenizer) and alone.context_length is None and alone.eos_ids == []
    sized = models.LocalTokenizer("x", tok.tokenizer, types.SimpleNamespace(vocab_size=4096, n_positions=77))
    assert sized.vocab_size == 4096 and sized.context_length == 77


def test_a_loaded_model_is_on_its_device_in_eval_mode_with_its_end_ids(toy_model_dir):
    lm = models.load_model(str(toy_model_dir), device="cpu", dtype="bfloat16")
    assert lm.name == str(toy_model_dir) and lm.folder == toy_model_dir
    assert lm.device == torch.device("cpu") and lm.dtype is torch.bfloat16
    assert next(lm.model.parameters()).dtype is torch.bfloat16 and not lm.model.training
    assert lm.config is lm.model.config and lm.context_length == 64
    assert lm.vocab_size == lm.model.get_output_embeddings().weight.shape[0] and type(lm.vocab_size) is int
    assert lm.eos_ids == [lm.tokenizer.eos_token_id]


def test_a_tokenizer_that_will_not_load_is_one_line(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import shutil

    for f in models.bundled_dir("tiny").iterdir():
        shutil.copy(f, tmp_path / f.name)

    def fails(*args, **kwargs):
        raise OSError("Can't load tokenizer:\nsecond line")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fails)
    with pytest.raises(ModelLoadError) as err:
        models.load_model(str(tmp_path), device="cpu")
    assert str(err.value) == (f"--model {tmp_path}: cannot load the tokenizer from {tmp_path} (safetensors only): "
                              "Can't load tokenizer")
    with pytest.raises(ModelLoadError) as err:
        models.load_tokenizer(str(tmp_path))
    assert str(err.value).startswith(f"--model {tmp_path}: cannot load the tokenizer from")


def test_a_device_map_without_accelerate_is_refused_before_loading(monkeypatch):
    import importlib.util

    from transformers import AutoModelForCausalLM

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ModelLoadError) as err:
        models.load_model("tiny-draft", device="cpu", device_map="auto")
    assert str(err.value) == ("--device-map auto: needs the 'accelerate' package: pip install "
                              "'decodelab[multi-device]'")


def test_load_model_passes_its_options_to_transformers(monkeypatch):
    """What transformers is asked for: local files, safetensors, the dtype, the loading info, and the device map
    when given (the model's device is then its first parameter's)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained
    asked = []

    def recording(folder, **kwargs):
        asked.append(dict(kwargs))
        kwargs.pop("device_map", None)  # accelerate is not installed here: load as without a map
        return real(folder, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "accelerate" else
                        real_find(name, *a))
    lm = models.load_model("tiny-draft", device="cpu", dtype="float16", device_map="cpu")
    assert asked == [{"local_files_only": True, "trust_remote_code": False, "dtype": torch.float16,
                      "use_safetensors": True, "output_loading_info": True, "device_map": "cpu"}]
    assert lm.device == torch.device("cpu") and lm.dtype is torch.float16 and not lm.model.training
    models.load_model("tiny-draft", device="cpu", trust_remote_code=True)
    assert asked[1] == {"local_files_only": True, "trust_remote_code": True, "dtype": torch.float32,
                        "use_safetensors": True, "output_loading_info": True}


def test_a_model_that_will_not_build_is_one_line(monkeypatch):
    from transformers import AutoModelForCausalLM

    def fails(*args, **kwargs):
        raise ValueError("Unrecognized configuration class:\nmore")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fails)
    folder = models.bundled_dir("tiny-draft")
    with pytest.raises(ModelLoadError) as err:
        models.load_model("tiny-draft", device="cpu")
    assert str(err.value) == (f"--model tiny-draft: cannot load the model from {folder} (safetensors only): "
                              "Unrecognized configuration class")

    def missing(*args, **kwargs):
        raise ImportError("No module named 'accelerate'", name="accelerate")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", missing)
    with pytest.raises(ModelLoadError) as err:
        models.load_model("tiny-draft", device="cpu")
    assert str(err.value) == ("--model tiny-draft: loading it needs a module that failed to import: No module named "
                              "'accelerate'")


def test_a_tokenizer_alone_takes_its_end_ids_from_the_generation_config_then_the_config(tmp_path):
    import shutil

    for f in models.bundled_dir("tiny").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert models.load_tokenizer(str(tmp_path)).eos_ids == [3, 4]
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = models.load_tokenizer(str(tmp_path))
    assert tok.eos_ids == [7] and tok.name == str(tmp_path) and tok.folder == tmp_path
    assert tok.config.eos_token_id == 7


# --- a draft ---------------------------------------------------------------------------------------------------------


def stand_in(vocab_size=10, vocab=None, device="cpu"):
    tokenizer = types.SimpleNamespace(get_vocab=lambda: dict(vocab if vocab is not None else {"a": 0, "b": 1}))
    return types.SimpleNamespace(vocab_size=vocab_size, tokenizer=tokenizer, device=torch.device(device))


def test_a_draft_shares_the_targets_output_size_and_token_ids():
    models.check_same_vocabulary(stand_in(), stand_in(), "d")
    with pytest.raises(ConfigError) as err:
        models.check_same_vocabulary(stand_in(10), stand_in(12), "d")
    assert str(err.value) == ("--draft d: vocabulary 12 differs from the target's 10; the draft must share the "
                              "target's tokenizer and output size")
    with pytest.raises(ConfigError) as err:
        models.check_same_vocabulary(stand_in(), stand_in(vocab={"a": 1, "b": 0}), "d")
    assert str(err.value) == ("--draft d: its tokenizer maps tokens to ids differently from the target's (both have "
                              "10 outputs); use a draft trained with the same tokenizer")


def test_a_draft_is_loaded_on_the_targets_device_and_named_by_its_option(monkeypatch):
    asked = []

    def loading(spec, **kwargs):
        asked.append((spec, kwargs))
        return stand_in(vocab_size=12 if spec == "wide" else 10)

    monkeypatch.setattr(models, "load_model", loading)
    target = stand_in()
    assert models.load_draft("d", target, "float16", True).vocab_size == 10
    assert asked == [("d", {"device": "cpu", "dtype": "float16", "trust_remote_code": True})]
    with pytest.raises(ConfigError) as err:
        models.load_draft("wide", target, "auto", False, option="--against")
    assert str(err.value) == ("--against wide: vocabulary 12 differs from the target's 10; --against must share the "
                              "target's tokenizer and output size")
    with pytest.raises(ConfigError) as err:
        models.load_draft("wide", target, "auto", False)
    assert str(err.value) == ("--draft wide: vocabulary 12 differs from the target's 10; --draft must share the "
                              "target's tokenizer and output size")


def test_a_draft_that_fails_to_load_is_named_by_its_option(monkeypatch):
    def failing(spec, **kwargs):
        raise ModelLoadError(f"--model {spec}: not a bundled name; --model {spec} again")

    monkeypatch.setattr(models, "load_model", failing)
    with pytest.raises(ModelLoadError) as err:
        models.load_draft("x/y", stand_in(), "auto", False, option="--against")
    assert str(err.value) == "--against x/y: not a bundled name; --model x/y again"
    assert err.value.__cause__ is None and err.value.__suppress_context__


# --- cores -----------------------------------------------------------------------------------------------------------


def cpuinfo(monkeypatch, text, usable=8):
    monkeypatch.setattr(models, "usable_cpus", lambda: usable)

    class FakePath:
        def __init__(self, name):
            assert name == "/proc/cpuinfo"

        def read_text(self):
            if text is None:
                raise OSError("no such file")
            return text

    monkeypatch.setattr(models, "Path", FakePath)


def block(n, physical="0", core=None):
    core = n if core is None else core
    return f"processor\t: {n}\nphysical id\t: {physical}\ncore id\t\t: {core}\nflags\t\t: a:b"


def test_physical_cores_count_hyperthreads_once(monkeypatch):
    # 4 logical CPUs, 2 cores with 2 threads each, all usable: 2
    cpuinfo(monkeypatch, "\n\n".join([block(0, core=0), block(1, core=1), block(2, core=0), block(3, core=1)]) + "\n",
            usable=4)
    assert models.physical_cores() == 2
    # two sockets with the same core ids are distinct cores
    cpuinfo(monkeypatch, "\n\n".join([block(0, "0", 0), block(1, "1", 0)]), usable=2)
    assert models.physical_cores() == 2
    # an affinity mask of 3 of 8 logical CPUs on 4 cores: 3 * 4 // 8 = 1
    cpuinfo(monkeypatch, "\n\n".join(block(i, core=i % 4) for i in range(8)), usable=3)
    assert models.physical_cores() == 1
    # 1 usable of 8 logical on 4 cores rounds down to 0: at least one
    cpuinfo(monkeypatch, "\n\n".join(block(i, core=i % 4) for i in range(8)), usable=1)
    assert models.physical_cores() == 1


def test_physical_cores_without_core_ids_or_cpuinfo_are_the_usable_cpus(monkeypatch):
    cpuinfo(monkeypatch, None, usable=5)
    assert models.physical_cores() == 5
    cpuinfo(monkeypatch, "processor\t: 0\nmodel name\t: x\n\nprocessor\t: 1\n", usable=5)
    assert models.physical_cores() == 5
    cpuinfo(monkeypatch, "Hardware\t: x\n", usable=6)
    assert models.physical_cores() == 6


def test_threads_are_set_for_torch():
    before = torch.get_num_threads()
    try:
        models.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_load_average_is_read_when_not_given(monkeypatch):
    monkeypatch.setattr(models.os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    choice = models.choose_threads(None, environ={}, cores=2)
    assert choice.threads == 1 and choice.note.startswith("note: load average 7.0 on 2 cores")
    monkeypatch.setattr(models, "physical_cores", lambda: 3)
    assert models.choose_threads(None, environ={}, load=0.0).threads == 3
    assert models.choose_threads(None, environ={"OMP_NUM_THREADS": " 2 "}, load=9.0, cores=2).note == (
        "note: load average 9.0 on 2 cores: the machine looks oversubscribed; with 2 torch threads each waits on the "
        "others (--threads 1 avoids it)")
    assert models.choose_threads(None, environ={"OMP_NUM_THREADS": "x"}, load=9.0, cores=2) == models.ThreadChoice(
        1, "note: load average 9.0 on 2 cores: the machine looks oversubscribed; torch runs on 1 thread (--threads N "
        "to choose)")


# --- the second round: what the first run's survivors asked for ----------------------------------------------------


class RecordingTokenizer:
    """A tokenizer stand-in that records how it is asked: encode adds a 1 in front when asked for special tokens."""

    def __init__(self):
        self.asked = []

    def encode(self, text, **kwargs):
        self.asked.append(("encode", kwargs))
        return ([1] if kwargs.get("add_special_tokens") else []) + [ord(c) for c in text]

    def decode(self, ids, **kwargs):
        self.asked.append(("decode", kwargs))
        return "".join(chr(i) for i in ids)


def test_encode_adds_special_tokens_and_decode_keeps_them_and_the_spaces():
    tok = RecordingTokenizer()
    vocab = models.LocalTokenizer("x", tok, types.SimpleNamespace())
    assert vocab.encode("ab") == [1, 97, 98]
    assert vocab.decode([97, 98]) == "ab"
    assert vocab.token_id("a") == 97
    assert tok.asked == [("encode", {"add_special_tokens": True}),
                         ("decode", {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}),
                         ("encode", {"add_special_tokens": False})]


def test_encode_with_chat_hands_the_template_the_tokenizer_text_name_and_folder(monkeypatch, tmp_path):
    handed = []
    monkeypatch.setattr(models, "chat_ids", lambda *args: handed.append(args) or [7])
    tok = RecordingTokenizer()
    vocab = models.LocalTokenizer("m", tok, types.SimpleNamespace(), folder=tmp_path)
    assert vocab.encode("hi", chat=True) == [7]
    assert handed == [(tok, "hi", "m", tmp_path)] and tok.asked == []


def test_undecodable_text_is_refused_under_its_own_name():
    vocab = models.LocalTokenizer("x", RecordingTokenizer(), types.SimpleNamespace())
    for call, name in ((vocab.encode, "PROMPT"), (vocab.token_id, "token")):
        with pytest.raises(ConfigError) as err:
            call("caf\udce9")
        assert str(err.value) == (f"{name} 'caf\\\\udce9': not valid UTF-8 (an undecodable byte at character 3); "
                                  "give UTF-8 text")


def test_the_end_ids_of_a_model_fall_back_to_its_tokenizer():
    ns = types.SimpleNamespace
    assert models.eos_token_ids(ns(config=ns()), ns(eos_token_id=4)) == [4]


def test_a_failed_loads_line_loses_only_its_trailing_colons_and_spaces(tmp_path):
    assert models._load_failure("m", tmp_path, "model", OSError("bad value X: ")).endswith(": bad value X")


def test_without_a_load_average_the_machine_counts_as_idle(monkeypatch):
    monkeypatch.delattr(models.os, "getloadavg")
    # 4 cores (issue 40: on 2 cores the default is 1 thread whatever the load, so 2 cores cannot tell idle from busy)
    assert models.choose_threads(None, environ={}, cores=4) == models.ThreadChoice(4)


def test_the_defaults_load_the_bundled_tiny_on_the_automatic_device():
    lm = models.load_model()
    assert lm.name == "tiny" and lm.device == models.resolve_device("auto") and lm.dtype is torch.float32
    assert models.load_tokenizer().name == "tiny"


def test_a_model_is_moved_to_the_device_asked_for(monkeypatch):
    monkeypatch.setattr(models, "resolve_device", lambda name: torch.device("meta"))
    lm = models.load_model("tiny-draft", dtype="float32")
    assert lm.device == torch.device("meta") and next(lm.model.parameters()).device == torch.device("meta")


def copied(tmp_path, name="tiny-draft", weights=True):
    import shutil

    for f in models.bundled_dir(name).iterdir():
        if weights or f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_a_loaded_model_that_fails_its_checks_is_named_by_its_spec(tmp_path):
    folder = copied(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 5000}))
    with pytest.raises(ModelLoadError) as err:
        models.load_model(str(folder), device="cpu")
    assert str(err.value) == (f"--model {folder}: generation_config.json eos_token_id 5000: beyond the model's 4096 "
                              "embedding rows")


def test_without_end_ids_in_either_config_the_tokenizers_is_taken(tmp_path):
    folder = copied(tmp_path)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = None
    (folder / "config.json").write_text(json.dumps(config))
    lm = models.load_model(str(folder), device="cpu")
    eot = lm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert lm.eos_ids == [eot]
    assert models.load_tokenizer(str(folder)).eos_ids == [eot]


def test_the_tokenizer_config_and_generation_config_are_read_locally(monkeypatch):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    asked = []
    for cls in (AutoTokenizer, AutoConfig, GenerationConfig):
        real = cls.from_pretrained

        def recording(folder, real=real, name=cls.__name__, **kwargs):
            asked.append((name, folder, kwargs))
            return real(folder, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", recording)
    folder = str(models.bundled_dir("tiny"))
    models.load_tokenizer("tiny", trust_remote_code=True)
    ours = [a for a in asked if "_from_auto" not in a[2]]  # AutoTokenizer asks AutoConfig itself, marked so
    assert ours == [("AutoTokenizer", folder, {"local_files_only": True, "trust_remote_code": True}),
                    ("AutoConfig", folder, {"local_files_only": True, "trust_remote_code": True}),
                    ("GenerationConfig", folder, {"local_files_only": True})]
    asked.clear()
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ModelLoadError):
        models.load_model("tiny", device="cpu")
    assert asked[0] == ("AutoTokenizer", folder, {"local_files_only": True, "trust_remote_code": False})


def test_a_missing_accelerate_under_a_device_map_is_told_to_install_it(monkeypatch):
    import importlib.util

    from transformers import AutoModelForCausalLM

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "accelerate" else
                        real_find(name, *a))

    def missing(*args, **kwargs):
        raise ImportError("No module named 'accelerate.big_modeling'", name="accelerate.big_modeling")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", missing)
    with pytest.raises(ModelLoadError) as err:
        models.load_model("tiny-draft", device="cpu", device_map="auto")
    assert str(err.value) == ("--device-map auto: needs the 'accelerate' package: pip install "
                              "'decodelab[multi-device]' (No module named 'accelerate.big_modeling')")


# the rerun's survivors (2026-12-02, third round)


def test_a_tokenizer_alone_that_will_not_load_names_its_folder_and_reason(tmp_path, monkeypatch):
    from transformers import AutoConfig

    folder = copied(tmp_path, weights=False)

    def fails(*args, **kwargs):
        raise OSError("config unreadable:\nsecond line")

    monkeypatch.setattr(AutoConfig, "from_pretrained", fails)
    with pytest.raises(ModelLoadError) as err:
        models.load_tokenizer(str(folder))
    assert str(err.value) == (f"--model {folder}: cannot load the tokenizer from {folder} (safetensors only): config "
                              "unreadable")


def test_a_tokenizer_alone_needs_a_tokenizer_file_and_trusts_no_remote_code_by_default(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as err:
        models.load_tokenizer(str(tmp_path))
    assert str(err.value) == (f"--model {tmp_path}: {tmp_path} has no tokenizer (none of tokenizer.json, "
                              "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt)")
    from transformers import AutoTokenizer

    asked = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda folder, **kw: asked.append(kw) or real(folder, **kw))
    models.load_tokenizer("tiny")
    assert asked == [{"local_files_only": True, "trust_remote_code": False}]
