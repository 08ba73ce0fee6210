"""Every documented example that shows its printed output (README.md, docs/*.md) is run and its output compared with
what the doc shows, so the docs cannot drift again (issue 40); every other fast example is run and must exit 0.

What a doc block shows is compared line by line, exactly (trailing spaces aside), with the docs' own conventions
for what it leaves out or cannot fix:

* a line ``…`` alone (or ``… (a note)``) stands for any number of printed lines, none included; a block that does
  not start (end) with one must match the output's first (last) line;
* ``…`` inside a line stands for any text (``summary: ... kv_bytes=190464 …``: the rest of the line cut);
* an HTML comment right before the block, ``<!-- output: varies: LABEL, LABEL; columns: 80 -->``, names the values
  that cannot be fixed (timings, speeds): a number after a LABEL (``tokens_per_s=142.3``, ``min 0.96x``), the
  numbers at the ``{}`` of a phrase (``{} vs {} tokens/s``), every cell of the table column headed LABEL, or every
  number with ``varies: numbers``. Those become placeholders in the doc and in the output alike; in such a block
  runs of spaces and of table rules count as one (a timing's width moves a column) and a summary wrapped over
  several lines is one line. ``columns`` is the width the output was captured at (100 unless said); ``continues``
  marks a block that shows more of the example before it (prose between them); ``stderr`` that the block shows
  stderr's lines too, after stdout's.

Everything else (greedy runs, seeded samples on the bundled models with one thread, token texts, numbers rounded as
printed, table layout at the stated width) must be as printed. A command runs as written, in a fresh folder that
sees the repository's examples/ and presets/, with ``OMP_NUM_THREADS=1`` and ``COLUMNS`` set (in this process when
it is one plain ``decodelab`` command, else with bash); its stdout is compared (stderr's machine-load note is never:
it depends on other jobs). A comment that quotes what a command prints (``# 0.444 0.333 0.222``) is checked too.

Examples that take more than about ten seconds carry the ``slow`` marker (CI runs them after the fast suite);
:data:`NOT_RUN` lists the ones never run here, each skipped with its reason."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import ROOT

SOURCES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", flags=re.S | re.M)
MARKER = re.compile(r"<!--\s*output:(.*?)-->", flags=re.S)
SHELL = re.compile(r"(&&|\|\||[|<>;]|2>|\$\()")


@dataclass
class Example:
    where: str  # file:line of the command
    command: str  # one shell line, continuations joined, the comment dropped
    shown: list[str] | None = None  # the printed lines the doc shows (None: none)
    varies: tuple[str, ...] = ()
    columns: int = 100
    stderr: bool = False  # the doc shows stderr's lines too (after stdout's)
    setup: str = ""  # an earlier example of the same page that writes a file this one reads
    claims: tuple[str, ...] = ()  # what its comment says it prints (each must be in its stdout)

    @property
    def id(self) -> str:
        return f"{self.where}:{self.command[len('decodelab '):][:60]}"


def command_lines(block: str) -> list[tuple[int, str, str]]:
    """(line offset, the line, its comment) of each ``decodelab`` line of a bash block: continuations joined."""
    out, offset = [], 0
    for raw in re.split(r"(?<!\\)\n", block):
        line = re.sub(r"\\\n\s*", " ", raw).strip()
        line, _, comment = (re.split(r"(\s+#\s)", " " + line, maxsplit=1) + ["", ""])[:3]
        if line.strip().startswith("decodelab "):
            out.append((offset, line.strip(), comment.strip()))
        offset += raw.count("\n") + 1
    return out


def claims(comment: str) -> list[str]:
    """What a command's comment says it prints: its quoted texts and decimal numbers (``# ' 3749.' then EOS``,
    ``# 0.444 0.333 0.222``)."""
    return re.findall(r"'([^']+)'", comment) + re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", comment)


def read_marker(text: str) -> dict:
    """The fields of an ``<!-- output: ... -->`` comment: ``varies: a, b; columns: 80; continues``."""
    fields: dict = {}
    for part in text.split(";"):
        key, _, value = part.strip().partition(":")
        fields[key.strip()] = value.strip()
    return fields


def written(command: str) -> list[str]:
    """The files a command line writes (``> F``, ``-o F``)."""
    words = shlex.split(command)
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w in (">", "-o", "--output")]


