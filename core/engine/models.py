"""Where models and tokenizers meet transformers: finding a model (bundled name, local folder, or a hub id already
in the local cache), checking its folder (:mod:`.folder`), loading it offline from safetensors only, and what a
loaded model offers the rest of decodelab (:class:`LoadedModel`: encode, decode, token texts, end ids, context
length).

Offline means no socket: huggingface_hub is put in offline mode before any lookup (it reads HF_HUB_OFFLINE once, at
import, and would otherwise fetch its agent registry even for local files), and a hub id is resolved to its snapshot
folder in the local cache by path alone, so transformers only ever sees a local folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, ModelLoadError
from ..inputs import check_text, usable_cpus
from .chat import chat_ids
from .folder import check_files, check_folder, check_loaded, parameters_in
from .locate import BUNDLED, bundled_dir, cached_snapshot, hub_offline  # noqa: F401 (decodelab's names for them)
from .locate import model_folder as find_model_folder
from .machine_load import load_average

# the windows the bundled models were trained on (presets/train_models.py and train_recall.py: sequence length
# 256), shorter than the positions their config allows (max_position_embeddings 512): past 256 tokens they
# extrapolate
TRAINED_CONTEXT = {"tiny": 256, "tiny-draft": 256, "tiny-recall": 256}
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def context_length_of(cfg) -> int | None:
    """The positions a config allows, under whichever name its architecture uses."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class Vocabulary:
    """What a tokenizer offers decoding (``self.name``, ``self.tokenizer``, ``self.folder``): encode, decode, token
    texts, the id of a one-token text. Shared by a loaded model and a tokenizer loaded alone (for a served engine)."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True the tokenizer's chat template wraps it as one user turn."""
        check_text("PROMPT", text)
        if chat:
            return chat_ids(self.tokenizer, text, self.name, self.folder)
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



@dataclass
class LoadedModel(Vocabulary):
    """A model, its tokenizer and the facts decoding needs about them."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    eos_ids: list[int] = field(default_factory=list)
    folder: Path | None = None  # where it was loaded from (its chat template's file is named from it)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int | None:
        return context_length_of(self.model.config)


@dataclass
class LocalTokenizer(Vocabulary):
    """A model's tokenizer and config without its weights: what a served engine needs locally (token ids in,
    token texts out, the vocabulary to check the server's against). ``device`` and ``dtype`` are the server's
    business."""

    name: str
    tokenizer: object
    config: object
    eos_ids: list[int] = field(default_factory=list)
    folder: Path | None = None
    device = None
    dtype = None

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.config, "vocab_size", None) or len(self.tokenizer))

    @property
    def context_length(self) -> int | None:
        return context_length_of(self.config)


def model_folder(spec: str) -> Path:
    """Where to load from (:func:`.locate.model_folder`, torch-free so the CLI can check ``-m`` before torch loads),
    with this module's :func:`bundled_dir`."""
    return find_model_folder(spec, bundled_dir)


def set_threads(n: int) -> None:
    """torch's intra-op CPU threads (--threads, or :func:`choose_threads`)."""
    torch.set_num_threads(n)


@dataclass(frozen=True)
class ThreadChoice:
    """torch's CPU thread count for a run (None: leave torch's own, which follows ``OMP_NUM_THREADS``), and one line
    for the user when the machine looks oversubscribed (else None)."""

    threads: int | None
    note: str | None = None


def choose_threads(given: int | None = None, environ=os.environ, load: float | None = None,
                   cores: int | None = None) -> ThreadChoice:
    """``--threads`` when given, else ``OMP_NUM_THREADS`` when set (torch reads it itself), else
    :func:`default_threads`. The note: the machine is busy (1-minute load average >= the physical cores: every core
    already has a runnable process) and the run has more than one thread, or was cut to one."""
    cores = physical_cores() if cores is None else cores
    load = load_average() if load is None else load
    busy = cores > 1 and load >= cores
    where = f"load average {load:.1f} on {cores} cores: the machine looks oversubscribed"
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    asked = given if given is not None else (int(omp) if omp.isdigit() else None)
    if asked is not None:
        note = f"note: {where}; with {asked} torch threads each waits on the others (--threads 1 avoids it)"
        return ThreadChoice(given, note if busy and asked > 1 else None)
    if busy:
        return ThreadChoice(1, f"note: {where}; torch runs on 1 thread (--threads N to choose)")
    return ThreadChoice(default_threads(load, cores))


# At or below this many physical cores the default is one thread, whatever the load (see default_threads).
FEW_CORES = 2


def default_threads(load: float, cores: int) -> int:
    """The thread count when nobody asked: the cores the 1-minute load average leaves free, rounded to the nearest
    (an idle machine's background load of a few tenths costs no core), at least 1 and at most ``cores``; and 1 on a
    machine of at most :data:`FEW_CORES` cores. The load average lags by a minute and a shared machine's load
    changes during a run, so the rule is chosen for the worst case, not the best: a thread that finds no free core
    makes every other one wait for it (measured on the 2-core machine at load 2.8: 2 threads decoded at 0.14x the
    speed of one with the bundled model, 0.33x with a 100M-parameter Llama), while the most a second thread gave on
    a free machine was 1.07x (bundled) and 1.82x (100M) (benchmarks/threads.py). On 2 cores any one other job
    takes the second core, so one thread there; with more cores, leaving the busy ones out keeps a margin. The CLI
    also sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) before torch loads, so that a waiting thread sleeps instead
    of spinning on a core another thread needs (cli/main.py)."""
    if cores <= FEW_CORES:
        return 1
    free = int(cores - load + 0.5)
    return max(1, min(cores, free))


