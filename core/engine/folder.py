"""A model folder checked before anything is built from it, and the loaded model checked before it is used.

Before loading (nothing allocated, no tensor read): the files (a config, safetensors weights, a tokenizer), the
config's sizes within bounds far above every released model and far below what would hang or exhaust memory while
transformers builds the modules, the safetensors headers (each tensor's bytes inside its file: a truncated file is
refused), the config against the weights' real shapes (the layers the weights hold, the rows of the embedding), and
the token ids of the config and the generation config (integers, or lists of them, >= 0).

After loading: a checkpoint that covers every parameter of its config (transformers would initialise the missing ones
at random and decode as if whole), the tokenizer's ids and the end-of-sequence ids within the model's embedding rows.

Each problem is one :class:`ModelLoadError` naming the model, the file and the field.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, ModelLoadError
from ..inputs import parse_json, read_input_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
CONFIG_BYTES = 16 * 2**20  # config.json, generation_config.json, the shard index: a few KB in every real model
HEADER_BYTES = 100 * 2**20  # a safetensors header (the safetensors library's own limit)

# config.json sizes: (the keys model families spell them with, lowest, highest). null is allowed (n_inner, head_dim).
SIZES = (
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 1, 1024),
    (("hidden_size", "n_embd", "d_model"), 1, 2**17),
    (("intermediate_size", "n_inner", "ffn_dim"), 1, 2**20),
    (("num_attention_heads", "n_head", "num_heads"), 1, 2**12),
    (("num_key_value_heads", "num_kv_heads"), 1, 2**12),
    (("head_dim",), 1, 2**12),
    (("vocab_size",), 1, 2**24),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"), 1, 2**24),
    (("sliding_window",), 1, 2**24),
)
TOKEN_ID_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
GENERATION_INTS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "top_k", "num_beams",
                   "num_return_sequences", "no_repeat_ngram_size")
GENERATION_NUMBERS = ("temperature", "top_p", "typical_p", "min_p", "repetition_penalty", "length_penalty")
GENERATION_FLAGS = ("do_sample", "use_cache")

# bytes per element of each safetensors dtype (sub-byte float formats are left unchecked)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|block)\.(\d+)\.")
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "tok_embeddings.weight")


@dataclass
class Tensor:
    file: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Checked:
    """What the checks read from the folder: the weights' tensors by name (from their headers)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def weight_files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})


def check_folder(spec: str, path: Path) -> Checked:
    """Everything that can be checked in the folder before transformers reads it (see the module's docstring)."""
    where = f"--model {spec}"
    check_files(where, path)
    config = read_json(where, path / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: {path / 'config.json'} is not a JSON object")
    for table, label in configs(config):
        check_sizes(where, label, table)
        check_token_ids(where, label, table)
    if (path / "generation_config.json").is_file():
        check_generation_config(where, path / "generation_config.json")
    checked = Checked(read_weights(where, path))
    check_against_weights(where, config, checked)
    return checked


def check_files(where: str, path: Path, weights: bool = True) -> None:
    """A folder needs a config, safetensors weights and a tokenizer; say which is missing before loading.
    ``weights=False``: a config and a tokenizer are enough (a served engine holds the weights)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{where}: {path} has no config.json, so it is not a model folder")
    if weights and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{where}: {path} has no .safetensors weights (decodelab loads safetensors only)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{where}: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def read_json(where: str, path: Path):
    """A JSON file of the folder, size and nesting bounded; its problems named '--model SPEC: FILE: ...'."""
    try:
        return parse_json(str(path), read_input_text(str(path), path, limit=CONFIG_BYTES))
    except ConfigError as exc:
        raise ModelLoadError(f"{where}: {str(exc).replace(f'{path} {path}:', f'{path}:', 1)}") from None


def configs(config: dict) -> list[tuple[dict, str]]:
    """The config and the text model's config nested in it (multimodal models), each with its label."""
    out = [(config, "config.json")]
    if isinstance(config.get("text_config"), dict):
        out.append((config["text_config"], "config.json text_config"))
    return out


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(where: str, label: str, table: dict) -> None:
    for keys, lo, hi in SIZES:
        for key in keys:
            value = table.get(key)
            if value is not None and not (is_int(value) and lo <= value <= hi):
                raise ModelLoadError(f"{where}: {label} {key} {value!r}: must be an integer in [{lo}, {hi}] (or "
                                     "absent); the folder's config is damaged or not a model's")


def check_token_ids(where: str, label: str, table: dict) -> None:
    for key in TOKEN_ID_FIELDS:
        value = table.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(i) and i >= 0 for i in ids):
            raise ModelLoadError(f"{where}: {label} {key} {value!r}: expected a token id (an integer >= 0), a list "
                                 "of them, or null")


