"""What the user hands in (core/inputs.py): numbers, text files, bytes and documents, each refusal one line naming
the option, checked word for word.

mutation run of core/inputs.py (2026-12-02, second round: parse_int, parse_float, read_input_text, decode_text,
nesting_depth, check_text and bounds, which only CLI tests reached before).
"""

from __future__ import annotations

import re

import pytest

from decodelab.core.errors import ConfigError
from decodelab.core.inputs import (MAX_DIGITS, bounds, check_input_file, check_text, decode_text, nesting_depth,
                                   parse_float, parse_int, read_input_text)


def refused(message: str):
    return pytest.raises(ConfigError, match="^" + re.escape(message) + "$")


def test_bounds_read_as_an_interval_or_one_side():
    assert bounds(1, 5) == "in [1, 5]" and bounds(0, None) == ">= 0" and bounds(None, 9) == "<= 9"
    assert bounds(None, None) == "" and bounds(0.5, 1) == "in [0.5, 1]"


def test_parse_int_reads_ascii_digits_with_a_sign_inside_its_bounds():
    assert parse_int(" +7 ", "--n") == 7 and parse_int("-3", "--n") == -3 and parse_int(12, "--n", 12, 12) == 12
    assert parse_int("1", "--n", lo=1) == 1 and parse_int("9", "--n", hi=9) == 9
    assert parse_int("9" * MAX_DIGITS, "--n") == int("9" * MAX_DIGITS)
    with refused("--n '1.5': expected int, an integer in ASCII digits 0-9 in [1, 4]"):
        parse_int("1.5", "--n", 1, 4)
    with refused("--n '²': expected int, an integer in ASCII digits 0-9"):
        parse_int("²", "--n")
    with refused(f"--n {'1' * 12}...: {MAX_DIGITS + 1} digits, past every bound; give an integer >= 0"):
        parse_int("1" * (MAX_DIGITS + 1), "--n", lo=0)
    with refused(f"--n -{'1' * 11}...: {MAX_DIGITS + 1} digits, past every bound"):
        parse_int("-" + "1" * (MAX_DIGITS + 1), "--n")
    with refused("--n True: expected an integer <= 3"):
        parse_int(True, "--n", hi=3)
    with refused("--n 2.0: expected an integer"):
        parse_int(2.0, "--n")
    with refused("--n 0: must be an integer >= 1"):
        parse_int("0", "--n", lo=1)
    with refused("--n 10: must be an integer in [1, 9]"):
        parse_int(10, "--n", 1, 9)


def test_parse_float_reads_decimal_exponent_inf_and_nan_and_refuses_the_rest():
    assert parse_float(" 0.5 ", "--t") == 0.5 and parse_float("1e-3", "--t") == 0.001 and parse_float(".5", "--t") == .5
    assert parse_float("-Infinity", "--t") == float("-inf") and parse_float("2", "--t") == 2.0
    assert parse_float(3, "--t") == 3.0 and isinstance(parse_float(3, "--t"), float)
    assert parse_float("NaN", "--t") != parse_float("NaN", "--t")  # nan: the option's own range check decides
    with refused("--t '0x1p3': expected float, a number in ASCII digits (e.g. 0.5 or 1e-3)"):
        parse_float("0x1p3", "--t")
    with refused("--t False: expected a number"):
        parse_float(False, "--t")
    with refused("--t None: expected a number"):
        parse_float(None, "--t")
    with refused(f"--t {10 ** 400}: too large for a floating-point number"):
        parse_float(10 ** 400, "--t")


def test_decode_text_bounds_the_size_and_reads_utf8_with_universal_newlines():
    assert decode_text("x", b"a\r\nb\rc\n", 10) == "a\nb\nc\n"
    assert decode_text("x", b"12345", 5) == "12345"  # exactly the limit is read
    with refused("--text-file f: more than 4 bytes (0 MiB), the most decodelab reads; give a shorter text"):
        decode_text("--text-file f", b"12345", 4)
    with refused(f"--text-file f: more than {3 * 2**20} bytes (3 MiB), the most decodelab reads; give a shorter text"):
        decode_text("--text-file f", b"x" * (3 * 2**20 + 1), 3 * 2**20)
    with refused("--text-file f: not UTF-8 text (byte 2); give a UTF-8 file"):
        decode_text("--text-file f", b"ab\xffcd")


