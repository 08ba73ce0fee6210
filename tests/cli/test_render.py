"""The renderers (cli/render.py) on inputs whose output can be written down by hand: JSON cleaning, escaping,
probability bars and formats, colours, tables, rows, saved files. No model."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
from dataclasses import dataclass

import pytest
from rich.console import Console
from rich.table import Table

from decodelab.cli.view import render
from decodelab.cli.view.steps_view import StepsTable
from decodelab.core.trace.records import Alternative, SampleSummary, Step

from test_fit import printed, wide_table


def captured(fn, *args, **kwargs) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kwargs)
    return buf.getvalue()


@dataclass
class Pair:
    a: float
    b: tuple


def test_clean_makes_json_safe_values():
    assert render.clean(float("nan")) is None
    assert render.clean(float("inf")) is None and render.clean(float("-inf")) is None
    assert render.clean(0.25) == 0.25 and render.clean(3) == 3 and render.clean("x") == "x"
    assert render.clean({1: (float("nan"), 2.0)}) == {"1": [None, 2.0]}
    assert render.clean(Pair(float("inf"), (1, "é"))) == {"a": None, "b": [1, "é"]}
    assert render.clean(Pair) is Pair  # a class is not an instance: left alone


def test_dumps_and_printers():
    assert render.dumps({"t": "é\n", "x": float("nan")}) == '{"t": "é\\n", "x": null}'
    line = captured(render.print_jsonl, {"a": [1, float("inf")]})
    assert line == '{"a": [1, null]}\n'
    out = captured(render.print_json, {"a": 1, "b": "ü"})
    assert out == '{\n  "a": 1,\n  "b": "ü"\n}\n'


def test_one_line_and_show_token():
    assert render.one_line("a\\b\nc\td\re") == "a\\\\b\\nc\\td\\re"
    assert render.show_token("hi") == "hi"
    assert render.show_token(" hi") == "␣hi"
    assert render.show_token("hi ") == "hi␣"
    assert render.show_token("a b") == "a b"  # inner spaces stay: the token does not start or end with one
    assert render.show_token("  ") == "␣␣"
    assert render.show_token("\n") == "\\n"
    assert render.show_token("") == ""


@pytest.mark.parametrize("p, expected", [
    (0.0, " " * 10), (-1.0, " " * 10), (1.0, "█" * 10), (2.0, "█" * 10), (0.5, "█████     "),
    (0.55, "█████▌    "), (0.0125, "▏         "), (0.08, "▊         "), (0.099, "▉         "), (0.01, " " * 10), (0.9875, "█████████▉"), (0.3375, "███▍      "),
])
def test_bar_in_eighths(p, expected):
    # cells = 10 p; full blocks, then one of 7 partial blocks for the eighths left (none below 1/8)
    assert render.bar(p) == expected and len(render.bar(p)) == 10


def test_bar_width():
    assert render.bar(1.0, width=4) == "████" and render.bar(0.5, width=4) == "██  "


@pytest.mark.parametrize("p, text", [(0.5, "0.500"), (1.0, "1.000"), (0.001, "0.001"), (0.0, "0.000"),
                                     (0.00099, "9.9e-04"), (1.234e-7, "1.2e-07")])
def test_fmt_p(p, text):
    assert render.fmt_p(p) == text


@pytest.mark.parametrize("p, shade", [(1.0, 0), (7.0, 0), (0.5, 0), (0.4999, 1), (0.1, 1), (0.0999, 2), (0.01, 2),
                                      (0.00999, 3), (0.0, 3), (-3.0, 3), (float("nan"), 3)])
def test_prob_style_classes_and_their_boundaries(p, shade):
    # p >= 0.5 green, >= 0.1 yellow, >= 0.01 red, below magenta; each lower bound belongs to its own class
    assert render.prob_style(p) == render.SHADES[shade][1]


def test_shades_hold_with_16_colours_and_without_colour():
    from rich.color import ColorType
    from rich.style import Style

    styles = [Style.parse(style) for _, style, _ in render.SHADES]
    for style in styles:  # standard colours: a 16-colour terminal shows them as they are, not a nearest match
        assert style.bgcolor.type == ColorType.STANDARD and style.color.type == ColorType.STANDARD
    plain = [style.without_color for style in styles] + [Style.parse(render.PROMPT_STYLE).without_color]
    assert len(set(plain)) == len(plain)  # NO_COLOR: every class and the prompt still look different
    bounds = [low for low, _, _ in render.SHADES]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] == 0.0


def test_shaded_text_marks_the_prompt_apart_and_shades_each_token():
    text = render.shaded_text("Once", [(" upon", 1.0), (" a", 0.0)])
    assert text.plain == "Once" + render.PROMPT_MARK + " upon a"  # the mark shows in a pipe, with no style at all
    spans = [(s.start, s.end, str(s.style)) for s in text.spans]
    assert spans == [(0, 4, render.PROMPT_STYLE), (4, 5, "dim"), (5, 10, render.prob_style(1.0)),
                     (10, 12, render.prob_style(0.0))]
    assert str(text.style) == ""  # the prompt's style is a span: it does not spill onto the tokens


def test_shading_in_16_colours_and_no_color_escape_codes():
    tokens = [(" a", 0.9), (" b", 0.2), (" c", 0.05), (" d", 0.001)]
    for kind, codes in (("standard", ["42", "43", "41", "45"]), ("none", ["", "3", "4", "1;4"])):
        console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", no_color=kind == "none",
                          width=80)  # NO_COLOR in the environment is no_color=True
        console.print(render.shaded_text("P", tokens), end="")
        out = console.file.getvalue()
        for (token, _), code in zip(tokens, codes):
            if code:  # background colour, or italic / underline / bold+underline without colour
                assert any(code in seq.split(";") or seq.endswith(code)
                           for seq in re.findall(r"\x1b\[([0-9;]*)m" + re.escape(token), out)), (kind, token, out)
            else:
                assert re.search(r"(^|m)" + re.escape(token), out), (kind, token, out)


def test_shading_legend_names_every_class():
    legend = render.shading_legend("processed p").plain
    assert "prompt " + render.PROMPT_MARK + " output" in legend and "processed p" in legend
    for low, _, name in render.SHADES:
        assert name in legend
    assert "green p >= 0.5" in legend and "magenta+bold+underline p < 0.01" in legend


def make_step(i: int, token: str, prob: float, alts=()) -> Step:
    return Step(index=i, position=5 + i, token_id=10 + i, token=token, prob=prob, logprob=math.log(prob),
                raw_prob=prob / 2, raw_logprob=math.log(prob / 2), raw_rank=i + 1, entropy=0.5 + i,
                raw_entropy=1.5, kept=3 + i, alternatives=list(alts))


def rendered(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_step_rows_and_markdown():
    steps = [make_step(0, " hi", 0.5, [Alternative(1, "x", 0.25, 0.125), Alternative(2, " y", 0.123456, 0.1)])]
    rows = render.step_rows(steps)
    # real text and every digit (these were the lossy "x:0.2500 ␣y:0.1235" and "␣hi" that issue 24 reported)
    assert json.loads(rows[0]["alternatives"]) == [{"token_id": 1, "token": "x", "prob": 0.25, "raw_prob": 0.125},
                                                   {"token_id": 2, "token": " y", "prob": 0.123456, "raw_prob": 0.1}]
    assert rows[0]["token"] == " hi" and rows[0]["prob"] == 0.5 and rows[0]["raw_rank"] == 1
    md = captured(render.print_rows, rows, "markdown").splitlines()
    assert md[0].replace(" ", "").startswith("|index|position|token_id|token|prob|")
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert len(md) == 3 and cells[4:8] == ["0.5", "-0.693147", "0.25", "-1.38629"]  # floatfmt .6g
    assert captured(render.print_rows, [], "csv") == ""
    tiny = captured(render.print_rows, [{"p": 1.5e-07, "q": 0.123456789}], "markdown").splitlines()[2]
    assert [c.strip() for c in tiny.strip("|").split("|")] == ["1.5e-07", "0.123457"]
    out = captured(render.print_rows, rows, "csv")
    assert "\r" not in out and out.count("\n") == 2  # header and one row, Unix line ends


def test_markdown_and_csv_keep_a_tokens_text_whole():
    """A token with a pipe, a newline, a quote, leading spaces or digits: csv reads back exactly (the csv module
    quotes), markdown escapes it onto one line with the pipe escaped and keeps "007" as text."""
    rows = [{"token": ' a|b\n"c', "id": 1}, {"token": "007", "id": 2}]
    back = list(csv.DictReader(io.StringIO(captured(render.print_rows, rows, "csv"))))
    assert [r["token"] for r in back] == [' a|b\n"c', "007"]
    md = captured(render.print_rows, rows, "markdown").splitlines()
    assert len(md) == 4 and "a\\|b\\n\"c" in md[2] and "| 007 " in md[3]


def test_summary_line():
    s = SampleSummary(new_tokens=3, mean_logprob=-1.23456, raw_perplexity=float("nan"), tokens_per_s=12.3456,
                      stop_reason="eos")
    line = render.summary_line(s).plain
    assert line.startswith("summary: new_tokens=3  mean_logprob=-1.235  tokens_per_s=12.35  stop_reason=eos")
    assert str(render.summary_line(s).style) == "cyan"


def test_document_top_level():
    class LM:
        name, device, dtype = "toy", "cpu", "torch.float32"

    doc = render.document("sample", LM, {"t": 1}, ["temperature"], "Hi", [1, 2], extra=5)
    assert doc == {"command": "sample", "model": "toy", "device": "cpu", "dtype": "float32", "config": {"t": 1},
                   "chain": ["temperature"], "prompt": {"text": "Hi", "token_ids": [1, 2]}, "extra": 5}


def test_show_saves_html_and_svg(tmp_path, capsys):
    html, svg = tmp_path / "a.html", tmp_path / "a.svg"
    render.show([StepsTable([make_step(0, "tok", 0.5)], top=0, vocab_size=50, max_steps=1)], html, svg,
                to_screen=False)
    assert capsys.readouterr().out == ""
    assert "<html" in html.read_text().lower() and "tok" in html.read_text()
    assert svg.read_text().lstrip().startswith("<svg") and "decodelab" in svg.read_text()
    render.show([render.summary_line(SampleSummary(1, 0.0, 1.0, 1.0, "length"))])
    assert "summary: new_tokens=1" in capsys.readouterr().out


def test_show_saves_either_file_alone_at_160_columns(tmp_path):
    """Each of --save-html / --save-svg works without the other; the recording is 160 columns wide (a 170-character
    line wraps after 160) and plain (no automatic highlighting of numbers); the SVG is titled decodelab."""
    from rich.text import Text

    html = tmp_path / "only.html"
    render.show([Text("value 12345"), Text("x" * 170)], save_html=html, to_screen=False)
    page = html.read_text()
    assert "value 12345" in page and "x" * 160 in page and "x" * 161 not in page
    svg = tmp_path / "only.svg"
    render.show([Text("abc")], save_svg=svg, to_screen=False)
    assert "abc" in svg.read_text() and ">decodelab<" in svg.read_text()
    both_html, both_svg = tmp_path / "b.html", tmp_path / "b.svg"
    render.show([Text("shared")], both_html, both_svg, to_screen=False)
    assert "shared" in both_html.read_text() and "shared" in both_svg.read_text()  # the HTML did not clear it


# --- CSV: column names and exact values ---------------------------------------------------------------------------


CSV_COLUMNS = ["index", "position", "token_id", "token", "prob", "logprob", "raw_prob", "raw_logprob", "raw_rank",
               "entropy", "raw_entropy", "kept", "alternatives", "decided_by", "why"]  # the last two added by #11


def test_csv_rows_keep_the_contract_names_and_every_digit():
    """Bug: a column renamed, or values rounded. The header is the contract's field names in order, and every
    float reads back bit for bit (Python's shortest repr round-trips)."""
    from decodelab.cli.view.render import print_rows, step_rows

    step = Step(index=0, position=7, token_id=42, token=" hi", prob=0.123456789012, logprob=math.log(0.123456789012),
                raw_prob=0.0987654321, raw_logprob=math.log(0.0987654321), raw_rank=3, entropy=1.23456789,
                raw_entropy=2.3456789, kept=17,
                alternatives=[Alternative(5, "a", 0.56789, 0.4), Alternative(6, "\n", 0.00001, 0.2)])
    rows = step_rows([step])
    assert list(rows[0]) == CSV_COLUMNS
    buf = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(buf):
        print_rows(rows, "csv")
    lines = buf.getvalue().splitlines()
    assert lines[0] == ",".join(CSV_COLUMNS)
    got = next(csv.DictReader(io.StringIO(buf.getvalue())))
    for key in ("prob", "logprob", "raw_prob", "raw_logprob", "entropy", "raw_entropy"):
        assert float(got[key]) == getattr(step, key), key
    assert [got[k] for k in ("index", "position", "token_id", "raw_rank", "kept")] == ["0", "7", "42", "3", "17"]
    assert got["token"] == " hi"  # the token's real text: csv quotes what needs quoting, nothing is replaced
    alternatives = json.loads(got["alternatives"])  # one JSON cell, every digit kept (was "a:0.5679 \\n:0.0000")
    assert alternatives == [{"token_id": 5, "token": "a", "prob": 0.56789, "raw_prob": 0.4},
                            {"token_id": 6, "token": "\n", "prob": 0.00001, "raw_prob": 0.2}]


# --- the arithmetic the mutation run (tests/mutation/run.sh) found nothing checking; every expected width is
# worked out by hand in the docstring or comment beside it ---------------------------------------------------------


def test_exp_of_a_logprob():
    assert render.exp(math.log(0.25)) == pytest.approx(0.25) and render.exp(float("-inf")) == 0.0
    assert render.exp(0.0) == 1.0


SAMPLES_64 = """\
                        tiny · 2 samples
┏━━━┳━━━━━━┳━━━━━━━━━━━━━┳━━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━┓
┃ # ┃ seed ┃ text        ┃ len ┃ stop   ┃ sum logp ┃ mean logp ┃
┡━━━╇━━━━━━╇━━━━━━━━━━━━━╇━━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━┩
│ 0 │    7 │ short\\ntext │   2 │ length │   -1.235 │    -0.617 │
│ 1 │    8 │ a much      │  12 │ eos    │  -10.500 │    -0.875 │
│   │      │ longer text │     │        │          │           │
│   │      │ that wraps  │     │        │          │           │
└───┴──────┴─────────────┴─────┴────────┴──────────┴───────────┘
logp: processed log-probability (the distribution each token was
                          drawn from)
              first token
┏━━━━━━━┳━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━━━┓
┃ token ┃ id ┃ count ┃           share ┃
┡━━━━━━━╇━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━┩
│ ␣a    │  1 │     2 │ █████      0.50 │
│ b     │  3 │     1 │ ██▌        0.25 │
└───────┴────┴───────┴─────────────────┘
summary: num_samples=2  distinct_outputs=2
mean_sum_logprob=-5.867  std_sum_logprob=4.633
mean_logprob=-0.746  std_mean_logprob=0.129  batched=False
tokens_per_s=12.5
"""


def test_samples_views_at_64_columns():
    """`sample -N`'s three views, exactly: numbers right-aligned with 3 decimals, names and the stop reason
    left-aligned, only the text column wraps (at word boundaries, newlines escaped), the first-token shares as a bar
    of 10 cells (0.5 -> 5 cells, 0.25 -> 2.5) and two decimals, the summary without first_tokens."""
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(0, 7, [1, 2], "short\ntext", 2, "length", -1.23456, -0.61728),
            SampleRow(1, 8, [3], "a much longer text that wraps", 12, "eos", -10.5, -0.875)]
    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5), FirstToken(3, "b", 1, 0.25)],
                           tokens_per_s=12.5)
    out = printed(render.samples_views(rows, spread, "tiny · 2 samples"), 64)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SAMPLES_64


