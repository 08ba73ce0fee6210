"""CUDA checks (run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from decodelab.core.methods.sample import DecodeState, decode_tokens
from decodelab.core.engine.stopping import StopRules
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_equals_generate_on_cuda(arch):
    model = random_model(arch, seed=0, scale=8.0).cuda()
    state = DecodeState()
    ours = [d.token_id for d in decode_tokens(model, PROMPT, build_chain({"temperature": 0}), Greedy(),
                                              StopRules(24), state=state)]
    ref = model.generate(torch.tensor([PROMPT], device="cuda"), do_sample=False, max_new_tokens=24,
                         min_new_tokens=24)
    assert ours == ref[0, len(PROMPT):].tolist()


def test_seeded_sampling_is_reproducible_on_cuda():
    model = random_model("llama", seed=1, scale=2.0).cuda()
    chain = build_chain({"temperature": 1.0, "top-p": 0.9})

    def run():
        selector = Multinomial(make_generator(3, "cuda"))
        return [d.token_id for d in decode_tokens(model, PROMPT, chain, selector, StopRules(16))]

    assert run() == run()


# --- issue 34: every command on CUDA in one process, exactness in bf16 and fp32, transfers and syncs ------------

import json  # noqa: E402
import warnings  # noqa: E402

from conftest import ROOT, host_reads  # noqa: E402

from decodelab.core.methods.sample import Sampler  # noqa: E402
from decodelab.core.sampling.select import make_selector  # noqa: E402


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_greedy_equals_generate_on_cuda_in_both_dtypes(arch, dtype):
    """The same model object (so the same attention implementation and mask form) decoded greedily by decodelab
    and by `generate`: equal, and where not, the first divergence and generate's top-2 margin in the message."""
    model = random_model(arch, seed=0, scale=8.0).to("cuda", dtype)
    ours = [d.token_id for d in decode_tokens(model, PROMPT, build_chain({"temperature": 0}), Greedy(),
                                              StopRules(48, ignore_eos=True))]
    ref = model.generate(torch.tensor([PROMPT], device="cuda"), do_sample=False, max_new_tokens=48,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    theirs = ref.sequences[0, len(PROMPT):].tolist()
    at = first_divergence(ours, theirs)
    margin = None if at is None else float(torch.topk(ref.scores[at][0].float(), 2).values.diff().abs())
    assert ours == theirs, f"{arch} {dtype}: first divergence at {at}, generate's top-2 margin there {margin}"


def test_seeded_sampling_is_reproducible_on_cuda_through_the_traced_run():
    model = random_model("llama", seed=2, scale=2.0).cuda()

    def run():
        sampler = Sampler(model, PROMPT, build_chain({"temperature": 0.9, "top-p": 0.95}),
                          make_selector("multinomial", 7, "cuda"), StopRules(24, ignore_eos=True), str, None)
        return [(s.token_id, s.logprob) for s in sampler]

    assert run() == run()


@pytest.mark.parametrize("chain", [{"temperature": 0}, {"temperature": 0.8, "top-p": 0.9}], ids=["greedy", "top-p"])
def test_host_reads_and_cuda_syncs_per_token_within_the_cpu_budget(chain):
    """The CPU budget (tests/engine/test_runtime.py): at most one host read per traced token; on CUDA every read is
    a synchronisation, and nothing else may synchronise (torch.cuda.set_sync_debug_mode counts them)."""
    model = random_model("llama", seed=0, scale=4.0).cuda()
    n = 32
    list(Sampler(model, PROMPT, build_chain(chain), make_selector(chain["temperature"], 0, "cuda"),
                 StopRules(2, ignore_eos=True), str, None))  # warm
    sampler = Sampler(model, PROMPT, build_chain(chain), make_selector(chain["temperature"], 0, "cuda"),
                      StopRules(n, ignore_eos=True), str, None)
    with warnings.catch_warnings(record=True) as caught, host_reads() as reads:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            list(sampler)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    assert len(sampler.new_ids) == n
    assert sum(reads.values()) <= n + 2, reads  # top-p's partial sort may read once more per token on the CPU
    assert syncs <= 2 * n + 4, syncs


COMMANDS = [
    ["sample", "Once upon a time", "-n", "8"],
    ["sample", "Once upon a time", "-n", "8", "--top-p", "0.9", "--temperature", "0.8", "-N", "2"],
    ["sample", "Once upon a time", "-n", "8", "--cache", "static"],
    ["probs", "Once upon a time"],
    ["score", "Once upon a time there was a"],
    ["beam", "Once upon a time", "-n", "6", "--beams", "2"],
    ["speculate", "Once upon a time once upon a time", "-n", "8", "--draft", "ngram"],
    ["speculate", "Once upon a time", "-n", "8"],
    ["batch", "--prompts-file", str(ROOT / "examples" / "prompts.txt"), "-n", "8", "--baselines", "static,transformers"],
    ["compare", "Once upon a time", "--variant", "a: temperature=0", "--variant", "b: top_p=0.9", "-n", "6"],
    ["bench", "-n", "4", "--rounds", "1", "--settings", "greedy"],
    ["quantize-kv", "Once upon a time there was a little dog who"],
    ["stream", "Once upon a time", "-n", "8", "--cache", "sinks:sinks=2,recent=8"],
]


def test_every_command_runs_on_cuda_in_one_process(cli):
    """Each command once on CUDA with the bundled tiny model, in this one process (start-up paid once): exit 0 and a
    JSON document with sane numbers (finite rates, a device that is CUDA where the command reports one)."""
    failures = []
    for args in COMMANDS:
        code, out, err = cli(*args, "--device", "cuda", "-f", "json")
        if code != 0:
            failures.append((args[0], code, err.strip().splitlines()[-1:] if err else ""))
            continue
        doc = json.loads(out)
        rate = doc.get("summary", {}).get("tokens_per_s") if isinstance(doc.get("summary"), dict) else None
        if rate is not None and not (rate == rate and rate > 0):
            failures.append((args[0], "rate", rate))
    assert not failures, failures