def with_setup(found: list[Example]) -> list[Example]:
    """Each example that reads a file an earlier example of its page writes gets that example as its setup."""
    writers: dict[tuple[str, str], str] = {}
    for example in found:
        page = example.where.rsplit(":", 1)[0]
        for word in shlex.split(example.command):
            if (page, word) in writers and word not in written(example.command):
                example.setup = writers[page, word]
        writers.update({(page, name): example.command for name in written(example.command)})
    return found


UNATTACHED: list[str] = []  # text blocks that follow no command (filled by examples())


def examples() -> list[Example]:
    """Every ``decodelab`` command of the pages' bash blocks (and of blocks holding only commands), each with the
    output block that follows it, a ``$ decodelab ...`` block's own lines, and ``continues`` blocks attached."""
    found: list[Example] = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        blocks = list(FENCE.finditer(text))
        for k, block in enumerate(blocks):
            lang, body = block.group(1), block.group(2)
            line_no = text.count("\n", 0, block.start()) + 2
            where = f"{path.relative_to(ROOT)}:{line_no}"
            if lang == "bash":
                for offset, command, comment in command_lines(body):
                    found.append(Example(f"{path.relative_to(ROOT)}:{line_no + offset}", command,
                                         claims=tuple(claims(comment))))
                continue
            between = text[blocks[k - 1].end():block.start()] if k else "x"
            marker = MARKER.search(between)
            marker = marker if marker and not between[marker.end():].strip() else None  # right before the block
            adjacent = not (between.replace(marker.group(0), "") if marker else between).strip()
            fields = read_marker(marker.group(1)) if marker else {}
            lines = body.rstrip("\n").split("\n")
            if all(line.startswith("decodelab ") for line in lines):  # commands in a block without a language
                found += [Example(f"{where[:where.rindex(':')]}:{line_no + i}", line) for i, line in enumerate(lines)]
                continue
            if lines[0].startswith("$ decodelab "):  # a command shown with its output in one block
                example = Example(where, lines[0][2:])
                found.append(example)
                lines = lines[1:]
            elif "continues" in fields:
                example = found[-1]
                lines = ["…"] + lines
            elif adjacent and blocks[k - 1].group(1) == "bash":
                commands = command_lines(blocks[k - 1].group(2))
                assert len(commands) == 1, f"{where}: an output block after a bash block of {len(commands)} commands"
                example = found[-1]
            else:  # not output (a diagram, a formula, a file), unless it says it is: then it must be attached
                if lang == "text":
                    UNATTACHED.append(where)
                continue
            example.shown = (example.shown or []) + lines
            if "varies" in fields:
                example.varies += tuple(v.strip() for v in fields["varies"].split(",") if v.strip())
            if "columns" in fields:
                example.columns = int(fields["columns"])
            example.stderr = example.stderr or "stderr" in fields
    return with_setup(found)


# ---------------------------------------------------------------------------------------------- comparing


NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?x?%?"
SKIP = re.compile(r"…(\s*\(.*\))?")
PLACEHOLDER = "<n>"


def placeholders(line: str, label: str) -> str:
    """The line with the numbers `label` names made placeholders: ``{} vs {} tokens/s`` names the numbers at its
    ``{}``; a plain label the number after it (``tokens_per_s=142.3``, ``min 0.96x``, ``ratio c: 0.198``)."""
    if "{}" in label:
        parts = label.split("{}")
        found = re.compile(NUMBER.join(re.escape(part) for part in parts))
        return found.sub(lambda m: PLACEHOLDER.join(parts), line)
    found = re.compile(rf"(?<![\w-]){re.escape(label)}(=|:\s*|\s+){NUMBER}")
    return found.sub(lambda m: f"{label}{m.group(1)}{PLACEHOLDER}", line)