def test_the_shading_legend_is_dim():
    assert render.shading_legend("raw p").style == "dim"


def test_fitted_splits_only_tables():
    from decodelab.cli.view.render import fitted

    console = Console(width=30, file=io.StringIO())
    parts = fitted([wide_table(), "text"], 30, console)
    assert len(parts) == 4 and parts[2:] == ["C", "text"]
    assert [c.header for c in parts[1].columns] == ["key", "c"]


def test_consoles_print_numbers_plain_and_status_goes_to_stderr(capsys, monkeypatch):
    """No highlighting: rich would colour "0.500" and "[1, 2]" in a terminal. Status lines go to stderr."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    render.console().print("p 0.500 [1, 2]")
    render.error_console().print("q 0.25")
    out, err = capsys.readouterr()
    assert (out, err) == ("p 0.500 [1, 2]\n", "q 0.25\n")


def test_save_records_plain_numbers_splits_wide_tables_and_reports_a_write_error_in_one_line(tmp_path):
    """The recording at 160 columns: numbers not highlighted, a table of two 100-character columns split into two
    panels (the key column in each), HTML and SVG both whole. A path that is a folder: one line, the OS's reason."""
    wide = Table()
    wide.add_column("key", no_wrap=True)
    wide.add_column("a" * 100, no_wrap=True)
    wide.add_column("b" * 100, no_wrap=True)
    wide.add_row("k", "x", "y")
    html, svg = tmp_path / "t.html", tmp_path / "t.svg"
    render.save(["p 0.500 [1, 2]", wide], html, svg)
    page = html.read_text()
    assert "p 0.500 [1, 2]" in page and page.count("key") == 2
    assert "a" * 100 in page and "b" * 100 in page
    drawing = svg.read_text()
    assert drawing.count("key") == 2 and "0.500" in drawing
    with pytest.raises(render.ConfigError) as err:
        render.save(["x"], tmp_path, None)
    assert str(err.value) == "--save-html/--save-svg: cannot write the file (Is a directory)"


