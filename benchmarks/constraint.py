"""What the constraint stage costs per token, side by side with the same chain step without it, in one run.

For each constraint (a regex, a JSON schema, a context-free grammar, a choice) on the bundled tokenizer (4096
tokens), episodes are first decoded under the constraint from random logits; then the same steps (the same prefix
ids, the same logits) go through

* ``chain``: temperature 0.8 -> top-k 50 -> top-p 0.95, then an arg-max;
* ``chain + constraint``: the constraint stage first, then the same chain and arg-max; the stage's trie is reset
  before every episode, so each step pays the whole cost (a matcher copy, a token consumed, a mask computed,
  the words moved and unpacked, the trace numbers);

and, for scale, one forward of the bundled tiny model on one token with its KV cache. Rounds alternate; medians
per token are reported. Then the whole decode loop of ``sample`` on the tiny model, the same run without and with a
regex constraint, side by side.

``--matchers`` compares the three libraries considered (llguidance, xgrammar, outlines-core; those installed)
instead: masks against the tests' brute-force references along random walks, and compile, mask and consume times
(docs/constraints.md has the figures).

    python benchmarks/constraint.py [--tokens 200] [--rounds 5] [--threads 1] [--matchers]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from decodelab.core.sampling.chain import Chain
from decodelab.core.sampling.filters import TopK, TopP
from decodelab.core.sampling.scaling import Temperature
from decodelab.core.sampling.constraint import ConstraintStage, ConstraintVocabulary, constraint_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "presets" / "models" / "tiny"
EOS = 0
PROMPT = [EOS, 17, 42]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["red", "grün", "日本"]}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ARITHMETIC = ('start: expr\nexpr: term (("+" | "-") term)*\nterm: atom (("*" | "/") atom)*\n'
              'atom: /[0-9]+/ | "(" expr ")"\n')
ARITHMETIC_GBNF = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= atom (("*" | "/") atom)*\n'
                   'atom ::= [0-9]+ | "(" expr ")"\n')
CONSTRAINTS = {
    "regex": dict(regex=r'"[^"\n]{0,40}"'),
    "json-schema": dict(json_schema=json.dumps(SCHEMA)),
    "grammar": dict(grammar=ARITHMETIC),
    "choice": dict(choice="positive,negative,neutral"),
}


def spec_of(options: dict, folder: Path):
    key, value = next(iter(options.items()))
    if key in ("json_schema", "grammar"):  # these options name a file
        path = folder / f"{key}.txt"
        path.write_text(value, encoding="utf-8")
        value = str(path)
    return constraint_spec(**{key: value})


def episodes(stage: ConstraintStage, tokens: int, seed: int) -> list[list[tuple[list[int], torch.Tensor]]]:
    """Constrained decodes from random logits, (ids, logits) per step, until ``tokens`` steps in all; an episode
    ends on the end id or at 64 tokens."""
    gen = torch.Generator().manual_seed(seed)
    out, steps = [], 0
    size = stage.vocabulary.size
    while steps < tokens:
        stage.reset(len(PROMPT))
        ids, episode = list(PROMPT), []
        for _ in range(64):
            logits = torch.randn(1, size, generator=gen) * 3
            token = int(stage(torch.tensor([ids]), logits).argmax())
            episode.append((list(ids), logits))
            if token == EOS:
                break
            ids.append(token)
        out.append(episode)
        steps += len(episode)
    return out


def run_episode(chain: Chain, episode) -> None:
    chain.reset(len(PROMPT))
    for ids, logits in episode:
        chain(torch.tensor([ids]), logits).argmax()


def paired_rounds(chains: dict[str, Chain], eps, rounds: int) -> dict[str, float]:
    """Median over rounds of the time per step of each chain; within a round the chains take turns episode by
    episode, so a busy moment of the machine falls on both alike."""
    steps = sum(len(e) for e in eps)
    per_round: dict[str, list[float]] = {name: [] for name in chains}
    for episode in eps:  # warm-up
        for chain in chains.values():
            run_episode(chain, episode)
    for _ in range(rounds):
        spent = dict.fromkeys(chains, 0.0)
        for episode in eps:
            for name, chain in chains.items():
                start = time.perf_counter()
                run_episode(chain, episode)
                spent[name] += time.perf_counter() - start
        for name in chains:
            per_round[name].append(spent[name] / steps * 1e6)
    return {name: statistics.median(v) for name, v in per_round.items()}


def forward_ms(rounds: int) -> float:
    """Median ms of one cached forward of the bundled tiny model on one token (for scale)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(TINY, use_safetensors=True).eval()
    with torch.inference_mode():
        cache, times = model(torch.tensor([PROMPT]), use_cache=True).cache, []  # updated in place from here on
        for i in range(rounds * 20):
            start = time.perf_counter()
            model(torch.tensor([[5 + i % 100]]), cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def stage_cost(tokens: int, rounds: int) -> None:
    from transformers import AutoTokenizer

    vocabulary = ConstraintVocabulary.from_tokenizer(AutoTokenizer.from_pretrained(TINY), [EOS])
    folder = Path(tempfile.mkdtemp())
    tail = [Temperature(0.8), TopK(50), TopP(0.95)]
    print(f"per token, median of {rounds} rounds; {vocabulary.size}-token vocabulary, {torch.get_num_threads()} "
          "thread(s)")
    print(f"{'constraint':12s} {'steps':>6s} {'chain us':>9s} {'+constraint us':>15s} {'ratio':>6s} {'stage us':>9s}")
    for name, options in CONSTRAINTS.items():
        stage = ConstraintStage(spec_of(options, folder), vocabulary)
        eps = episodes(stage, tokens, seed=0)
        us = paired_rounds({"plain": Chain(list(tail)), "constrained": Chain([stage] + tail)}, eps, rounds)
        a, b = us["plain"], us["constrained"]
        n = sum(len(e) for e in eps)
        print(f"{name:12s} {n:6d} {a:9.1f} {b:15.1f} {b / a:6.2f} {b - a:9.1f}")
    ms = forward_ms(rounds)
    print(f"one forward of the tiny model on one token (KV cache): {ms * 1e3:.0f} us")


def decode_cost(rounds: int, tokens: int = 64) -> None:
    """The same ``sample`` run (the bundled tiny model, temperature 0.8, top-k 50, untraced, a 64-token decode
    loop) without and with the constraint, in alternating rounds; ms per token of the decode loop (prefill
    excluded), median over the rounds. The regex admits exactly 300 characters, so the constrained run never ends
    early and both decode the same number of tokens."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.sample import SampleSettings, build_sampler

    lm = load_model("tiny", device="cpu")
    prompt = lm.encode("Once upon a time")
    variants = {"chain": {}, "+ constraint": {"regex": "[a-z ,.]{300}"}}
    per: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for name, extra in (variants.items() if r % 2 else reversed(list(variants.items()))):
            s = SampleSettings(temperature=0.8, top_k=50, seed=r, max_new_tokens=tokens, ignore_eos=True, **extra)
            sampler = build_sampler(lm, s, prompt, record=False)
            for _ in sampler:
                pass
            assert len(sampler.new_ids) == tokens
            if r:
                per[name].append(1e3 / sampler.summary().decode_tokens_per_s)
    a, b = (statistics.median(per[n]) for n in variants)
    print(f"\ndecode loop, ms per token, median of {rounds} rounds ({tokens} tokens, {torch.get_num_threads()} "
          f"thread(s)): chain {a:.2f}   + constraint {b:.2f}   ratio {b / a:.2f}   stage {b - a:+.2f}")


# --- --matchers: the libraries considered -------------------------------------------------------------------------


def load_references():
    """The brute-force references of tests/sampling/test_constraint.py (the same code the tests trust)."""
    path = ROOT / "tests" / "sampling" / "test_constraint.py"
    spec = importlib.util.spec_from_file_location("constraint_references", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bool_mask(words: torch.Tensor, size: int) -> torch.Tensor:
    bits = (words.reshape(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:size].bool()


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, size, exact=True):
        import llguidance
        import llguidance.hf

        self.llg, self.exact = llguidance, exact
        self.name = "llguidance" if exact else "llguidance (forcing)"
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=size)
        self.setup = time.perf_counter() - start
        self.size = size

    def compile(self, kind, text):
        body = {"regex": lambda: "start: /" + self.llg.regex_to_lark(text, "") + "/",
                "json": lambda: "start: %json " + text, "cfg": lambda: text["lark"]}[kind]()
        options = '\n%llguidance {"no_forcing": true}\n' if self.exact else ""
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_lark(body + options), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m):
        return bool_mask(torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32), self.size)

    def consume(self, m, token):
        assert m.consume_token(token), m.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, size):
        import xgrammar

        self.xgr = xgrammar
        start = time.perf_counter()
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=size),
                                                 max_threads=1)
        self.setup = time.perf_counter() - start
        self.size, self.words = size, xgrammar.allocate_token_bitmask(1, size)

    def compile(self, kind, text):
        c = {"regex": self.compiler.compile_regex, "json": self.compiler.compile_json_schema,
             "cfg": lambda t: self.compiler.compile_grammar(t["ebnf"])}[kind](text)
        return self.xgr.GrammarMatcher(c)

    def mask(self, m):
        m.fill_next_token_bitmask(self.words)
        return bool_mask(self.words[0], self.size)

    def consume(self, m, token):
        assert m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, size, token_bytes):
        import outlines_core

        self.oc = outlines_core
        start = time.perf_counter()
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b is not None:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(EOS, by_bytes)  # its from_pretrained reads the hub only
        self.setup = time.perf_counter() - start
        self.size, self.words = size, torch.zeros((size + 31) // 32, dtype=torch.int32)

    def compile(self, kind, text):
        if kind == "cfg":
            raise NotImplementedError("regular languages only")
        if kind == "json":
            from outlines_core.json_schema import build_regex_from_schema

            text = build_regex_from_schema(text)
        return self.oc.Guide(self.oc.Index(text, self.vocabulary))

    def mask(self, m):
        m.write_mask_into(self.words.data_ptr(), self.words.numel(), 4)
        return bool_mask(self.words, self.size)

    def consume(self, m, token):
        m.advance(token)


def matchers(tok, size, token_bytes) -> list:
    out = [Llguidance(tok, size), Llguidance(tok, size, exact=False)]
    for make in (lambda: Xgrammar(tok, size), lambda: OutlinesCore(tok, size, token_bytes)):
        try:
            out.append(make())
        except ImportError as exc:
            print(f"(skipped: {exc})")
    return out


def correctness(lib, ref, cases, walks=3, steps=12) -> tuple[int, int, str]:
    """Steps whose mask differs from the brute-force set (end id included), over walks that pick uniformly among
    the tokens the reference allows; the first difference, shown."""
    bad = total = 0
    first = ""
    tb = ref.token_bytes()
    for kind, text, reference in cases:
        rng = random.Random(0)
        for _ in range(walks):
            m, generated = lib.compile(kind, text), []
            for _ in range(steps):
                try:
                    got = lib.mask(m)
                except Exception as exc:
                    bad, first = bad + 1, first or f"{text!r}: {exc}"
                    break
                want = ref.expected_after(reference, generated)
                total += 1
                if not torch.equal(got, want):
                    bad += 1
                    diff = (got != want).nonzero().flatten().tolist()
                    prefix = b"".join(tb[t] for t in generated)
                    first = first or f"{str(text)[:30]!r} after {prefix!r}: {[(tb[i], bool(got[i])) for i in diff[:3]]}"
                choices = [i for i in range(1, len(tb)) if want[i]]
                if not choices:
                    break
                generated.append(rng.choice(choices))
                try:
                    lib.consume(m, generated[-1])
                except Exception as exc:
                    bad, first = bad + 1, first or f"{text!r}: consume failed ({exc})"
                    break
    return bad, total, first


def speed(lib, kind, text, steps=300) -> tuple[float, float, float]:
    """(compile ms, median mask us, median consume us) along a random walk under the library's own mask."""
    rng = random.Random(1)
    start = time.perf_counter()
    m = lib.compile(kind, text)
    compile_ms = (time.perf_counter() - start) * 1e3
    masks, consumes = [], []
    for _ in range(steps):
        start = time.perf_counter()
        allowed = lib.mask(m)
        masks.append(time.perf_counter() - start)
        choices = [i for i in allowed.nonzero().flatten().tolist() if i != EOS]
        if not choices:
            m = lib.compile(kind, text)
            continue
        start = time.perf_counter()
        lib.consume(m, rng.choice(choices))
        consumes.append(time.perf_counter() - start)
    return compile_ms, statistics.median(masks) * 1e6, statistics.median(consumes) * 1e6


def compare_matchers() -> None:
    from transformers import AutoTokenizer

    ref = load_references()
    tok = AutoTokenizer.from_pretrained(TINY)
    size = len(tok)
    libs = matchers(tok, size, ref.token_bytes())
    regex_cases = [("regex", p, ref.RegexReference(p)) for p in ref.REGEXES]
    cfg = {"lark": ref.PARENS_LARK, "ebnf": ref.PARENS_GBNF}
    cfg_cases = [("cfg", cfg, ref.ParensReference())]
    json_cases = [("json", json.dumps(ref.SCHEMA), ref.RegexReference(ref.SCHEMA_REGEX))]
    arithmetic = {"lark": ARITHMETIC, "ebnf": ARITHMETIC_GBNF}
    timed = [("regex", r'"[^"\n]{0,40}"'), ("json", json.dumps(SCHEMA)), ("cfg", arithmetic)]
    for lib in libs:
        print(f"\n{lib.name}: tokenizer setup {lib.setup * 1e3:.0f} ms")
        for label, cases in (("regexes", regex_cases), ("grammar", cfg_cases), ("json schema", json_cases)):
            try:
                bad, total, first = correctness(lib, ref, cases)
                print(f"  {label:12s} masks differing from brute force: {bad}/{total}  {first}")
            except NotImplementedError as exc:
                print(f"  {label:12s} not supported ({exc})")
        for kind, text in timed:
            try:
                c, m, k = speed(lib, kind, text)
                print(f"  {kind:5s} compile {c:7.2f} ms   mask {m:6.1f} us   consume {k:6.1f} us")
            except NotImplementedError as exc:
                print(f"  {kind:5s} not supported ({exc})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--matchers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.matchers:
        compare_matchers()
    else:
        stage_cost(args.tokens, args.rounds)
        decode_cost(args.rounds)


if __name__ == "__main__":
    sys.exit(main())
