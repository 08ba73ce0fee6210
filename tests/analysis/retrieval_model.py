"""A Llama whose weights are set by hand so that it retrieves a digit from its context: a model that passes the
probe under the full cache, so the probe's judgement of a policy can be tested (the bundled `tiny` cannot copy
anything from its context: see benchmarks/README.md).

One attention head (two query heads on one KV head: grouped) in layer 0 does it; everything else adds nothing.
Embeddings (hidden 64): every token has 1 in channel BIAS; a digit token " d" (and "d") also 1 in channel d and in
channel DIGIT. With x the RMS-normalised input and the rotary pair of lowest frequency (inv_freq ~ 2e-6 at
rope_theta 1e6, so the rotation is ~1 over any context used here):

    q = SHARP * x[BIAS] e_15          every query asks the same thing: "where are the digits?"
    k = SHARP * x[DIGIT] e_15         only digit keys answer: score ~ SHARP^2 x x / sqrt(32), 0 for any other key
    v = x[0..9]                       the digit's identity
    o: v -> channels READ + 0..9      the attended digits, written to the residual stream
    logits[" d"] = GAIN * h[READ + d]  (untied head; every other token's logit is 0, "d" too)

So with digits in context the next token is the digit held most often (the planted key, repeated), with
probability ~1; a cache that evicted every digit leaves a uniform distribution (the key at 1 / vocab). Layer 1 has
zero output projections (the identity). A probe's key must be one digit, repeated ("7 7 7 7"), in a filler without
digits.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, HEAD_DIM = 64, 32
BIAS, DIGIT, READ = 12, 10, 20
SHARP, GAIN = 12.0, 40.0


def digit_ids(tokenizer) -> dict[int, list[int]]:
    """digit -> its token ids (" d" and "d")."""
    out = {}
    for d in range(10):
        ids = {i for text in (str(d), f" {d}") for i in tokenizer.encode(text, add_special_tokens=False)}
        out[d] = sorted(ids)
    return out


def retrieval_model(tokenizer, vocab_size: int, context: int = 2048) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                         max_position_embeddings=context, rope_theta=1e6, tie_word_embeddings=False,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    digits = digit_ids(tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb[:, BIAS] = 1.0
        for d, ids in digits.items():
            for i in ids:
                emb[i, d] = 1.0
                emb[i, DIGIT] = 1.0
        attn = model.model.layers[0].self_attn
        last = HEAD_DIM // 2 - 1  # the rotary pair (15, 31) of the lowest frequency
        for head in range(2):
            attn.q_proj.weight[head * HEAD_DIM + last, BIAS] = SHARP
        attn.k_proj.weight[last, DIGIT] = SHARP
        for d in range(10):
            attn.v_proj.weight[d, d] = 1.0
            attn.o_proj.weight[READ + d, d] = 1.0  # query head 0's output; head 1 writes nothing
        for d in range(10):  # the answer follows a space: only " d" is written
            (spaced,) = tokenizer.encode(f" {d}", add_special_tokens=False)
            model.lm_head.weight[spaced, READ + d] = GAIN
    return model.eval()
