"""The decodelab commands run against a served vLLM: recorded by tests/engine/record_vllm.py through a recording
proxy (their exchanges under ``cli`` in the recording) and replayed by the fake server in tests/engine/
test_engine_cli.py. ``{url}`` is the server, ``{prompts}`` a prompts file written from PROMPTS. Every command runs
against both --logprobs-mode raw_logprobs and processed_logprobs servers."""

from __future__ import annotations

from pathlib import Path

PROMPT = "Once upon a time"
TEXT = "God blessed Noah and his sons, and said unto them, Be fruitful, and multiply, and replenish the earth."
PROMPTS = ["In the beginning God created", "And the earth was without form", "And God said, Let there be light",
           "And God saw the light, that it was good"]
ENGINE = ["--engine", "{url}"]

CASES: dict[str, list[str]] = {
    "score": ["score", TEXT, *ENGINE, "-f", "json"],
    "score_top3_limit": ["score", TEXT, "--top", "3", "--limit", "12", "--chunk", "4", *ENGINE, "-f", "json"],
    "sample_greedy": ["sample", PROMPT, "-n", "8", "-t", "0", "--ignore-eos", *ENGINE, "-f", "json"],
    "sample_t07_k5": ["sample", PROMPT, "-n", "6", "-t", "0.7", "--top-k", "5", "--seed", "3", "--ignore-eos",
                      *ENGINE, "-f", "json"],
    "sample_p09_rep": ["sample", PROMPT, "-n", "6", "-t", "1.0", "--top-p", "0.9", "--repetition-penalty", "1.2",
                       "--seed", "4", "--ignore-eos", *ENGINE, "-f", "json"],
    "compare": ["compare", PROMPT, "-V", "g: temperature=0", "-V", "t: temperature=0.8,top_k=20", "-n", "6",
                "--ignore-eos", *ENGINE, "-f", "json"],
    "batch": ["batch", "--prompts-file", "{prompts}", "-n", "6", "-t", "0", "--ignore-eos", "--baselines", "none",
              *ENGINE, "-f", "json"],
    "check_live": ["check-logprobs", *ENGINE, "--prompt", PROMPT, "-n", "6", "-t", "0.7", "--top-k", "5",
                   "--seed", "2", "--ignore-eos", "-f", "json"],
}


def args_for(name: str, url: str, folder: Path) -> list[str]:
    """A case's command line with its placeholders filled (the prompts file written into ``folder``)."""
    prompts = folder / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("\n".join(PROMPTS) + "\n")
    return [a.replace("{url}", url).replace("{prompts}", str(prompts)) for a in CASES[name]]
