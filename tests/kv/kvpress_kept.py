"""What NVIDIA's kvpress keeps, per layer and KV head, after the prefill of one prompt.

Run with a Python that has kvpress (it pins transformers < 5.3, so it lives in its own virtual environment):

    python kvpress_kept.py MODEL_DIR '[ids...]' PressName '{"compression_ratio": 0.5, ...}'

prints JSON [layer][kv head] -> kept positions, ascending (row 0). kvpress returns the compressed keys, not their
positions, so each kept key is matched to the position whose uncompressed key is identical (the prefill computes
every layer's keys before that layer is compressed, so they are the same floats).
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


def main() -> None:
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    folder, ids, name, kwargs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=x, past_key_values=full)
        cache = DynamicCache()
        with getattr(kvpress, name)(**kwargs)(model):
            model.model(input_ids=x, past_key_values=cache)
    print(json.dumps([kept_positions(full.layers[i].keys[0], cache.layers[i].keys[0])
                      for i in range(len(cache.layers))]))


if __name__ == "__main__":
    main()
