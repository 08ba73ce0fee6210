"""Every example of the README's command sections runs as written from the repository root, and does what its
comment or its section says (the files they need ship in examples/)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """The `decodelab ...` lines of the README's bash blocks (continuation lines joined, comments dropped), the
    quickstart's install lines left out, and the lines that need a served model (``--engine URL``: the same
    commands run against a live vLLM in tests/engine/test_vllm_real.py)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("decodelab ") and " --engine " not in line:
                out.append(line.split("  #")[0].split(" # ")[0].strip())
    return out


def test_the_readme_has_an_example_for_every_command():
    commands = {shlex.split(c)[1] for c in readme_commands()}
    assert {"sample", "probs", "score", "beam", "speculate", "stream", "quantize-kv", "compare", "bench", "batch",
            "models"} <= commands, commands


def as_json(cli, line: str) -> dict:
    args = shlex.split(line)[1:]
    code, out, err = cli(*args, "-f", "json", "--threads", "1") if args[0] != "models" else cli(*args, "-f", "json")
    assert code == 0, (line, err)
    return json.loads(out)


SHELL_SYNTAX = re.compile(r"(&&|\|\||[|<>;])")


def is_shell_line(line: str) -> bool:
    """A line that chains commands or redirects output, which only a shell runs as written."""
    return any(SHELL_SYNTAX.fullmatch(word) for word in shlex.split(line))


def test_a_chained_line_is_told_apart_from_a_plain_one():
    assert is_shell_line('decodelab sample "a" -f json > run.json && decodelab view run.json -o run.html')
    assert not is_shell_line('decodelab sample "a > b" -n 2')


def run_in_a_shell(line: str, folder: Path) -> None:
    """Run the line with bash in `folder`, the installed `decodelab` first on PATH; every file a `>` or `-o` names
    must then exist and be non-empty."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(["bash", "-c", f"set -eo pipefail; {line}"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (line, done.stderr[-2000:])
    words = shlex.split(line)
    named = [words[i + 1] for i, w in enumerate(words[:-1]) if w in (">", "-o", "--output")]
    assert named, line
    for name in named:
        assert (folder / name).stat().st_size > 0, (line, name)


@pytest.mark.slow
@pytest.mark.parametrize("line", readme_commands())
def test_a_readme_example_runs_as_written_and_does_what_it_says(cli, monkeypatch, line, tmp_path):
    if is_shell_line(line):
        run_in_a_shell(line, tmp_path)
        return
    monkeypatch.chdir(ROOT)
    doc = as_json(cli, line)
    command = shlex.split(line)[1]
    if command == "beam" and "--sweep-length-penalty" in line:  # "the winner changes at 1"
        assert [r["length_penalty"] for r in doc["sweep"] if r.get("changed")] == [1.0]
    if command == "stream" and "-n" in line:  # past the 512-token context, not stopped at EOS
        assert doc["summary"]["tokens"] >= 1000 or len(doc["token_ids"]) == 1000, doc["summary"]
    if command == "batch":  # the third prompt reuses the first one's block
        assert doc["summary"]["prefix_hit_tokens"] > 0
    if command == "compare":
        assert doc["pairs"] and all(p["deciding_stage"] for p in doc["pairs"] if p["first_divergence"] is not None)