def physical_cores() -> int:
    """The cores this process may run on, a core's hyperthreads counted once (Linux's /proc/cpuinfo: distinct
    (physical id, core id) pairs; elsewhere the logical count)."""
    usable = usable_cpus()
    try:
        blocks = [b for b in Path("/proc/cpuinfo").read_text().split("\n\n") if "processor" in b]
    except OSError:
        return usable
    fields = [{k.strip(): v.strip() for k, v in (line.split(":", 1) for line in b.splitlines() if ":" in line)}
              for b in blocks]
    cores = {(f.get("physical id", ""), f["core id"]) for f in fields if "core id" in f}
    if not cores or not blocks:
        return usable
    return max(1, usable * len(cores) // len(blocks))


def load_model(
    spec: str = "tiny",
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    device_map: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer strictly offline, from safetensors weights only, its folder checked before
    and the model after (:mod:`.folder`)."""
    hub_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    folder = model_folder(spec)
    check_folder(spec, folder)
    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **common)
    except Exception as exc:  # transformers raises OSError/ValueError variants for a missing or foreign tokenizer
        raise ModelLoadError(_load_failure(spec, folder, "tokenizer", exc)) from exc
    kwargs = dict(common, dtype=torch_dtype, use_safetensors=True, output_loading_info=True)
    if device_map is not None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ModelLoadError(f"--device-map {device_map}: needs the 'accelerate' package: "
                                 "pip install 'decodelab[multi-device]'")
        kwargs["device_map"] = device_map
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except ImportError as exc:
        raise ModelLoadError(import_failure(spec, device_map, exc)) from exc
    except Exception as exc:
        raise ModelLoadError(_load_failure(spec, folder, "model", exc)) from exc
    check_loaded(spec, folder, model, tokenizer, loading)
    if device_map is None:
        model = model.to(dev)
    else:
        dev = next(model.parameters()).device
    model.eval()
    return LoadedModel(spec, model, tokenizer, dev, torch_dtype, eos_token_ids(model, tokenizer), folder)


def import_failure(spec: str, device_map: str | None, exc: ImportError) -> str:
    """An import that failed while loading, reported as itself; only a missing accelerate under --device-map is
    told to install the extra."""
    missing = getattr(exc, "name", None) or ""
    if device_map is not None and missing.split(".")[0] == "accelerate":
        return (f"--device-map {device_map}: needs the 'accelerate' package: pip install "
                f"'decodelab[multi-device]' ({exc})")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"--model {spec}: loading it needs a module that failed to import: {first}"


def load_tokenizer(spec: str = "tiny", trust_remote_code: bool = False) -> LocalTokenizer:
    """A model's tokenizer, config and end ids, strictly offline, without its weights (a served engine holds them):
    the folder needs a config and a tokenizer only."""
    hub_offline()
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder = model_folder(spec)
    check_files(f"--model {spec}", folder, weights=False)
    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **common)
        config = AutoConfig.from_pretrained(str(folder), **common)
    except Exception as exc:
        raise ModelLoadError(_load_failure(spec, folder, "tokenizer", exc)) from exc
    try:
        generation = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # no generation_config.json: the model config's own ids
        generation = None
    return LocalTokenizer(spec, tokenizer, config, end_ids(generation, config, tokenizer), folder)


def _load_failure(spec: str, folder: Path, what: str, exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0].rstrip(": ") if str(exc).strip() else type(exc).__name__
    return f"--model {spec}: cannot load the {what} from {folder} (safetensors only): {first_line}"


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config, the model config, then the tokenizer."""
    return end_ids(getattr(model, "generation_config", None), model.config, tokenizer)


def end_ids(generation_config, config, tokenizer) -> list[int]:
    candidates = []
    for source in (getattr(generation_config, "eos_token_id", None), getattr(config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        candidates = [source] if isinstance(source, int) else list(source)
        if candidates:
            break
    return [int(i) for i in candidates]


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
            "parameters": sum(parameters_in(w) for w in weights),
            "layers": cfg.get("num_hidden_layers"),
            "hidden_size": cfg.get("hidden_size"),
            "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
            "context_length": cfg.get("max_position_embeddings"),
            "trained_context": TRAINED_CONTEXT.get(name),
            "vocab_size": cfg.get("vocab_size"),
            "file_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
        })
    return rows


# --- speculate -------------------------------------------------------------------------------------------------


def load_draft(spec: str, target: LoadedModel, dtype: str, trust_remote_code: bool,
               option: str = "--draft") -> LoadedModel:
    """A second model sharing the target's vocabulary, on its device (a draft, or a reference to score against);
    its messages name ``option``."""
    try:
        draft = load_model(spec, device=str(target.device), dtype=dtype, trust_remote_code=trust_remote_code)
    except ModelLoadError as exc:
        raise ModelLoadError(str(exc).replace(f"--model {spec}", f"{option} {spec}", 1)) from None
    try:
        check_same_vocabulary(target, draft, spec)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--draft", option, 1).replace("the draft", option)) from None
    return draft


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel, spec: str) -> None:
    """The draft's q and the target's p must be distributions over the same token ids."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--draft {spec}: vocabulary {draft.vocab_size} differs from the target's "
                          f"{target.vocab_size}; the draft must share the target's tokenizer and output size")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError(f"--draft {spec}: its tokenizer maps tokens to ids differently from the target's "
                          f"(both have {target.vocab_size} outputs); use a draft trained with the same tokenizer")
