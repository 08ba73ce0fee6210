"""Chat templates (core/engine/chat.py): the ids are exactly transformers' apply_chat_template's, and a template that
raises, escapes its sandbox, renders too much, runs too long or eats memory is one line naming its file, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from decodelab.core.engine import chat
from decodelab.core.errors import ConfigError

SIMPLE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITH_TOKENS = ("{{ bos_token }}{% for m in messages %}{{ m.role | upper }}: {{ m.content | trim }}{{ eos_token }}"
               "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
NAMESPACE = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}[{{ ns.n }}] "
             "{{ m.content | tojson }}{% endfor %}{{ '\n' if add_generation_prompt }}")


def one_line_error(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.fixture
def with_template(tmp_path, toy_model_dir):
    """A copy of the toy model whose chat template (chat_template.jinja) is the given text; returns the folder."""
    def make(template: str):
        folder = tmp_path / "chat"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(toy_model_dir, folder)
        (folder / "chat_template.jinja").write_text(template)
        return folder

    return make


@pytest.mark.parametrize("template", [SIMPLE, WITH_TOKENS, NAMESPACE])
@pytest.mark.parametrize("prompt", ["Hello there", "  tabs\tand \"quotes\" é  "])
def test_ids_equal_apply_chat_template(with_template, template, prompt):
    """The oracle: rendered in a child process and tokenized here, the ids are transformers' own."""
    from transformers import AutoTokenizer

    folder = with_template(template)
    tok = AutoTokenizer.from_pretrained(folder)
    expected = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat.chat_ids(tok, prompt, "toy", folder) == list(expected)


def test_chat_through_the_cli(cli, with_template):
    folder = with_template(SIMPLE)
    code, out, err = cli("sample", "Hi", "-m", folder, "--chat", "-n", "2", "-f", "json")
    assert code == 0, err
    assert json.loads(out)["prompt"]["text"] == "Hi"


