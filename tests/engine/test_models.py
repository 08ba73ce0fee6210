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
    assert [r["name"] for r in rows] == ["tiny", "tiny-draft"]
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
        assert str(err.value) == (f"--model {spec}: no model folder there; give a bundled name (tiny, tiny-draft), "
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
    assert str(err.value) == ("--model someorg/absent: not a bundled name (tiny, tiny-draft), a local folder, or a "
                              "model in the local Hugging Face cache (decodelab never downloads)")
    with pytest.raises(ModelLoadError) as err:
        models.cached_snapshot("a/b/c/d")
    message = str(err.value)
    assert message.startswith("--model a/b/c/d: not a bundled name") and "(decodelab never downloads): " in message
    assert "\n" not in message


def test_hub_offline_sets_the_switches_for_this_process_and_its_children(monkeypatch):
    import huggingface_hub.constants as hub

    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(hub, name, False)
    models.hub_offline()
    assert hub.HF_HUB_OFFLINE is True and hub.HF_HUB_DISABLE_TELEMETRY is True
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
