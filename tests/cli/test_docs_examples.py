"""Every `decodelab ...` example in the bash blocks of docs/*.md and README.md parses with the current command line:
its command exists and every option it gives exists and takes the values given (issue 40: examples drifted from the
options). Parsing only (typer's own parser, no run): the README's examples also run as written in test_readme.py
(`-m slow`), and every example is run and its shown output compared in test_docs_output.py."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import ROOT

SOURCES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SEPARATORS = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&"}


def examples() -> list[tuple[str, str]]:
    """(file name, the words of one decodelab command) for every decodelab command of every bash block: continuation
    lines joined, comments dropped, each command of a pipe or a chain taken alone, redirections cut off."""
    out = []
    for path in SOURCES:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.split(r"\s#\s|\s+#", " " + line.strip())[0].strip()
                try:
                    words = shlex.split(line)
                except ValueError:
                    continue
                part: list[str] = []
                for word in words + ["|"]:
                    if word in SEPARATORS or word.startswith(("2>", ">")):
                        if part[:1] == ["decodelab"] and len(part) > 1:
                            out.append((path.name, part[1:]))
                        part = [] if word in SEPARATORS else ["<cut>"]
                    elif part[:1] != ["<cut>"]:
                        part.append(word)
    return out


EXAMPLES = examples()


def test_the_docs_have_examples_to_check():
    assert len(EXAMPLES) > 60 and {name for name, _ in EXAMPLES} >= {"README.md", "commands.md", "kv-policies.md"}


@pytest.mark.parametrize("where,args", EXAMPLES, ids=[f"{n}:{' '.join(a)[:60]}" for n, a in EXAMPLES])
def test_a_documented_example_parses(where, args):
    import typer

    from decodelab.cli.main import app

    root = typer.main.get_command(app)
    ctx = root.make_context("decodelab", list(args))
    command = root.get_command(ctx, args[0])
    assert command is not None, f"{where}: no command {args[0]!r}"
    if args[0] == "warm" and len(args) > 1:  # a group: its subcommand parses
        sub = command.make_context("warm", list(args[1:]), parent=ctx)
        command = command.get_command(sub, args[1])
        assert command is not None, f"{where}: no command warm {args[1]!r}"
        command.make_context(args[1], list(args[2:]), parent=sub)
        return
    command.make_context(args[0], list(args[1:]), parent=ctx)


@pytest.mark.parametrize("args", [["sample", "a", "--top-pp", "0.9"], ["samples", "a"], ["sample", "a", "-n"],
                                  ["warm", "begin"]])
def test_the_check_fails_on_a_drifted_example(args):
    """Negative control: an option, a command or a value that no longer exists is caught."""
    with pytest.raises(Exception):
        test_a_documented_example_parses("x.md", args)