@pytest.mark.parametrize("template, needle", [
    ("{{ raise_exception('only user and assistant roles') }}", "raised an error: only user and assistant roles"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the sandbox refused what it tried"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "the sandbox refused what it tried"),
    ("{% for %}", "is not a valid template"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than 1048588 characters"),
    ("{{ 'x' * 10**10 }}", "MiB of memory to render"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
])
def test_a_hostile_template_is_one_line_naming_its_file(cli, with_template, template, needle):
    folder = with_template(template)
    err = one_line_error(cli, "sample", "Hi!", "-m", folder, "--chat", "-n", "2")
    assert f"--chat: the chat template of '{folder}' ({folder / 'chat_template.jinja'}): " in err and needle in err


def test_a_template_that_runs_forever_is_stopped(cli, with_template, monkeypatch):
    """10**15 iterations of nothing: killed at the time limit (shortened here), its child process reaped."""
    import os

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    folder = with_template("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                           "{% endfor %}{% endfor %}{% endfor %}")
    err = one_line_error(cli, "sample", "Hi", "-m", folder, "--chat", "-n", "2")
    assert "took more than 0.5 s to render" in err
    with pytest.raises(ChildProcessError):  # no child left, not even a zombie
        os.waitpid(-1, os.WNOHANG)


def test_without_fork_the_sandbox_and_the_size_limit_still_hold(with_template, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(chat, "resource", None)  # as on Windows
    for template, needle in (("{{ raise_exception('no') }}", "raised an error: no"),
                             ("{{ 'x' * 2000000 }}", "renders more than")):
        folder = with_template(template)
        with pytest.raises(ConfigError, match=needle):
            chat.chat_ids(AutoTokenizer.from_pretrained(folder), "Hi", "toy", folder)


def test_no_template(cli, toy_model_dir):
    assert "has no chat template" in one_line_error(cli, "sample", "Hi", "-m", toy_model_dir, "--chat")


def test_a_chat_trace_says_so_and_its_branch_command_wraps_the_prompt_again(cli, with_template):
    """`--chat` is recorded (`prompt.chat`), and the page's rerun command carries it: without it the rerun would
    decode the bare prompt, other ids, and branch from a different run."""
    from decodelab.cli.view.branch import sample_command

    folder = with_template(SIMPLE)
    code, out, err = cli("sample", "Hi", "-m", folder, "--chat", "-n", "3", "-t", "0.7", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["prompt"]["chat"] is True
    argv = sample_command(doc)["argv"]
    assert "--chat" in argv
    code, out, err = cli(*argv[1:], "-f", "json")
    assert code == 0, err
    rerun = json.loads(out)
    assert rerun["prompt"] == doc["prompt"] and rerun["token_ids"] == doc["token_ids"]
    code, out, err = cli("sample", "Hi", "-m", folder, "-n", "1", "-f", "json")
    assert "chat" not in json.loads(out)["prompt"]


@pytest.mark.parametrize("extra", [[], ["--predict-only"]])
def test_a_speculate_trace_says_chat_as_every_command_does(cli, with_template, extra):
    """speculate printed through the one output path without the chat mark; its JSON now says `prompt.chat` too
    (--predict-only's document as well), and says nothing without --chat."""
    folder = with_template(SIMPLE)
    args = ["speculate", "Hi", "-m", folder, "-n", "3", "-t", "0", "--draft", folder if extra else "ngram",
            "--speedup-rounds", "1", *extra, "--threads", "1", "-f", "json"]
    code, out, err = cli(*args, "--chat")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["prompt"]["chat"] is True
    code, out, err = cli(*args)
    assert code == 0, err
    assert "chat" not in json.loads(out)["prompt"]


# --- mutation run of core/engine/chat.py (2026-12-01): the failure lines and the in-process path, called here in
# this process (the CLI tests above render in a forked child, whose calls the mutation run cannot see) -----------


def test_each_kind_of_template_failure_reads_as_its_own_line():
    import jinja2.exceptions as jinja

    assert chat.describe_failure(jinja.SecurityError("access to attribute 'mro'  is unsafe")) == \
        "the sandbox refused what it tried (access to attribute 'mro' is unsafe)"  # whitespace runs collapsed
    assert chat.describe_failure(jinja.TemplateSyntaxError("unexpected '}'", 3)) == \
        "is not a valid template (unexpected '}' line 3)"
    assert chat.describe_failure(jinja.TemplateAssertionError("no filter named 'x'", 1)) == \
        "is not a valid template (no filter named 'x' line 1)"
    assert chat.describe_failure(jinja.TemplateError("only user roles")) == "raised an error: only user roles"
    assert chat.describe_failure(MemoryError()) == "needed more than 1024 MiB of memory to render"
    assert chat.describe_failure(RecursionError("deep")) == "recursed too deeply to render"
    assert chat.describe_failure(ValueError()) == "failed to render (ValueError: ValueError)"  # no message: the kind
    long = chat.describe_failure(ValueError("x" * 400))
    assert long == f"failed to render (ValueError: {'x' * 300})", "the message cut at 300 characters"


def test_the_in_process_render_keeps_the_limit_exactly():
    assert chat.in_process(lambda: "a" * 10, 10) == ("ok", "a" * 10)
    assert chat.in_process(lambda: "a" * 11, 10) == \
        ("error", "renders more than 10 characters (the most allowed for this prompt)")
    assert chat.in_process(lambda: 5, 10) == ("error", "rendered a int, not text")

    def raises():
        raise KeyError("role")

    assert chat.in_process(raises, 10) == ("error", "failed to render (KeyError: 'role')")


def test_the_childs_answer_is_read_whole_and_a_silent_death_is_named():
    assert chat.answer(b"ok\0a\0b", 0) == ("ok", "a\0b"), "a NUL inside the text is the text's"
    assert chat.answer(b"error\0too slow", 0) == ("error", "too slow")
    lone = "caf\udce9"  # a lone surrogate (an undecodable byte of the prompt) crosses the pipe as it is
    assert chat.answer(b"ok\0" + lone.encode("utf-8", "surrogatepass"), 0) == ("ok", lone)
    killed = 9  # os.waitpid's status of a child killed by SIGKILL
    assert chat.answer(b"", killed) == \
        ("error", "the process rendering it was killed by signal 9 without an answer (more than 1024 MiB?)")
    assert chat.answer(b"", 0) == ("error", "the process rendering it ended without an answer (more than 1024 MiB?)")


def test_the_parent_reads_the_childs_pipe_to_the_byte_bound_and_the_deadline():
    """collect's bound for ``limit`` characters is 4 * limit + 16 bytes, counted over every chunk read; past the
    deadline with nothing more written, the child is declared too slow."""
    import os
    import threading
    import time

    limit, too_large = 4, ("error", "renders more than 4 characters (the most allowed for this prompt)")
    for chunks, verdict in [([20, 12], None), ([20, 13], too_large), ([33], too_large)]:  # 32 bytes: the bound
        read_end, write_end = os.pipe()

        def write(chunks=chunks, fd=write_end):
            for n in chunks:
                os.write(fd, b"a" * n)
                time.sleep(0.05)  # a second chunk is a second read (the verdicts hold however the reads fall)
            os.close(fd)

        writer = threading.Thread(target=write)
        writer.start()
        data, got = chat.collect(read_end, limit, 1.0)  # under 1 s left from the start
        writer.join()
        os.close(read_end)
        assert got == verdict, chunks
        assert data == (b"a" * sum(chunks) if verdict is None else b"")
    read_end, write_end = os.pipe()
    try:
        assert chat.collect(read_end, limit, 0.2) == \
            (b"", ("error", "took more than 0.2 s to render; a chat template renders in milliseconds"))
    finally:
        os.close(read_end)
        os.close(write_end)


# --- mutation run of core/engine/chat.py (2026-12-02, the rest): the template's name, chat_ids and render on
# stand-ins, and in_child's parent side called here (the child's own code stays out of sight) ---------------------


def test_the_template_is_named_by_the_first_file_that_holds_it(tmp_path):
    assert chat.template_name("m", None) == "the chat template of 'm'"
    assert chat.template_name("m", tmp_path) == "the chat template of 'm'"
    for name in ("tokenizer_config.json", "chat_template.json", "chat_template.jinja"):
        (tmp_path / name).write_text("{}")
        assert chat.template_name("m", tmp_path) == f"the chat template of 'm' ({tmp_path / name})"
    (tmp_path / "chat_template.jinja").unlink()
    assert chat.template_name("m", tmp_path) == f"the chat template of 'm' ({tmp_path / 'chat_template.json'})"
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer_config.json").mkdir()  # a folder of that name is not the file
    (tmp_path / "chat_template.json").unlink()
    assert chat.template_name("m", tmp_path) == "the chat template of 'm'"


class TemplateTokenizer:
    """A tokenizer stand-in: renders a user turn as [U]text[A], tokenizes a text as its characters' code points."""

    chat_template = "stand-in"

    def __init__(self):
        self.asked = []

    def apply_chat_template(self, messages, **kwargs):
        self.asked.append((messages, kwargs))
        return f"[U]{messages[0]['content']}[A]"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}


def test_chat_ids_render_one_user_turn_and_tokenize_it_without_special_tokens(monkeypatch):
    tok = TemplateTokenizer()
    assert chat.chat_ids(tok, "hi", "m", None) == [ord(c) for c in "[U]hi[A]"]  # rendered in a child
    monkeypatch.setattr(chat, "resource", None)  # rendered here, where the call can be seen
    assert chat.chat_ids(tok, "hi", "m", None) == [ord(c) for c in "[U]hi[A]"]
    assert tok.asked == [([{"role": "user", "content": "hi"}], {"add_generation_prompt": True, "tokenize": False})]
    handed = []
    monkeypatch.setattr(chat, "render", lambda tokenizer, messages, name, limit: handed.append((name, limit)) or "x")
    assert chat.chat_ids(tok, "hey", "m", None) == [ord("x")]
    assert handed == [("the chat template of 'm'", 4 * 3 + 2**20)]


def test_a_tokenizer_without_a_template_is_one_line():
    tok = TemplateTokenizer()
    for template in (None, ""):
        tok.chat_template = template
        with pytest.raises(ConfigError) as err:
            chat.chat_ids(tok, "hi", "m", None)
        assert str(err.value) == "--chat: the tokenizer of 'm' has no chat template"
    del TemplateTokenizer.chat_template  # no attribute at all
    try:
        with pytest.raises(ConfigError, match="has no chat template"):
            chat.chat_ids(TemplateTokenizer(), "hi", "m", None)
    finally:
        TemplateTokenizer.chat_template = "stand-in"


def test_render_forks_on_linux_only_and_names_the_template_in_a_failure(monkeypatch):
    where = []
    monkeypatch.setattr(chat, "in_child", lambda job, limit, seconds: where.append(("child", limit, seconds))
                        or ("ok", job()))
    monkeypatch.setattr(chat, "in_process", lambda job, limit: where.append(("process", limit)) or ("ok", job()))
    tok = TemplateTokenizer()
    messages = [{"role": "user", "content": "yo"}]
    assert chat.render(tok, messages, "T", 50) == "[U]yo[A]"
    assert where == [("child", 50, 5.0)]
    monkeypatch.setattr(chat.sys, "platform", "darwin")  # fork is unsafe there
    assert chat.render(tok, messages, "T", 50) == "[U]yo[A]" and where[-1] == ("process", 50)
    monkeypatch.setattr(chat.sys, "platform", "linux")
    monkeypatch.delattr(chat.os, "fork")
    assert chat.render(tok, messages, "T", 50) == "[U]yo[A]" and where[-1] == ("process", 50)
    monkeypatch.setattr(chat, "in_process", lambda job, limit: ("error", "raised an error: no"))
    with pytest.raises(ConfigError) as err:
        chat.render(tok, messages, "T", 50)
    assert str(err.value) == "--chat: T: raised an error: no"


def forks(monkeypatch) -> list:
    """The pids in_child forks, recorded."""
    import os

    pids, fork = [], os.fork

    def recording():
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recording)
    return pids


def reaped(pid) -> bool:
    import os

    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_in_child_answers_from_the_child_and_reaps_it(monkeypatch):
    pids = forks(monkeypatch)
    assert chat.in_child(lambda: "rendered é", 100, 5.0) == ("ok", "rendered é")
    assert chat.in_child(lambda: "x" * 11, 10, 5.0) == (
        "error", "renders more than 10 characters (the most allowed for this prompt)")

    def raises():
        raise KeyError("role")

    assert chat.in_child(raises, 10, 5.0) == ("error", "failed to render (KeyError: 'role')")
    assert len(pids) == 3 and all(reaped(pid) for pid in pids)


def test_in_child_kills_a_child_past_its_deadline(monkeypatch):
    import time

    pids = forks(monkeypatch)
    assert chat.in_child(lambda: time.sleep(10**6) or "late", 10, 0.3) == (
        "error", "took more than 0.3 s to render; a chat template renders in milliseconds")
    assert reaped(pids[0])


def test_an_error_in_the_parent_while_the_child_renders_leaves_no_child(monkeypatch):
    import time

    pids = forks(monkeypatch)

    def broken(fd, limit, seconds):
        raise RuntimeError("the parent failed")

    monkeypatch.setattr(chat, "collect", broken)
    with pytest.raises(RuntimeError, match="the parent failed"):
        chat.in_child(lambda: time.sleep(10**6) or "late", 10, 5.0)
    assert reaped(pids[0])


def test_a_child_killed_before_it_answers_is_named_by_its_signal():
    """mutation run of in_child (2026-12-02, second round): a render killed mid-way (here by itself; in life by its
    memory limit) writes nothing, and the parent reads the child's exit status for the reason."""
    import os
    import signal

    status, reason = chat.in_child(lambda: os.kill(os.getpid(), signal.SIGKILL) or "never", 10, 5.0)
    assert status == "error" and reason == (f"the process rendering it was killed by signal 9 without an answer "
                                            f"(more than {chat.RENDER_MEMORY // 2**20} MiB?)")
