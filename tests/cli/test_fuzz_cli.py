"""Property-based fuzz of the command line: every command with option values drawn from valid, boundary and garbage
values (huge, negative, NaN, infinities, empty, non-UTF-8, odd unicode). Whatever the input, a run ends with exit
status 0 (it ran) or 2 (one line naming the problem), never a traceback.

A few examples per command run in the default suite on the toy model; the long run carries the `slow` marker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# argv as Python receives it from a terminal: bytes that are not UTF-8 arrive as lone surrogates (os.fsdecode)
NON_UTF8 = os.fsdecode(b"caf\xe9 \xff\xfe")

INTS = ["0", "1", "2", "3", "-1", "-7", "64", "65", "255", "256", "10000", str(2**31), str(2**63), str(2**70),
        "9" * 40, "1.5", "1e3", "", " ", "abc", "nan", "inf", "0x10", "٣"]
FLOATS = ["0", "0.0", "-0.0", "1", "0.5", "0.999999", "1.0000001", "2", "-1", "1e-45", "1e-40", "1e-300", "5e-324",
          "1e30", "1e308", "1e309", "-1e309", "nan", "-nan", "inf", "-inf", "", " ", "abc", "1,5", "0.5.5", "１"]
TEXTS = ["", " ", "a", ",", ",,", "=", "==", "a=b", "\x00", "\n", "é", "\U0001F600", "\u202e", "\udcff", NON_UTF8,
         "x" * 300, "-", "--", "-n"]  # not "--debug": main() takes it as the flag anywhere before "--"
BIASES = ["0=-inf", "0=inf", "0=1e30", "0=-1e30", "0=nan", "1=5", "-1=1", "999999=1", "=1", "0=", "0", " the=2",
          " the=inf", "zzzzzzzzzz=1", "\udcff=1", "0=1e309"]
CHAINS = ["", ",", " , ", "temperature", "top-k", "top-p,temperature", "bias", "nope", "temperature,temperature",
          "softcap,repetition-penalty,no-repeat-ngram,bias,temperature,top-k,top-p,min-p,typical-p"]
SETS = ["temperature=0", "temperature=-1", "top_p=2", "top-k=0", "nope=1", "seed=" + str(2**70), "max_new_tokens=x",
        "stop=", "logit_bias=0=-inf", "chain=,", "temperature", "=", "top=none", "ignore_eos=maybe",
        "no_repeat_ngram=3", "seed=-1", "top=" + str(2**64)]
PRESETS = ["greedy", "nucleus", "creative", "softcap", "balanced", "nope", "", "/", "/nonexistent.toml", NON_UTF8]
FORMATS = ["table", "json", "jsonl", "markdown", "csv", "", "xml", "JSON"]
DEVICES = ["cpu", "auto", "", "gpu", "cuda:99", "meta"]
DTYPES = ["auto", "float32", "bfloat16", "float16", "int8", "", "float64"]
MODELS = ["", "/nonexistent", "/", ".", "tiny-draft-x", NON_UTF8]

CHAIN_OPTIONS = {
    "--temperature": FLOATS + ["0", "0", "0.7"], "--top-k": INTS, "--top-p": FLOATS, "--min-p": FLOATS,
    "--typical-p": FLOATS, "--softcap": FLOATS, "--repetition-penalty": FLOATS, "--no-repeat-ngram": INTS,
    "--logit-bias": BIASES, "--chain": CHAINS,
}
# the constraint options (one per run: two drawn at once must be refused in one line too)
REGEXES = TEXTS + ["(a", "[", "[a-z]+", "(yes|no)", "a{0,100000}", "(?i)yes", r"\d+", r"\b", ".*", r"[^\s\S]", "a|",
                   r"\p{Greek}+", "é+", "(?=a)a"]
CHOICES = TEXTS + ["yes,no", " yes, no", "a,a", "é,\U0001F600", "x" * 60 + ",y"]
FILES = ["", "/", "/nonexistent.json", ".", NON_UTF8, "prompts.txt"]  # batch writes prompts.txt: not a schema
CONSTRAINT_OPTIONS = {"--regex": REGEXES, "--choice": CHOICES, "--json-schema": FILES, "--grammar": FILES}
CHAIN_OPTIONS.update(CONSTRAINT_OPTIONS)
RUN_OPTIONS = {
    "-n": INTS, "--seed": INTS, "--set": SETS, "--preset": PRESETS, "--format": FORMATS, "--device": DEVICES,
    "--dtype": DTYPES, "--model": MODELS, "--stop": TEXTS, "--top": INTS,
}
BEAM_OPTIONS = {
    "--beams": ["1", "2", "4", "0", "-1", "257", str(2**63), "x"], "--return": INTS,
    "--length-penalty": FLOATS, "--length-norm": ["hf", "gnmt", "prompt-inclusive", "none", "", "x"],
    "--early-stopping": ["true", "false", "never", "", "maybe"], "--sweep-length-penalty": ["0,1", ",", "", "nan,1",
                                                                                          "1e309", "a,b", "0,,1"],
}
SPEC_OPTIONS = {
    "--gamma": ["1", "2", "4", "0", "-1", "64", "10000", str(2**63), "x"], "--ngram-size": INTS,
    "--sweep-gamma": ["1,2", ",", "", "0", "1,x", "-1", "2,2", str(2**63)], "--draft": ["ngram", "", "/nonexistent"],
    "--speedup-rounds": ["1", "2", "0", "-1", "101", str(2**63), "x"],
}
CACHES = ["full", "static", "window:size=8", "sinks:sinks=2,recent=8", "recompute:size=8", "int8", "int4-kivi",
          "quant:bits=3", "paged", "", "nope", "window:size=0", "window:size=-1", "window:size=nan", "full:x=1",
          "sinks:sinks=99,recent=1", "window:size=" + str(2**63), "quant:bits=8,axis=x", NON_UTF8]
SAMPLER_OPTIONS = {
    "--presence-penalty": FLOATS, "--frequency-penalty": FLOATS, "--penalty-last-n": INTS, "--dry-multiplier": FLOATS,
    "--dry-base": FLOATS, "--dry-allowed-length": INTS, "--xtc-threshold": FLOATS, "--xtc-probability": FLOATS,
    "--top-n-sigma": FLOATS, "--mirostat-tau": FLOATS, "--dynatemp-range": FLOATS, "--epsilon-cutoff": FLOATS,
    "--eta-cutoff": FLOATS, "--min-new-tokens": INTS, "--semantics": ["hf", "vllm", "llamacpp", "", "x"],
    "--ban": TEXTS, "--allow": TEXTS, "--stop-id": INTS, "--sequence-bias": BIASES, "--dry-breaker": TEXTS,
    "-N": ["1", "2", "0", "-1", "x"], "--force": ["0=1", "0= the", "x=1", "0=", "99=1", "-1=1", "0=999999"],
}
SCORE_OPTIONS = {"--feed": INTS, "--chunk": INTS, "--limit": INTS, "--against": ["tiny-draft", "", "/nonexistent"],
                 "--against-cache": CACHES}
STREAM_OPTIONS = {"--chunk": INTS, "--feed": INTS, "--limit": INTS, "--window": INTS, "--sinks": INTS}
QUANT_OPTIONS = {"--bits": ["8", "4", "2", "3", "fp8", "0", "", "x", "nan"], "--axis": ["token", "channel", "group",
                 "tensor", "kivi", "", "x"], "--group-size": INTS, "--residual": INTS, "--limit": INTS,
                 "--feed": INTS, "--activations": INTS, "--context": INTS, "--batch": INTS}
COMPARE_OPTIONS = {"-V": ["a: temperature=0", "b: top_p=0.5", "c: method=beam,beams=2", "d: method=speculate",
                          "x", ":", "e: nope=1", "f: temperature=nan", "", "g: cache=int8", NON_UTF8 + ": top_k=1"],
                   "--seeds": ["0", "0-2", "2-0", "", "x", "-1", str(2**70), "0,1"],
                   "--preset": PRESETS}
BENCH_OPTIONS = {"--rounds": ["1", "0", "-1", "x"], "--gammas": ["1", "2", ",", "", "0", "x"],
                 "--settings": ["greedy", "sampling", "beam", "prompt-lookup", "", "x", "greedy,,greedy"],
                 "--beams": ["1", "2", "0", "-1"], "--draft": ["tiny-draft", "", "/nonexistent"]}
BATCH_OPTIONS = {"--max-batch": INTS, "--max-tokens-per-iteration": INTS, "--block-size": INTS, "--blocks": INTS,
                 "--baselines": ["none", "static", "", "x", "static,static"], "--rows": ["requests", "iterations", "",
                                                                                       "x"]}
ENGINE_OPTIONS = {"--engine": ["http://127.0.0.1:9", "127.0.0.1:8000", "", "ftp://x", NON_UTF8],
                  "--engine-timeout": ["1", "0", "-1", "x", "nan"], "--engine-model": ["tiny", ""]}
BEAM_CHAIN = {k: CHAIN_OPTIONS[k] for k in ("--repetition-penalty", "--no-repeat-ngram", "--logit-bias", "--chain",
                                           *CONSTRAINT_OPTIONS)}
MODEL_OPTIONS = {k: v for k, v in RUN_OPTIONS.items() if k in ("--format", "--device", "--dtype", "--model")}
COMMAND_OPTIONS = {
    "sample": {**RUN_OPTIONS, **CHAIN_OPTIONS, **SAMPLER_OPTIONS, **ENGINE_OPTIONS, "--cache": CACHES},
    "probs": {**{k: v for k, v in RUN_OPTIONS.items() if k not in ("-n", "--stop")}, **CHAIN_OPTIONS,
              "--cache": CACHES},
    "beam": {**{k: v for k, v in RUN_OPTIONS.items() if k not in ("--stop", "--top")}, **BEAM_CHAIN, **BEAM_OPTIONS,
             "--cache": CACHES},
    "speculate": {**RUN_OPTIONS, **CHAIN_OPTIONS, **SPEC_OPTIONS, "--cache": CACHES},
    "score": {**MODEL_OPTIONS, **CHAIN_OPTIONS, **SCORE_OPTIONS, **ENGINE_OPTIONS, "--top": INTS, "--preset": PRESETS,
              "--set": SETS, "--cache": CACHES},
    "stream": {**RUN_OPTIONS, **CHAIN_OPTIONS, **STREAM_OPTIONS, "--cache": CACHES},
    "quantize-kv": {**MODEL_OPTIONS, **QUANT_OPTIONS, "--top": INTS, "--cache": CACHES},
    "compare": {**{k: v for k, v in RUN_OPTIONS.items() if k in ("-n", "--stop", "--format", "--model")},
                **CHAIN_OPTIONS, **COMPARE_OPTIONS},
    "bench": {**{k: v for k, v in RUN_OPTIONS.items() if k in ("-n", "--format", "--model")}, **BENCH_OPTIONS},
    "batch": {**{k: v for k, v in RUN_OPTIONS.items() if k in ("-n", "--seed", "--stop", "--format", "--model")},
              **CHAIN_OPTIONS, **BATCH_OPTIONS},
    "models": {"--format": FORMATS},
}
# flags without a value
FLAGS = {"sample": ["--ignore-eos", "--chat", "--trim-stop"], "probs": ["--chat"], "beam": ["--ignore-eos", "--chat"],
         "speculate": ["--ignore-eos", "--chat"], "score": [], "stream": ["--ignore-eos", "--attention",
         "--compare-policies"], "quantize-kv": ["--grid", "--symmetric", "--asymmetric"], "compare": ["--ignore-eos"],
         "bench": [], "batch": ["--ignore-eos", "--chat"], "models": []}
# what each command needs to run short on the toy model; drawn options come after and override these
DEFAULTS = {"sample": ["-n", "3"], "probs": [], "beam": ["-n", "3"], "speculate": ["-n", "3", "--draft", "ngram"],
            "score": ["--limit", "12"], "stream": ["-n", "3"], "quantize-kv": ["--limit", "12"],
            "compare": ["-n", "3", "-V", "base: temperature=0"], "bench": ["-n", "2", "--rounds", "1", "--settings",
            "greedy"], "batch": ["-n", "3", "--baselines", "none"], "models": []}
NO_PROMPT = {"models", "bench"}  # no positional argument; batch's drawn prompt goes into its --prompts-file
PROMPTS = ["Hello", "Hi", "a b c a b c", "é", "\U0001F600", "\u202e", "x" * 400, NON_UTF8, "\x00", " ", "--",
           "--debug", ""]  # not "-": that reads stdin


@st.composite
def command_line(draw, command: str) -> tuple[list[str], str | None]:
    """(options, prompt): the prompt goes last, after `--`, so one that starts with a dash is still the prompt."""
    options = COMMAND_OPTIONS[command]
    args = []
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=4)):
        args += [name, draw(st.sampled_from(options[name]))]
    if FLAGS[command]:
        args += draw(st.lists(st.sampled_from(FLAGS[command]), max_size=2, unique=True))
    return args, (None if command in NO_PROMPT else draw(st.sampled_from(PROMPTS)))


def check(cli, model_dir, command: str, args: list[str], prompt: str | None) -> None:
    """Defaults that keep a run short (the toy model, few tokens, the n-gram proposer) come first, so a drawn value
    of the same option overrides them."""
    full = [command]
    if command != "models":
        full += ["-m", str(model_dir), "-f", "json"] + DEFAULTS[command]
    if command == "batch":
        prompts = Path("prompts.txt")  # in the test's working folder
        prompts.write_text(f"Hello\n{prompt}\n", encoding="utf-8", errors="surrogateescape")
        full += ["--prompts-file", str(prompts)]
        prompt = None
    full += args + ([] if prompt is None else ["--", prompt])
    code, out, err = cli(*full)
    assert code in (0, 2), (full, code, err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, (full, err[-2000:])
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1, (full, err)


def fuzz(command: str, examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(drawn=command_line(command))
    def run(cli, model_dir, drawn):
        check(cli, model_dir, command, *drawn)

    return run


COMMANDS = sorted(COMMAND_OPTIONS)


@pytest.mark.parametrize("command", COMMANDS)
def test_fuzz_short(cli, toy_model_dir, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)  # anything a run writes lands here
    fuzz(command, 12)(cli, toy_model_dir)


LONG = {"bench": 40, "batch": 60, "compare": 60}  # the costlier commands (each run times or serves several), else 150


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_fuzz_long(cli, toy_model_dir, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    fuzz(command, LONG.get(command, 150))(cli, toy_model_dir)