def normalize(lines: list[str], varies: tuple[str, ...]) -> list[str]:
    """The lines with every varying value a placeholder; where anything varies, a wrapped summary joined into one line
    and spaces and rules collapsed: in the lines holding a placeholder, or in every line when a table column varies
    (see the module's docstring)."""
    lines = [line.rstrip() for line in lines]
    if not varies:
        return lines
    out: list[str] = []
    columns: set[int] = set()
    width, a_column = 0, False
    for line in lines:
        if not SKIP.fullmatch(line.strip()):
            if "numbers" in varies:
                line = re.sub(rf"(?<![\w<]){NUMBER}(?![\w>])", PLACEHOLDER, line)
            for label in varies:
                line = placeholders(line, label)
            if "┃" in line:
                cells = line.split("┃")
                named = {i for i, cell in enumerate(cells) if cell.strip() in varies}
                if named or len(cells) != width:
                    columns, width = named | (columns if len(cells) == width else set()), len(cells)
                a_column = a_column or bool(named)
            elif "│" in line and columns and len(cells := line.split("│")) == width:
                line = "│".join(f" {PLACEHOLDER} " if i in columns and cell.strip() else cell
                                for i, cell in enumerate(cells))
        if out and re.fullmatch(r"(\S+=\S+\s*)+(…)?", line) and out[-1].startswith("summary:"):
            out[-1] += "  " + line
        else:
            out.append(line)
    collapse = [a_column or "numbers" in varies or PLACEHOLDER in line for line in out]
    return [re.sub(r" +", " ", re.sub(r"([━─═])\1+", r"\1", line)).strip() if c else line
            for line, c in zip(out, collapse)]


def line_pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in shown.split("…")))


def compare(shown: list[str], printed: list[str], varies: tuple[str, ...] = ()) -> str | None:
    """None when the printed lines are what the doc shows (the conventions above), else a diff to read."""
    doc, out = normalize(shown, varies), normalize(printed, varies)
    patterns = [None if SKIP.fullmatch(line.strip()) else line_pattern(line) for line in doc]

    furthest = [0, 0]  # the last doc line reached, and the first printed line it was tried at

    @lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if (i, -j) > (furthest[0], -furthest[1]):
            furthest[:] = [i, j]
        if i == len(patterns):
            return j == len(out)
        if patterns[i] is None:
            return any(match(i + 1, k) for k in range(j, len(out) + 1))
        return j < len(out) and patterns[i].fullmatch(out[j]) is not None and match(i + 1, j + 1)

    if match(0, 0):
        return None
    i, j = furthest
    missing = doc[i] if i < len(doc) else "(the end of the output)"
    near = "\n".join(f"    {line}" for line in out[max(0, j - 2):j + 3])
    diff = "\n".join(difflib.unified_diff(doc, out, "the doc shows", "printed", lineterm="", n=1))
    return f"the doc's line {i + 1} {missing!r} is not printed where expected; printed there:\n{near}\n{diff}"


# ---------------------------------------------------------------------------------------------- running


MACHINE_NOTE = "note: load average "


def run(example: Example, cli, monkeypatch, folder: Path, timeout: float = 600) -> tuple[int, list[str], str]:
    """(exit status, the printed lines, stderr) of the example run as written in `folder`, which sees the
    repository's examples/ and presets/ (the files a command writes land there): the lines are stdout's, then
    stderr's where the doc shows them (``stderr`` in its marker)."""
    for name in ("examples", "presets"):
        if not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("COLUMNS", str(example.columns))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")

    def shell(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"set -eo pipefail; {line}"], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)

    if example.setup:
        done = shell(example.setup)
        assert done.returncode == 0, (example.setup, done.stderr[-2000:])
    words = shlex.split(example.command)
    if not any(SHELL.fullmatch(w) for w in words) and "$(" not in example.command:
        code, out, err = cli(*words[1:])
    else:
        done = shell(example.command)
        code, out, err = done.returncode, done.stdout, done.stderr
    err_lines = [line for line in err.splitlines() if not line.startswith(MACHINE_NOTE)]
    return code, out.splitlines() + (err_lines if example.stderr else []), err


# ---------------------------------------------------------------------------------------------- the examples


def unique(found: list[Example]) -> list[Example]:
    """One example per distinct command (the first place it is documented; the output and claims any place shows)."""
    seen: dict[str, Example] = {}
    for example in found:
        first = seen.setdefault(example.command, example)
        first.claims = first.claims or example.claims
        if first is not example and example.shown is not None:
            assert first.shown is None, f"{example.where}: a second output for {example.command!r} ({first.where})"
            first.shown, first.varies, first.columns = example.shown, example.varies, example.columns
    return list(seen.values())


EXAMPLES = unique(examples())

# never run here, each with why (matched as a substring of the command)
NOT_RUN = {
    "--engine ": "needs a served model (the same commands run against a real vLLM in tests/engine/test_vllm_real.py)",
    "./my-model": "a placeholder for the user's own model folder",
    "essay.txt": "a placeholder for the user's own text",
    "my.txt": "a placeholder for the user's own text",
    "rollouts.jsonl": "a placeholder for the user's own rollouts",
    "sampled_at_top_p_0.8.txt": "a placeholder for the user's own sample",
    "person.schema.json": "a placeholder for the user's own JSON schema",
}

