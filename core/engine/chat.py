"""Chat templates, rendered with limits: a template is code from the model folder (Jinja, in transformers' sandbox),
so it runs in a child process that may use ``RENDER_SECONDS`` of wall time, ``RENDER_MEMORY`` bytes of memory beyond
what the parent had, and write at most ``output_limit(prompt)`` characters; whatever goes wrong (its own
``raise_exception``, a sandbox ``SecurityError``, a syntax error, too slow, too large) is one line naming the template's
file. The rendered text is then tokenized here exactly as ``apply_chat_template(tokenize=True)`` does: without
special tokens added.

Where ``os.fork`` is missing (Windows) or unsafe (macOS), the template renders in this process: the sandbox and the
output limit hold, the time and memory limits do not.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import warnings
from pathlib import Path

from ..errors import ConfigError

try:  # POSIX only; without it (Windows) templates render in this process
    import resource
except ImportError:
    resource = None

RENDER_SECONDS = 5.0  # real templates render in milliseconds
RENDER_MEMORY = 2**30  # bytes the rendering child may allocate beyond the parent's address space
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def output_limit(prompt: str) -> int:
    """Characters a template may write for ``prompt``: the prompt 4 times over (a template that repeats the
    conversation, or escapes it) plus 1 MiB of its own text."""
    return 4 * len(prompt) + 2**20


def template_name(model: str, folder: Path | None) -> str:
    """'the chat template of MODEL (FILE)': the file of the folder the template was read from."""
    found = [name for name in TEMPLATE_FILES if folder is not None and (folder / name).is_file()]
    return f"the chat template of {model!r}" + (f" ({folder / found[0]})" if found else "")


def chat_ids(tokenizer, text: str, model: str, folder: Path | None) -> list[int]:
    """The prompt ``text`` as one user turn through the tokenizer's chat template, with the assistant's header after
    it (``add_generation_prompt``); the ids are the rendered text's, no special tokens added."""
    name = template_name(model, folder)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--chat: the tokenizer of {model!r} has no chat template")
    messages = [{"role": "user", "content": text}]
    rendered = render(tokenizer, messages, name, output_limit(text))
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def render(tokenizer, messages: list[dict], name: str, limit: int) -> str:
    def job() -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    if resource is not None and hasattr(os, "fork") and sys.platform.startswith("linux"):
        status, payload = in_child(job, limit, RENDER_SECONDS)
    else:
        status, payload = in_process(job, limit)
    if status == "ok":
        return payload
    raise ConfigError(f"--chat: {name}: {payload}")


def describe_failure(exc: BaseException) -> str:
    """A template's error as the user should read it: what kind of failure, then Jinja's own message."""
    kind = type(exc).__name__
    text = " ".join(str(exc).split())[:300] or kind
    if kind == "SecurityError":
        return f"the sandbox refused what it tried ({text})"
    if kind in ("TemplateSyntaxError", "TemplateAssertionError"):
        return f"is not a valid template ({text})"
    if kind == "TemplateError":  # what the template's own raise_exception(...) raises
        return f"raised an error: {text}"
    if isinstance(exc, MemoryError):
        return f"needed more than {RENDER_MEMORY // 2**20} MiB of memory to render"
    if isinstance(exc, RecursionError):
        return "recursed too deeply to render"
    return f"failed to render ({kind}: {text})"


def in_process(job, limit: int) -> tuple[str, str]:
    try:
        text = job()
    except Exception as exc:  # a template may raise anything its sandbox lets it reach
        return "error", describe_failure(exc)
    if not isinstance(text, str):
        return "error", f"rendered a {type(text).__name__}, not text"
    if len(text) > limit:
        return "error", f"renders more than {limit} characters (the most allowed for this prompt)"
    return "ok", text


def in_child(job, limit: int, seconds: float) -> tuple[str, str]:
    """Run ``job`` in a forked child under the limits; (status, text or reason). The child writes b"ok\\0" + text or
    b"error\\0" + reason to a pipe and leaves with os._exit (no buffer of the parent is flushed twice)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns that forking a threaded process is unsafe for the child's
        warnings.simplefilter("ignore", DeprecationWarning)  # threads: the child runs no thread, only the template
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        child(job, limit, write_end)
    os.close(write_end)
    reaped = False
    try:
        data, verdict = collect(read_end, limit, seconds)
        if verdict is not None:  # too slow or too large: the child is still at it
            os.kill(pid, signal.SIGKILL)
        code = os.waitpid(pid, 0)[1]
        reaped = True
    finally:
        os.close(read_end)
        if not reaped:  # a Ctrl-C (or any error) in the parent while the child renders: leave no child behind
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return verdict if verdict is not None else answer(data, code)


def child(job, limit: int, fd: int) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        cap = address_space() + RENDER_MEMORY
        if hard == resource.RLIM_INFINITY or cap < hard:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        status, text = in_process(job, limit)
        view = memoryview(status.encode() + b"\0" + text.encode("utf-8", "surrogatepass"))
        while view:
            view = view[os.write(fd, view):]
    except BaseException:  # noqa: BLE001 (nothing may escape the child into the parent's code)
        pass
    os._exit(0)


def address_space() -> int:
    """Bytes of virtual memory this process maps now (Linux: /proc/self/statm, in pages)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def collect(fd: int, limit: int, seconds: float) -> tuple[bytes, tuple[str, str] | None]:
    """Read the child's answer until it closes the pipe: (bytes, None), or (what came, why the child must be
    killed) once ``seconds`` pass or more than ``4 * limit + 16`` bytes come (a character is at most 4 bytes)."""
    deadline = time.monotonic() + seconds
    parts, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"", ("error", f"took more than {seconds:g} s to render; a chat template renders in milliseconds")
        chunk = os.read(fd, 2**20)
        if not chunk:
            return b"".join(parts), None
        parts.append(chunk)
        size += len(chunk)
        if size > 4 * limit + 16:
            return b"", ("error", f"renders more than {limit} characters (the most allowed for this prompt)")


def answer(data: bytes, code: int) -> tuple[str, str]:
    """The child's (status, text), or why there is none: it died (its memory limit, a signal) before answering."""
    status, _, text = data.partition(b"\0")
    if status in (b"ok", b"error"):
        return status.decode(), text.decode("utf-8", "surrogatepass")
    how = f"was killed by signal {os.WTERMSIG(code)}" if os.WIFSIGNALED(code) else "ended"
    return "error", f"the process rendering it {how} without an answer (more than {RENDER_MEMORY // 2**20} MiB?)"