def test_read_input_text_names_the_option_and_the_file(tmp_path):
    good = tmp_path / "t.txt"
    good.write_bytes(b"hello\r\nworld")
    assert read_input_text("--text-file", good) == "hello\nworld"
    assert read_input_text("--text-file", str(good), limit=12) == "hello\nworld"  # 12 bytes: exactly the limit
    check_input_file("--prompt-file", good)
    with refused(f"--text-file {good}: more than 11 bytes (0 MiB), the most decodelab reads; give a shorter text"):
        read_input_text("--text-file", good, limit=11)
    with refused(f"--text-file {tmp_path}: is a folder; give a text file"):
        read_input_text("--text-file", tmp_path)
    with refused(f"--text-file {tmp_path / 'none'}: no such file; give a text file"):
        read_input_text("--text-file", tmp_path / "none")
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"\xfe")
    with refused(f"--prompt-file {bad}: not UTF-8 text (byte 0); give a UTF-8 file"):
        check_input_file("--prompt-file", bad)


def test_read_input_text_turns_an_unreadable_file_into_one_line(tmp_path, monkeypatch):
    path = tmp_path / "t.txt"
    path.write_text("x")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr("builtins.open", denied)
    with refused(f"--text-file {path}: cannot read it (Permission denied)"):
        read_input_text("--text-file", path)


def test_read_input_text_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "h.txt").write_text("home")
    assert read_input_text("--text-file", "~/h.txt") == "home"


def test_nesting_depth_counts_containers_inside_containers():
    assert nesting_depth(3) == 0 and nesting_depth("text") == 0 and nesting_depth([]) == 1
    assert nesting_depth([1, 2]) == 1 and nesting_depth({"a": [1]}) == 2 and nesting_depth((1, (2, (3,)))) == 3
    # the deepest branch counts, wherever it sits among its siblings
    assert nesting_depth([[[[]]], 1, []]) == 4 and nesting_depth({"a": 1, "b": {"c": {"d": [0]}}}) == 4
    assert nesting_depth({"k": [[1], 2]}) == 3  # a dict's values are walked, not its keys


def test_check_text_refuses_lone_surrogates_naming_the_character():
    check_text("--prompt", "héllo ✓")
    with refused("--prompt 'ab\\\\udcff': not valid UTF-8 (an undecodable byte at character 2); give UTF-8 text"):
        check_text("--prompt", "ab\udcff")


def test_a_file_is_read_at_most_one_byte_past_the_limit(tmp_path, monkeypatch):
    """A pipe or a device given as the file (/dev/zero) is never read whole: one read of limit + 1 bytes, enough to
    tell it is too long."""
    path = tmp_path / "t.txt"
    path.write_text("x")
    sizes = []

    class Endless:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, size=-1):
            sizes.append(size)
            return b"z" * (size if size is not None and size >= 0 else 10**6)

    monkeypatch.setattr("builtins.open", lambda *args, **kwargs: Endless())
    with refused(f"--text-file {path}: more than 5 bytes (0 MiB), the most decodelab reads; give a shorter text"):
        read_input_text("--text-file", path, limit=5)
    assert sizes == [6]


def test_is_int_text_and_parse_numbers():
    from decodelab.core.inputs import is_int_text, parse_numbers, usable_cpus
    assert is_int_text(" -12 ") and is_int_text("+0") and not is_int_text("1_0") and not is_int_text("3.0")
    assert not is_int_text("١") and not is_int_text("")
    assert parse_numbers("0.1,0.2  0.7,", "--probs") == [0.1, 0.2, 0.7]
    with refused("--probs: no values; give numbers separated by commas, e.g. 0.1,0.2,0.7"):
        parse_numbers(" ,, ", "--probs")
    with refused("--probs 'nan': not a number"):
        parse_numbers("0.5,nan", "--probs")
    with refused("--probs 'x': expected float, a number in ASCII digits (e.g. 0.5 or 1e-3)"):
        parse_numbers("0.5 x", "--probs")
    assert 1 <= usable_cpus() <= (__import__("os").cpu_count() or 1)


def test_usable_cpus_falls_back_to_the_cpu_count(monkeypatch):
    import os

    from decodelab.core.inputs import usable_cpus

    def missing(pid):
        raise OSError("no affinity here")
    monkeypatch.setattr(os, "sched_getaffinity", missing)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpus() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5} if pid == 0 else set())
    assert usable_cpus() == 3