# run only under `pytest -m slow` (CI runs them after the fast suite): more than about ten seconds each on the shared
# 2-core machine (seconds measured there under load, 2026-12-04), matched as a substring of the command
SLOW = {
    "--compare-policies --window 128": "seven policies scored over 768 tokens (187 s at --limit 1024 --window 256)",
    "bench -n 32 --rounds 3 --settings greedy,sampling,beam,speculative": "every setting against generate "
                                                                           "(155 s at -n 128 --rounds 7)",
    "--limit 2048 --cache window:size=256": "2048 tokens scored (77 s at --limit 8192)",
    "--compile": "torch.compile (50 s)",
    'stream "In the beginning" -n 2000': "2000 tokens (36 s)",
    "check-sampler": "500 draws and the exact law (29 s)",
    "quantize-kv": "every quantize-kv example: a grid, presses or a projection (17-30 s)",
    "> trace.json": "a second process (22 s)",
    "--resume trace.json": "after the example that writes trace.json (15 s)",
    "decodelab view ": "two processes (16-18 s)",
    "$(head -c 1500": "a second process and a 1500-byte prompt (13 s)",
}

# documented examples known to fail today, with why (none: compare honours a prompt's own settings since issue 40)
KNOWN: dict[str, str] = {}


def reason_not_run(example: Example) -> str | None:
    return next((why for part, why in NOT_RUN.items() if part in example.command), None)


def params(shown: bool) -> list:
    out = []
    for example in EXAMPLES:
        if (example.shown is not None) != shown:
            continue
        marks = [pytest.mark.slow] if any(part in example.command for part in SLOW) else []
        marks += [pytest.mark.skip(reason=why) for why in [reason_not_run(example)] if why]
        marks += [pytest.mark.xfail(reason=why) for part, why in KNOWN.items() if part in example.command]
        out.append(pytest.param(example, id=example.id, marks=marks))
    return out


@pytest.mark.parametrize("example", params(shown=True))
def test_a_documented_output_is_what_the_example_prints(example, cli, monkeypatch, tmp_path):
    code, printed, err = run(example, cli, monkeypatch, tmp_path)
    assert code == 0, (example.where, err[-2000:])
    drift = compare(example.shown, printed, example.varies)
    assert drift is None, f"{example.where}: `{example.command}` no longer prints what the doc shows:\n{drift}"


@pytest.mark.parametrize("example", params(shown=False))
def test_a_documented_example_without_output_runs(example, cli, monkeypatch, tmp_path):
    code, printed, err = run(example, cli, monkeypatch, tmp_path)
    assert code == 0, (example.where, err[-2000:])
    stdout = "\n".join(printed)
    missing = [claim for claim in example.claims if claim not in stdout]
    assert not missing, f"{example.where}: `{example.command}` does not print {missing}, as its comment says"


# ---------------------------------------------------------------------------------------------- the check bites


def test_the_docs_have_outputs_to_check():
    shown = [e for e in EXAMPLES if e.shown is not None]
    assert len(shown) >= 18 and {e.where.split(":")[0] for e in shown} >= {"README.md", "docs/speculative.md",
                                                                           "docs/semantics.md"}


def test_every_text_block_is_the_output_of_an_example():
    """A ```text block is output: right after its command's bash block, a ``$ decodelab`` line of its own, or marked
    ``continues``; one that is none of these would go unchecked."""
    assert not UNATTACHED


def test_every_output_marker_is_understood():
    for path in SOURCES:
        for marker in MARKER.finditer(path.read_text(encoding="utf-8")):
            assert set(read_marker(marker.group(1))) <= {"varies", "columns", "continues", "stderr"}, marker.group(0)


