"""The trace page: one self-contained HTML file drawn from a command's JSON document (or an OpenAI completions
response), for `decodelab view` and `--save-html`.

The page is the document itself, embedded as JSON, plus the CSS and JavaScript in ``assets/`` that draw it in the
browser: no server, no network (a Content-Security-Policy allows nothing outside the file), and every number shown
is read from that JSON, so the page cannot disagree with ``-f json``. Python adds only what the document does not
say itself: which view draws it, the shading classes (the terminal's, render.SHADES) and the `decodelab sample`
command that reruns the run (branch.py), to which the page appends ``--force STEP=TOKEN``."""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path

from ...core.errors import ConfigError
from ...core.trace.format import DECODELAB, OPENAI, trace_kind
from ...core.trace.openai import check_openai
from .branch import sample_command
from .render import SHADES, clean
from .steps_view import is_one_hot

# command -> the page's view of it (page.js VIEWS); the commands listed are the ones `decodelab view` accepts
VIEWS = {
    "sample": "tokens", "score": "tokens", "stream": "stream", "beam": "beam", "speculate": "speculate",
    "compare": "compare", "batch": "batch", "probs": "probs",
    "quantize-kv": "generic", "bench": "generic", "models": "generic", "check-logprobs": "generic",
    "check-sampler": "generic", "audit-numerics": "generic",
}
BRANCHING = ("sample", "score", "stream")  # views with a `sample --force` command (stream: when generating)
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def asset(name: str) -> str:
    return (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")


def finite(value):
    """JSON without NaN or infinity (an OpenAI response may hold -Infinity; the browser's JSON.parse refuses it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def script_json(value) -> str:
    """JSON safe inside <script>: '<', '>' and '&' as \\u escapes, so no text of the trace can end the element."""
    text = json.dumps(finite(value), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page_meta(doc: dict, source: str = "the document") -> dict:
    """What the page needs besides the document: its kind, its view, the shades, the branch command."""
    kind = trace_kind(doc, source, VIEWS)
    if kind == OPENAI:
        check_openai(doc, source)
        return {"kind": OPENAI, "view": "openai", "shades": shades(), "branch": None}
    command = doc["command"]
    branch = None
    if command in BRANCHING and (command != "stream" or doc.get("mode") == "generate") and not doc.get("samples"):
        branch = sample_command(doc)
    return {"kind": DECODELAB, "view": VIEWS[command], "shades": shades(), "branch": branch,
            "one_hot": one_hot_steps(doc)}


def one_hot_steps(doc: dict) -> list[int]:
    """The steps (their ``index``) whose processed distribution is one-hot, decided as the terminal decides it
    (steps_view.one_hot: greedy, top-k 1): there the page shows the raw distribution, labelled raw."""
    steps = doc.get("steps") if isinstance(doc.get("steps"), list) else []
    return [s["index"] for s in steps if isinstance(s, dict) and "prob" in s and "index" in s
            and is_one_hot(s["prob"], [a.get("prob") for a in s.get("alternatives") or []])]


def shades() -> list[list]:
    """[lower bound of p, name in the legend], most likely first: the terminal's shading classes."""
    return [[low, name] for low, _, name in SHADES]


def title(doc: dict, kind: str) -> str:
    if kind == OPENAI:
        return f"OpenAI logprobs · {doc.get('model', '')}".strip(" ·")
    return " · ".join(str(p) for p in ("decodelab", doc.get("command"), doc.get("model")) if p)


def page(doc: dict, source: str = "the document") -> str:
    """The whole page as one string. ``source`` names the input in error messages."""
    meta = page_meta(doc, source)
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
        f"<title>{html.escape(title(doc, meta['kind']))}</title>\n<style>\n{asset('page.css')}</style></head>\n"
        "<body><noscript><p>This page draws the trace with JavaScript; the trace itself is the JSON in the page "
        "source (script#trace).</p></noscript>\n"
        "<main><div class=\"layout\"><div id=\"content\"></div>"
        "<aside id=\"detail\" aria-live=\"polite\" aria-label=\"numbers of the item under the pointer or focus\">"
        "</aside></div></main>\n"
        f"<script type=\"application/json\" id=\"trace\">{script_json(doc)}</script>\n"
        f"<script type=\"application/json\" id=\"page\">{script_json(meta)}</script>\n"
        f"<script>\n{asset('page.js')}</script>\n</body></html>\n"
    )


def write_page(document: dict, path, option: str = "--save-html", source: str | None = None) -> Path:
    """Write the page of ``document`` (a command's JSON document as ``-f json`` prints it, dataclass records
    allowed, or an OpenAI completions response) to ``path``. A document the page cannot show and a path that cannot
    be written are one-line ConfigErrors naming ``source`` (default ``option``) and ``option``."""
    text = page(clean(document), source or option)
    path = Path(path)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write the file ({exc.strerror or exc})") from None
    return path
