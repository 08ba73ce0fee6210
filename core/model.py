"""Where models and tokenizers meet transformers: loading (offline, safetensors only) and the forward call.

Every call into a transformers model goes through :func:`forward`, so an API rename (transformers 5 calls the
cache argument ``cache=`` and returns ``outputs.cache``; 4.x used ``past_key_values``) is handled here once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from .config import check_text
from .errors import ConfigError, ModelLoadError

BUNDLED = ("tiny", "tiny-draft")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_dir(name: str) -> Path:
    """The packaged folder of a bundled model (installed with the wheel, under decodelab/presets/models)."""
    return Path(str(resources.files("decodelab.presets") / "models" / name))


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise ConfigError(f"--device {name!r}: allowed: {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu or auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps: no MPS device is available here; use --device cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (fast and exact there), bfloat16 on CUDA when supported, else float16."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: allowed: {', '.join(DTYPES)}")
    if DTYPES[name] is not None:
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


@dataclass
class LoadedModel:
    """A model, its tokenizer and the facts decoding needs about them."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    eos_ids: list[int] = field(default_factory=list)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int | None:
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True the tokenizer's chat template wraps it as one user turn."""
        check_text("PROMPT", text)
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"--chat: the tokenizer of {self.name!r} has no chat template")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token, memoised: traces ask for the same few thousand ids again and again."""
        memo = self.__dict__.setdefault("_token_texts", {})
        text = memo.get(token_id)
        if text is None:
            text = memo[token_id] = self.decode([token_id])
        return text

    def token_id(self, text: str) -> int:
        """The id of a text that is exactly one token (for --logit-bias and friends)."""
        check_text("token", text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"{text!r} is {len(ids)} tokens for {self.name!r} ({ids}); give a single-token text or a token id"
            )
        return int(ids[0])


def _model_folder(spec: str) -> tuple[str, Path | None]:
    """Where to load from: a bundled folder, a local folder, or (None) an id to look up in the local HF cache."""
    if spec in BUNDLED:
        folder = bundled_dir(spec)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {spec}: the bundled model's files are missing from {folder}")
        return spec, folder
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(spec, path)
        return spec, path
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"--model {spec}: no model folder there; give a bundled name ({', '.join(BUNDLED)}), "
                             "a local model folder or a model id in the local Hugging Face cache")
    return spec, None


def set_threads(n: int) -> None:
    """torch's intra-op CPU threads (--threads); the default stays torch's own choice."""
    torch.set_num_threads(n)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_folder(spec: str, path: Path) -> None:
    """A local folder needs a config, safetensors weights and a tokenizer; say which is missing before loading."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec}: {path} has no config.json, so it is not a model folder")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"--model {spec}: {path} has no .safetensors weights (decodelab loads safetensors only)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"--model {spec}: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def load_model(
    spec: str = "tiny",
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    device_map: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer strictly offline, from safetensors weights only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    name, folder = _model_folder(spec)
    source = str(folder) if folder is not None else spec
    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
    except Exception as exc:  # transformers raises OSError/ValueError variants for a missing or foreign tokenizer
        raise ModelLoadError(_load_failure(spec, folder, "tokenizer", exc)) from exc
    kwargs = dict(common, dtype=torch_dtype, use_safetensors=True)
    if device_map is not None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ModelLoadError(f"--device-map {device_map}: needs the 'accelerate' package: "
                                 "pip install 'decodelab[multi-device]'")
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ImportError as exc:
        raise ModelLoadError(f"--device-map {device_map}: needs the 'accelerate' package: pip install "
                             f"'decodelab[multi-device]' ({exc})") from exc
    except Exception as exc:
        raise ModelLoadError(_load_failure(spec, folder, "model", exc)) from exc
    if device_map is None:
        model = model.to(dev)
    else:
        dev = next(model.parameters()).device
    model.eval()
    return LoadedModel(name, model, tokenizer, dev, torch_dtype, eos_token_ids(model, tokenizer))


def _load_failure(spec: str, folder: Path | None, what: str, exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0].rstrip(": ") if str(exc).strip() else type(exc).__name__
    if folder is None:
        return (f"--model {spec}: not a bundled name ({', '.join(BUNDLED)}), a local folder, or a model in the "
                f"local Hugging Face cache (decodelab never downloads): {first_line}")
    return f"--model {spec}: cannot load the {what} from {folder} (safetensors only): {first_line}"


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config, the model config, then the tokenizer."""
    candidates = []
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        candidates = [source] if isinstance(source, int) else list(source)
        if candidates:
            break
    return [int(i) for i in candidates]


def cache_kwarg(model) -> str:
    """The name of the KV-cache argument of this model's forward: 'cache' (transformers 5) or 'past_key_values'."""
    name = getattr(model, "_decodelab_cache_kwarg", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._decodelab_cache_kwarg = name
    return name


def forward(
    model,
    ids: Tensor,
    cache=None,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    logits_to_keep: int = 1,
    inference: bool = True,
) -> Tensor:
    """Run the model on ``ids`` [B, T] appending to ``cache``; returns float32 logits [B, logits_to_keep, V].

    ``logits_to_keep=0`` returns logits for all T positions. The cache object is updated in place.
    ``inference=False`` runs under no_grad instead of inference_mode: a cache that torch.compile mutates must not
    hold inference tensors.
    """
    with torch.inference_mode() if inference else torch.no_grad():
        return _forward(model, ids, cache, position_ids, attention_mask, logits_to_keep)


def _forward(model, ids, cache, position_ids, attention_mask, logits_to_keep) -> Tensor:
    kwargs = {cache_kwarg(model): cache, "use_cache": cache is not None, "logits_to_keep": logits_to_keep}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    out = model(input_ids=ids, **kwargs)
    return out.logits.float()


@torch.inference_mode()
def attention_weights(model, ids: Tensor) -> list[Tensor]:
    """Per-layer attention weights [B, H, T, T] of one causal forward over ``ids`` without a cache (eager attention
    for this call, since fused kernels do not return weights; the model's own implementation is restored)."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    finally:
        if previous not in (None, "eager"):
            model.set_attn_implementation(previous)
    return [a for a in out.attentions if a is not None]


def rotary_parameters(model) -> "Rotary | None":
    """The model's RoPE as a KV policy needs it (inv_freq, rope type, rotary dims), or None without RoPE."""
    from .kv import Rotary

    emb = None
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            emb = module
            break
    if emb is None:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = emb.inv_freq.detach().float()
    return Rotary(inv_freq=inv_freq, rope_type=str(emb.rope_type), rotary_dim=2 * int(inv_freq.shape[-1]),
                  head_dim=int(head_dim), attention_scaling=float(getattr(emb, "attention_scaling", 1.0)))


def model_info(model) -> "ModelInfo":
    """What a KV policy is told about the model: config, device, dtype, layer and head shapes, rotary parameters."""
    from .kv import ModelInfo

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    param = next(model.parameters())
    return ModelInfo(config=model.config, device=param.device, dtype=param.dtype, rotary=rotary_parameters(model),
                     num_layers=int(layers), kv_heads=int(kv_heads), head_dim=int(head_dim))


def safetensors_parameters(path: Path) -> int:
    """Count the parameters in a .safetensors file from its JSON header (8-byte little-endian length, then JSON)."""
    import json
    import math
    import struct

    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def describe_bundled() -> list[dict]:
    """What `decodelab models` lists: for each bundled model its size and shape, without loading weights."""
    import json

    rows = []
    for name in BUNDLED:
        folder = bundled_dir(name)
        config_file = folder / "config.json"
        if not config_file.is_file():
            rows.append({"name": name, "path": str(folder), "installed": False})
            continue
        cfg = json.loads(config_file.read_text())
        weights = sorted(folder.glob("*.safetensors"))
        rows.append({
            "name": name,
            "path": str(folder),
            "installed": True,
            "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
            "parameters": sum(safetensors_parameters(w) for w in weights),
            "layers": cfg.get("num_hidden_layers"),
            "hidden_size": cfg.get("hidden_size"),
            "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
            "context_length": cfg.get("max_position_embeddings"),
            "vocab_size": cfg.get("vocab_size"),
            "file_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
        })
    return rows


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' own ``model.generate`` on one prompt (the reference `bench` measures against); returns the
    generated ids. EOS is ignored (``eos_token_id=None``) so it produces exactly ``max_new_tokens`` tokens, as
    decodelab does with ``ignore_eos``; no ``min_new_tokens`` (that adds a processor to every step)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=None,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids) :].tolist()
def continuous_batching_generate(model, work: list[tuple[list[int], int]], max_batch: int, tokens_per_iteration: int,
                                 page_size: int) -> tuple[list[list[int]], float]:
    """transformers' own continuous batching (``init_continuous_batching``) over ``work`` = [(prompt ids, new
    tokens)], greedy with EOS off, the same batch size, tokens per iteration and page size as ours; returns each
    request's tokens and the wall seconds from the manager's start to the last result (a baseline for ``batch``)."""
    import logging
    import time

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    longest = max(len(p) + n for p, n in work)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in work))
    cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=max_batch * -(-longest // page_size),
                                   max_batch_tokens=tokens_per_iteration, max_requests_per_batch=max_batch,
                                   use_cuda_graph=False)
    with torch.inference_mode():
        start = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        manager.start()
        try:
            ids = [manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n) for i, (p, n) in
                   enumerate(work)]
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous-batching manager stopped before finishing")
                    continue
                if out.is_finished():
                    done[out.request_id] = [int(t) for t in out.generated_tokens]
        finally:
            manager.stop(block=True)
        seconds = time.perf_counter() - start
    return [done[i] for i in ids], seconds