def test_show_token_marks_spaces_only_at_the_edges_or_when_there_is_nothing_else():
    assert [render.show_token(t) for t in (" ", "  ", "a b", " a", "a ", "", "\n")] == [
        "␣", "␣␣", "a b", "␣a", "a␣", "", "\\n"]


SAMPLES_40 = """\
            tiny · 2 samples
┏━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━┳━━━━━┓
┃  # ┃ seed ┃ text               ┃ len ┃
┡━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━┩
│  9 │    7 │ short\\ntext        │   2 │
│ 10 │    8 │ a much longer text │  12 │
│    │      │ that wraps         │     │
└────┴──────┴────────────────────┴─────┘
┏━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━┓
┃  # ┃ stop   ┃ sum logp ┃ mean logp ┃
┡━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━┩
│  9 │ length │   -1.235 │    -0.617 │
│ 10 │ eos    │  -10.500 │    -0.875 │
└────┴────────┴──────────┴───────────┘
logp: processed log-probability (the
distribution each token was drawn from)
"""


def test_samples_views_split_at_40_columns_with_bold_headers():
    """Through fitted() as show() prints it: 40 columns split the samples into two panels, each led by `#`
    (right-aligned: 9 under 10), the text wrapping in the room left (40 - 13 chrome - 2 - 4 - 3 = 18 at least);
    both tables' headers bold."""
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(9, 7, [1, 2], "short\ntext", 2, "length", -1.23456, -0.61728),
            SampleRow(10, 8, [3], "a much longer text that wraps", 12, "eos", -10.5, -0.875)]
    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5)], tokens_per_s=12.5)
    samples, firsts, summary = render.samples_views(rows, spread, "tiny · 2 samples")
    console = Console(width=40, file=io.StringIO(), color_system=None)
    out = printed(render.fitted([samples], 40, console), 40)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SAMPLES_40
    assert (samples.header_style, firsts.header_style) == ("bold", "bold")
    assert "first_tokens" not in summary.plain and "tokens_per_s=12.5" in summary.plain


