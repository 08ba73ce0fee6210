"""Every example of the README's command sections runs as written from the repository root, and does what its
comment or its section says (the files they need ship in examples/)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import ROOT

README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """The `decodelab ...` lines of the README's bash blocks (continuation lines joined, comments dropped), the
    quickstart's install lines left out."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("decodelab "):
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


@pytest.mark.slow
@pytest.mark.parametrize("line", readme_commands())
def test_a_readme_example_runs_as_written_and_does_what_it_says(cli, monkeypatch, line):
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