def check_generation_config(where: str, path: Path) -> None:
    gen = read_json(where, path)
    label = "generation_config.json"
    if not isinstance(gen, dict):
        raise ModelLoadError(f"{where}: {path} is not a JSON object")
    check_token_ids(where, label, gen)
    for key in GENERATION_INTS:
        value = gen.get(key)
        if value is not None and not (is_int(value) and value >= 0):
            raise ModelLoadError(f"{where}: {label} {key} {value!r}: expected an integer >= 0 or null")
    for key in GENERATION_NUMBERS:
        value = gen.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value)):
            raise ModelLoadError(f"{where}: {label} {key} {value!r}: expected a finite number or null")
    for key in GENERATION_FLAGS:
        value = gen.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelLoadError(f"{where}: {label} {key} {value!r}: expected true, false or null")


# --- the weights, from their headers -------------------------------------------------------------------------------


def weight_files(where: str, path: Path) -> list[Path]:
    """The files transformers loads: the shards the index names, else model.safetensors, else every .safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json(where, index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{where}: {index} weight_map: expected an object of tensor name -> shard file")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard or not (path / shard).is_file():
                raise ModelLoadError(f"{where}: {index} weight_map names {shard!r}, which is not a file of the "
                                     "folder")
        return [path / shard for shard in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def read_weights(where: str, path: Path) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for file in weight_files(where, path):
        for name, tensor in read_header(where, file).items():
            tensors.setdefault(name, tensor)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        for name, shard in read_json(where, index)["weight_map"].items():
            if name not in tensors or tensors[name].file != shard:
                raise ModelLoadError(f"{where}: {index} weight_map puts {name!r} in {shard}, whose header has no "
                                     "such tensor (a shard is missing or damaged)")
    return tensors


def read_header(where: str, file: Path) -> dict[str, Tensor]:
    """The tensors of a .safetensors file from its header (8 bytes little-endian length, then JSON), each checked to
    lie inside the file: a truncated or padded-out file is refused here, before any tensor is read."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{where}: {file} is {size} bytes, too short to be a safetensors file (truncated?)")
        (length,) = struct.unpack("<Q", head)
        if length > min(HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{where}: {file}: its header claims {length} bytes but the file holds {size - 8} "
                                 "after the length (truncated, or not a safetensors file)")
        raw = fh.read(length)
    try:
        header = parse_json(f"{file}: the header", raw)
    except ConfigError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{where}: {file}: the header is not a JSON object")
    data = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensor, end = header_entry(where, file, name, entry)
        if end > data:
            raise ModelLoadError(f"{where}: {file}: tensor {name!r} ends at byte {end} of the data but the file holds "
                                 f"{data} (the file is truncated)")
        tensors[name] = tensor
    return tensors


