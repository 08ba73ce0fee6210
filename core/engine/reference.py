"""transformers' own decoding loops, the references decodelab is measured and checked against: ``model.generate``
(:func:`hf_generate`) and its continuous batching (:func:`continuous_batching_generate`).
"""

from __future__ import annotations

import torch


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
