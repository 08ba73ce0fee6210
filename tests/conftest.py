"""Shared fixtures: small random models of several architectures built offline from configs, and a CLI runner."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# The models in tests are tiny: one thread is as fast, and it avoids OpenMP spin-waits when the two cores are busy;
# OMP_NUM_THREADS tells the CLI's default the same (so a busy machine prints no note into a test's stderr)
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]
# tests/ mirrors core/ (sampling/, kv/, engine/, trace/, methods/, analysis/, cli/, layout/); a test module may import
# the shared vectors of another folder's module by name (from test_semantics import LLAMACPP_VECTORS)
sys.path[:0] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir()) if folder.is_dir()]
BUNDLED_TOKENIZER = ROOT / "presets" / "models" / "tiny"
NEG = float("-inf")  # the logit of a removed candidate


def small_config(arch: str, vocab_size: int = 256, **overrides):
    """A tiny random config per architecture: GQA for Llama/Qwen2, absolute positions for GPT-2, soft-capping for
    Gemma 2 (its final logits pass through 30 * tanh(z / 30) inside the model)."""
    from transformers import Gemma2Config, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, max_position_embeddings=256, **common)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **common)
    elif arch == "gemma2":
        cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=16,
                           final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **common)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def random_model(arch: str, seed: int = 0, vocab_size: int = 256, scale: float = 1.0, **overrides):
    """A random model whose output logits are spread out enough (scale) for greedy ties to be unlikely."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small_config(arch, vocab_size, **overrides), attn_implementation="eager")
    if scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(scale)
    return model.eval()


ARCHS = ["llama", "qwen2", "gpt2", "gemma2"]


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads():
    """Count every read of a tensor's values into Python (what is a device-to-host transfer on a GPU): ``.item()``,
    ``.tolist()``, ``.cpu()``, ``.numpy()`` and ``bool/int/float/index`` of a tensor. Yields a Counter by method."""
    counts: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, method):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)
        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory) -> Path:
    """A saved random Llama (GQA) with the bundled byte-level BPE tokenizer: a real model folder for CLI tests."""
    folder = tmp_path_factory.mktemp("toy")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUNDLED_TOKENIZER / name).exists():
            shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = random_model("llama", seed=1, vocab_size=max(vocab, len(tok)), scale=20.0,
                         eos_token_id=tok.eos_token_id, max_position_embeddings=64)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture
def cli(capsys):
    """Run `decodelab ARGS...` in-process through the real entry point; returns (exit code, stdout, stderr)."""
    from decodelab.cli.main import main

    def run(*args: str):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def no_network(monkeypatch):
    """Networking made to fail loudly: every connect, DNS lookup and connection attempt is recorded and refused. The
    hub's own state is reset to a fresh process's (offline off, no agent registry loaded or cached), so a loader that
    would reach out does so here. Yields the list of attempts."""
    import socket

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access in a test that proves none is made")

    for owner, name in ((socket.socket, "connect"), (socket.socket, "connect_ex"), (socket, "create_connection"),
                        (socket, "getaddrinfo")):
        monkeypatch.setattr(owner, name, refuse)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.utils._detect_agent._registry", None, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.AGENT_HARNESSES_PATH", "/nonexistent/agents.json", raising=False)
    yield attempts


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, toy_model_dir):
    """A local Hugging Face cache holding the toy model as hub id someorg/toy (revision main); returns its root."""
    root = tmp_path / "hub"
    snapshot = root / "models--someorg--toy" / "snapshots" / ("0" * 40)
    shutil.copytree(toy_model_dir, snapshot)
    (root / "models--someorg--toy" / "refs").mkdir()
    (root / "models--someorg--toy" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root))
    return root


# --- the public paths that tests once reached through test-only functions of core ---------------------------------


def build(settings, vocab: int, seed: int, device, eos_ids=(), stop_ids=(), encode=None, token_id=None,
          token_text=None):
    """The plan, chain and selector of ``settings`` as a run builds them (``build_sampler``): the selector from the
    semantics plan, the chain from ``chain_for`` sharing the selector's generator (one seed for the draws and XTC's
    coin); token-naming settings resolved with the tokenizer's functions if given."""
    from decodelab.core.sampling.chain import chain_for
    from decodelab.core.sampling.select import make_generator
    from decodelab.core.sampling.semantics import plan
    from decodelab.core.sampling.tokens import Tokens

    selector = plan(settings).make_selector(seed, device)
    generator = getattr(selector, "generator", None) or make_generator(seed, device)
    p, chain = chain_for(settings, Tokens(vocab, encode, token_id, token_text), generator, eos_ids, stop_ids)
    return p, chain, selector


def stage_table(stages):
    """Per stage (row 0 of each [1, V] logits): its StageStat (candidates kept, entropy after it, mass removed) with
    its probabilities, from ``trace.stats.stage_numbers`` as ``probs`` reads them."""
    from decodelab.core.trace.records import StageStat
    from decodelab.core.trace.stats import stage_numbers

    probs, _, stats = stage_numbers(torch.stack([z[0] for _, z in stages]))
    return [(StageStat(name, int(k), h, m), probs[i])
            for i, ((name, _), (k, h, m)) in enumerate(zip(stages, stats.tolist()))]


def stage_stats(stages):
    """[S, 3] per stage of row 0: candidates kept, entropy after it, mass removed (``stage_numbers``' statistics)."""
    from decodelab.core.trace.stats import stage_numbers

    return stage_numbers(torch.stack([z[0] for _, z in stages]))[2]