def header_entry(where: str, file: Path, name: str, entry) -> tuple[Tensor, int]:
    """One tensor's header entry checked: a dtype, a shape of sizes >= 0, offsets spanning its bytes; (tensor, the
    byte of the data where it ends)."""
    bad = f"{where}: {file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelLoadError(f"{bad}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ModelLoadError(f"{bad}: dtype {dtype!r} and shape {shape!r}: expected a dtype name and a list of "
                             "sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ModelLoadError(f"{bad}: data_offsets {offsets!r}: expected [start, end] with 0 <= start <= end")
    if dtype in DTYPE_BYTES and offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise ModelLoadError(f"{bad}: {dtype} {shape} needs {math.prod(shape) * DTYPE_BYTES[dtype]} bytes but its "
                             f"offsets span {offsets[1] - offsets[0]}")
    return Tensor(file.name, dtype, tuple(shape)), offsets[1]


def parameters_in(file: Path) -> int:
    """The parameters a .safetensors file holds, from its header."""
    return sum(math.prod(t.shape) for t in read_header(f"--model {file.parent}", file).values())


def check_against_weights(where: str, config: dict, checked: Checked) -> None:
    """The config against the weights' real shapes: no more layers than the weights hold (transformers would build
    the rest at random), and the embedding's rows equal to vocab_size."""
    table = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    label = "config.json" + (" text_config" if table is not config else "")
    files = ", ".join(checked.weight_files)
    held = {int(m.group(1)) for name in checked.tensors for m in [LAYER.search(name)] if m}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        layers = table.get(key)
        if is_int(layers) and held and layers > max(held) + 1:
            raise ModelLoadError(f"{where}: {label} {key} {layers}: the weights ({files}) hold {max(held) + 1} "
                                 "layers; decodelab never runs layers the checkpoint lacks")
    vocab = table.get("vocab_size")
    for name, tensor in checked.tensors.items():
        if name.endswith(EMBEDDINGS) and len(tensor.shape) == 2 and is_int(vocab) and tensor.shape[0] != vocab:
            raise ModelLoadError(f"{where}: {label} vocab_size {vocab}: {tensor.file} {name} has {tensor.shape[0]} "
                                 "rows; the config does not describe these weights")


# --- the loaded model ----------------------------------------------------------------------------------------------


def check_loaded(spec: str, path: Path, model, tokenizer, loading: dict) -> None:
    """After loading: every parameter came from the checkpoint, and every id the tokenizer or the end-of-sequence
    settings can produce has an embedding row and an output row."""
    where = f"--model {spec}"
    missing = sorted(loading.get("missing_keys") or ())
    mismatched = sorted(str(k) for k in (loading.get("mismatched_keys") or ()))
    files = ", ".join(p.name for p in sorted(path.glob("*.safetensors")))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{where}: the checkpoint ({files}) does not cover {len(missing)} parameter(s) of "
                             f"config.json: {shown}; decodelab never runs freshly initialised weights")
    if mismatched:
        raise ModelLoadError(f"{where}: {len(mismatched)} tensor(s) of the checkpoint ({files}) do not have the "
                             f"shapes config.json gives: {', '.join(mismatched[:3])}")
    rows = embedding_rows(model)
    vocab = tokenizer.get_vocab()
    if vocab:
        token, top = max(vocab.items(), key=lambda item: item[1])
        if top >= rows:
            raise ModelLoadError(f"{where}: {tokenizer_file(path)}: token {token!r} has id {top}, beyond the model's "
                                 f"{rows} embedding rows ({files}); the tokenizer does not belong to these weights")
    gen = getattr(model, "generation_config", None)
    for label, source in (("generation_config.json", gen), ("config.json", model.config)):
        value = getattr(source, "eos_token_id", None)
        ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        if any(i >= rows for i in ids):
            raise ModelLoadError(f"{where}: {label} eos_token_id {value}: beyond the model's {rows} embedding rows")


def embedding_rows(model) -> int:
    """The ids the model can both read and score: the smaller of its input and output embeddings' rows."""
    rows = [m.weight.shape[0] for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None and getattr(m, "weight", None) is not None]
    return int(min(rows))


def tokenizer_file(path: Path) -> str:
    found = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    return str(path / found[0]) if found else f"the tokenizer in {path}"
