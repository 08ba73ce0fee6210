"""What NVIDIA's kvpress keeps, per layer and KV head, after the prefill of one prompt.

Run with a Python that has kvpress (it pins transformers < 5.3, so it lives in its own virtual environment;
.ci/kvpress-venv.sh builds one):

    python kvpress_kept.py MODEL_DIR '[ids...]' PressName '{"compression_ratio": 0.5, ...}' [CONTINUATION OUT.pt]

(a keyword whose value is {"press": NAME, "kwargs": {...}} gets that press: BlockPress's ``press``)

prints JSON [layer][kv head] -> kept positions, ascending (row 0). kvpress returns the compressed keys, not their
positions, so each kept key is matched to the position whose uncompressed key is identical (the prefill computes
every layer's keys before that layer is compressed, so they are the same floats).

With CONTINUATION (JSON ids) and OUT.pt, the continuation is then fed in one forward through the compressed cache as
kvpress's own pipeline feeds a question (position ids continuing from the uncompressed prompt's length, no further
compression), and OUT.pt gets {"logprobs": [n, V] float32 log-softmax of each continuation position,
"kept": the same lists}.
"""

from __future__ import annotations

import json
import sys

import torch


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> list[list[int]]:
    """full [H_kv, T, D], kept [H_kv, k, D] -> per head the positions of the kept keys, ascending."""
    out = []
    for head in range(full.shape[0]):
        same = (kept[head][:, None, :] == full[head][None, :, :]).all(-1)  # [k, T]
        if not bool((same.sum(-1) == 1).all()):
            raise SystemExit("a kept key matches no position, or several")
        out.append(sorted(int(i) for i in same.float().argmax(-1)))
    return out


def continuation_logprobs(model, cache, prompt_len: int, ids: list[int]) -> torch.Tensor:
    """[n, V]: log-softmax of the logits at each continuation position, fed in one forward after the compressed
    prompt, at positions prompt_len .. prompt_len + n - 1 (kvpress's pipeline: generate_answer's position ids)."""
    x = torch.tensor([ids])
    positions = torch.arange(prompt_len, prompt_len + len(ids)).unsqueeze(0)
    logits = model(input_ids=x, past_key_values=cache, position_ids=positions).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def build(kvpress, name: str, kwargs: dict):
    """kvpress's press ``name`` from JSON keyword arguments; a value {"press": NAME, "kwargs": {...}} is itself a
    press (BlockPress's ``press``)."""
    kwargs = {key: build(kvpress, value["press"], value.get("kwargs", {}))
              if isinstance(value, dict) and "press" in value else value for key, value in kwargs.items()}
    return getattr(kvpress, name)(**kwargs)


def main() -> None:
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    folder, ids, name, kwargs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    # eager attention returns the weights the attention-scored presses read; BlockPress refuses them (sdpa returns none)
    attention = "sdpa" if name == "BlockPress" else "eager"
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=x, past_key_values=full)
        cache = DynamicCache()
        with build(kvpress, name, kwargs)(model):
            model.model(input_ids=x, past_key_values=cache)
        kept = [kept_positions(full.layers[i].keys[0], cache.layers[i].keys[0]) for i in range(len(cache.layers))]
        if len(sys.argv) > 6:
            logprobs = continuation_logprobs(model, cache, len(ids), json.loads(sys.argv[5]))
            torch.save({"logprobs": logprobs, "kept": kept}, sys.argv[6])
    print(json.dumps(kept))


if __name__ == "__main__":
    main()