FIRSTS_30 = """\
     first token
┏━━━━━━━┳━━━━┳━━━━━━━┓
┃ token ┃ id ┃ count ┃
┡━━━━━━━╇━━━━╇━━━━━━━┩
│ ␣a    │  1 │     2 │
│ b     │  3 │     1 │
└───────┴────┴───────┘
┏━━━━━━━┳━━━━━━━━━━━━━━━━━┓
┃ token ┃           share ┃
┡━━━━━━━╇━━━━━━━━━━━━━━━━━┩
│ ␣a    │ █████      0.50 │
│ b     │ ██▌        0.25 │
└───────┴─────────────────┘
"""


def test_first_token_shares_keep_bar_and_number_on_one_line_at_30_columns():
    """Every column of the first-token table is no-wrap, so at 30 columns the share (a 10-cell bar, a space and the
    share: 15 cells) moves to a panel of its own instead of wrapping the bar under the number."""
    from decodelab.core.methods.many import FirstToken, SpreadSummary

    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5), FirstToken(3, "b", 1, 0.25)])
    _, firsts, _ = render.samples_views([], spread, "t")
    out = printed(render.fitted([firsts], 30, Console(width=30, file=io.StringIO())), 30)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == FIRSTS_30


def test_samples_views_keep_number_headers_whole_in_a_narrow_panel():
    """At 34 columns the samples table splits into panels; its number columns do not wrap, headers included, so
    `sum logp` and `mean logp` stay whole on one line (a wrapping column would fold them onto two)."""
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(0, 7, [1, 2], "short text", 2, "length", -1.23456, -0.61728)]
    spread = SpreadSummary(1, 1, -1.23, 0.0, -0.61, 0.0, [FirstToken(1, " a", 1, 1.0)], tokens_per_s=12.5)
    samples = render.samples_views(rows, spread, "t")[0]
    console = Console(width=34, file=io.StringIO(), color_system=None)
    out = printed(render.fitted([samples], 34, console), 34)
    assert "sum logp" in out and "mean logp" in out and "…" not in out


def test_markdown_keeps_a_tokens_leading_and_trailing_spaces():
    """Issue 40: tabulate strips every cell unless told, so `-f markdown` printed " upon" as "upon". Each cell is
    written as "| " + its text, padded: the text after the separator's space is the token, spaces and all."""
    rows = [{"token": " upon", "n": 1}, {"token": "a  ", "n": 2}, {"token": "x", "n": 3}]
    md = captured(render.print_rows, rows, "markdown").splitlines()
    width = len(md[1].split("|")[1]) - 2  # the column's text width between "| " and " |"
    cells = [line.split("|")[1][1:1 + width] for line in md[2:]]
    assert cells == [" upon".ljust(width), "a  ".ljust(width), "x".ljust(width)]
    assert md[2].startswith("|  upon ")
