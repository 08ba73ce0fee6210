"""The bundled models `tiny`, `tiny-draft` and `tiny-recall` load offline with plain transformers and are trained.

Everything is checked against the model card `presets/models/README.md` written by
`presets/train_models.py` (its `tiny-recall` section by `presets/train_recall.py`): the file hashes and the
perplexity / agreement thresholds are parsed from it.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

MODELS = Path(__file__).parents[2] / "presets" / "models"
CARD = MODELS / "README.md"
NAMES = ("tiny", "tiny-draft", "tiny-recall")
EOT = "<|endoftext|>"
SEQ_LEN = 256            # the recipe's evaluation windows: SEQ_LEN + 1 tokens, stride SEQ_LEN
MAX_WEIGHT_BYTES = 25_000_000
ROUND_TRIP = [
    "naïve café — 東京 ✓",
    "  Two  spaces,\ttabs\nand newlines  \n",
    "x = 3.14159; print(f'{x:.2f}') # 100% \"quoted\" <tags> & {braces}",
    "In the beginning, God created the heavens and the earth.",
    "emoji 🙂 and combining e\u0301 and NUL-free bytes ÿ",
]


def card_text() -> str:
    return CARD.read_text(encoding="utf-8")


def card_hashes() -> dict[str, tuple[int, str]]:
    """Rows `| `path` | bytes | `sha256` |` of the card's file table."""
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|$", card_text(), flags=re.M)
    return {path: (int(size), digest) for path, size, digest in rows}


def card_number(pattern: str) -> float:
    m = re.search(pattern, card_text())
    assert m, f"model card lacks {pattern!r}"
    return float(m.group(1))


def shipped_files() -> list[str]:
    files = [f for name in NAMES for f in (MODELS / name).rglob("*") if f.is_file()]
    return sorted(f.relative_to(MODELS).as_posix() for f in files) + ["validation.txt"]


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------

def test_card_hash_table_matches_every_shipped_file():
    table = card_hashes()
    assert sorted(table) == shipped_files()
    for rel, (size, digest) in table.items():
        data = (MODELS / rel).read_bytes()
        assert len(data) == size, rel
        assert hashlib.sha256(data).hexdigest() == digest, rel


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_safetensors_only(name):
    folder = MODELS / name
    assert (folder / "model.safetensors").is_file()
    pickles = [f.name for f in folder.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
    assert pickles == []


def test_weights_fit_the_size_budget():
    total = sum(f.stat().st_size for name in NAMES for f in (MODELS / name).glob("*.safetensors"))
    assert total <= MAX_WEIGHT_BYTES


def test_validation_sample_is_small_and_plain_text():
    data = (MODELS / "validation.txt").read_bytes()
    assert 10_000 < len(data) <= 200_000
    assert EOT not in data.decode("utf-8")


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS / "tiny")


def test_every_model_ships_the_same_tokenizer():
    for file in ("tokenizer.json", "tokenizer_config.json"):
        for other in ("tiny-draft", "tiny-recall"):
            assert (MODELS / "tiny" / file).read_bytes() == (MODELS / other / file).read_bytes(), (other, file)


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOT
    assert tokenizer("hello").input_ids == tokenizer("hello", add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert EOT not in tokenizer.convert_ids_to_tokens(ids)


def test_tokenizer_learned_english_merges(tokenizer):
    # a trained BPE encodes common words as one token; a byte-level fallback would not
    assert len(tokenizer(" the").input_ids) == 1
    assert len(tokenizer("In the beginning God created the heavens").input_ids) <= 8


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return {name: AutoModelForCausalLM.from_pretrained(MODELS / name).eval() for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_config_is_llama_with_gqa_and_special_ids(models, tokenizer, name):
    model = models[name]
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.max_position_embeddings >= 256
    assert cfg.vocab_size == len(tokenizer)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == eot
    gen = model.generation_config
    assert gen.eos_token_id == gen.bos_token_id == gen.pad_token_id == eot
    assert next(model.parameters()).dtype == torch.float32


def test_draft_is_much_shallower_than_target(models):
    # decode-step cost on CPU grows with depth; timing itself lives in the card, not in a test
    t, d = models["tiny"].config, models["tiny-draft"].config
    assert d.num_hidden_layers * 4 <= t.num_hidden_layers
    n_params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert n_params["tiny-draft"] < n_params["tiny"]


@pytest.fixture(scope="module")
def val_windows(tokenizer):
    """The card's evaluation tokens: the first N tokens of validation.txt, windows of SEQ_LEN + 1."""
    n_tokens = int(card_number(r"on the first\s+(\d+) tokens of `validation.txt`"))
    ids = torch.tensor(tokenizer((MODELS / "validation.txt").read_text(encoding="utf-8")).input_ids)
    n = min(n_tokens, len(ids) - 1) // SEQ_LEN
    assert n >= 8
    return torch.stack([ids[i * SEQ_LEN: i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


@pytest.fixture(scope="module")
def val_logits(models, val_windows):
    with torch.no_grad():
        return {name: torch.cat([m(w[:, :-1]).logits for w in val_windows.split(8)]) for name, m in models.items()}


def perplexity(logits: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean of -log p(x_t | x_<t)) over every predicted token."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    return math.exp(nll.item())


def test_tiny_validation_perplexity_below_card_threshold(val_logits, val_windows):
    ppl = perplexity(val_logits["tiny"], val_windows)
    assert ppl < card_number(r"\btiny val ppl [\d.]+; test asserts < (\d+)")
    assert ppl < 100   # an untrained model sits near the vocab size (4096)


def test_draft_validation_perplexity_below_card_threshold(val_logits, val_windows):
    ppl = perplexity(val_logits["tiny-draft"], val_windows)
    assert ppl < card_number(r"tiny-draft val ppl [\d.]+; test asserts < (\d+)")
    assert ppl > perplexity(val_logits["tiny"], val_windows)   # the draft is the weaker model


def test_recall_validation_perplexity_below_card_threshold(val_logits, val_windows):
    ppl = perplexity(val_logits["tiny-recall"], val_windows)
    assert ppl < card_number(r"tiny-recall val ppl [\d.]+; test asserts < (\d+)")
    assert ppl < 200   # an untrained model sits near the vocab size (4096)


def test_draft_agrees_with_target_greedily(val_logits):
    # teacher-forced: fraction of positions where argmax draft == argmax target
    same = val_logits["tiny"].argmax(-1) == val_logits["tiny-draft"].argmax(-1)
    agreement = same.float().mean().item()
    assert agreement > card_number(r"test asserts > (\d+)%") / 100
    assert agreement > 0.3   # sanity floor independent of the card


def test_greedy_generation_ends_or_continues_with_text(models, tokenizer):
    ids = tokenizer("In the beginning", return_tensors="pt").input_ids
    out = models["tiny"].generate(ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) >= 12   # English-looking words, not byte soup