def test_the_conventions():
    printed = ["title", "a 1", "b 2", "c 3", "summary: x=1  speed=12.5", "y=2"]
    assert compare(["title", "…", "c 3", "…"], printed) is None
    assert compare(["title", "a 1", "b 2", "c 3", "…"], printed) is None
    assert compare(["…", "b 2", "…"], printed) is None
    assert compare(["title", "a …", "…"], printed) is None  # `…` in a line: the rest of the line
    assert compare(["title", "…", "summary: x=1  speed=99", "y=2"], printed, ("speed",)) is None
    assert compare(["title", "…", "summary: x=1  speed=99  y=2"], printed, ("speed",)) is None  # wrapped or not
    assert compare(["title", "…", "summary: x=1  speed=12.5", "y=2"], printed) is None
    # drifts
    assert compare(["title", "b 2", "…"], printed) is not None  # a line left out without `…`
    assert compare(["title", "…", "c 3"], printed) is not None  # not the end
    assert compare(["…", "b 2", "a 1", "…"], printed) is not None  # order
    assert compare(["title", "…", "summary: x=2  speed=99", "y=2"], printed, ("speed",)) is not None
    assert compare(["title", "…", "summary: x=1  speed=99", "y=2"], printed) is not None  # not said to vary
    assert compare(["…", "summary: x=1  speed=12.5", "y=3"], printed, ("speed",)) is not None


def test_a_varying_column_and_numbers_in_a_phrase():
    table = ["┃ name ┃ tok/s ┃ a ┃", "┡━━━━━━╇━━━━━━━╇━━━┩", "│ x    │ 150.6 │ 1 │", "│ y    │ 99.1  │ 2 │",
             "12.5 vs 30.1 tokens/s, max 1.2x"]
    doc = ["┃ name ┃ tok/s ┃ a ┃", "┡━━━━━━╇━━━━━━━━━╇━━━┩", "│ x    │ 1234.5 │ 1 │", "│ y    │ 9.1 │ 2 │",
           "1.0 vs 2.0 tokens/s, max 9.9x"]
    assert compare(doc, table, ("tok/s", "{} vs {} tokens/s", "max")) is None
    assert compare(doc, table, ("tok/s", "max")) is not None  # the phrase not said to vary
    assert compare([*doc[:3], "│ y    │ 9.1 │ 3 │", doc[4]], table, ("tok/s", "{} vs {} tokens/s", "max")) is not None


def test_a_planted_drift_in_a_real_doc_block_fails(cli, monkeypatch, tmp_path):
    """Negative control on real output: a copy of two README blocks (an exact one and one with timings), each edited
    the way a drift would change it, no longer matches what the command prints; the unedited copy does."""
    models = next(e for e in EXAMPLES if e.command == "decodelab models")
    sample = next(e for e in EXAMPLES if e.command.startswith('decodelab sample "The compiler" -t 0.8 --top-p 0.95'))
    for example, drifts in (
            (models, [("2,739,328", "2,739,329"), ("│     12 │", "│     13 │"), ("tiny-draft", "tiny-drift")]),
            (sample, [("mean_logprob=-3.485", "mean_logprob=-3.484"), ("␣format", "␣formats"),
                      ("0.097    0.061", "0.097    0.062"), ("temperature 0.8 · ", "")])):
        code, printed, _ = run(example, cli, monkeypatch, tmp_path)
        assert code == 0 and compare(example.shown, printed, example.varies) is None
        for old, new in drifts:
            edited = [line.replace(old, new) for line in example.shown]
            assert edited != example.shown, old
            assert compare(edited, printed, example.varies) is not None, (example.command, old, new)
    # a timing is not a drift: the sample's speeds edited, the block still matches
    code, printed, _ = run(sample, cli, monkeypatch, tmp_path)
    edited = [re.sub(r"tokens_per_s=[\d.]+", "tokens_per_s=1", line) for line in sample.shown]
    assert edited != sample.shown and compare(edited, printed, sample.varies) is None


if __name__ == "__main__":  # `PYTHONPATH=tests python tests/cli/test_docs_output.py TEXT`: what each example with
    # shown output and TEXT in its command prints now, at its width (to bring a block up to date after a change)
    for found in EXAMPLES:
        if found.shown is not None and all(part in found.command for part in sys.argv[1:]):
            env = dict(os.environ, COLUMNS=str(found.columns), OMP_NUM_THREADS="1")
            done = subprocess.run(["bash", "-c", found.command], cwd=ROOT, env=env, capture_output=True, text=True)
            print(f"== {found.where} (COLUMNS={found.columns})\n$ {found.command}")
            print("\n".join(line.rstrip() for line in done.stdout.splitlines()))
            if found.stderr:
                print("\n".join(line for line in done.stderr.splitlines() if not line.startswith(MACHINE_NOTE)))
