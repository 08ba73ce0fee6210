"""torch's CPU threads: --threads, OMP_NUM_THREADS, the measured default, and the one line on a busy machine."""

from __future__ import annotations

from decodelab.core.engine.models import FEW_CORES, ThreadChoice, choose_threads, default_threads, physical_cores


def test_free_cores_get_one_thread_each_and_no_note():
    """Bug: the default cut to one thread on an idle machine (a 4-core machine would decode 1-thread slow)."""
    choice = choose_threads(None, environ={}, load=0.3, cores=4)
    assert (choice.threads, choice.note) == (4, None)


def test_a_busy_machine_gets_one_thread_and_one_line_saying_so():
    """Bug: the default kept 2 threads on a busy 2-core machine (measured 0.14x of one thread at load 2.8), or said
    nothing."""
    choice = choose_threads(None, environ={}, load=9.7, cores=2)
    assert choice.threads == 1
    assert choice.note.startswith("note: load average 9.7 on 2 cores") and "1 thread" in choice.note
    assert "\n" not in choice.note
    # the edge: every core has a runnable process
    assert choose_threads(None, environ={}, load=2.0, cores=2).threads == 1
    # just below it (issue 40: 2 threads at load 1.9, and another job then made both spin, 9-100x slower): one
    # thread on 2 cores whatever the load, without a note (nothing is oversubscribed yet)
    assert choose_threads(None, environ={}, load=1.9, cores=2) == ThreadChoice(1, None)


def test_given_threads_are_kept_and_more_than_one_on_a_busy_machine_is_noted():
    """Bug: the default overrode --threads, or a run asking for 2 threads on a busy machine was not told why it crawls."""
    assert choose_threads(2, environ={}, load=0.1, cores=2) == choose_threads(2, environ={}, load=0.1, cores=2)
    assert choose_threads(2, environ={}, load=0.1, cores=2).threads == 2
    assert choose_threads(2, environ={}, load=0.1, cores=2).note is None
    busy = choose_threads(2, environ={}, load=6.0, cores=2)
    assert busy.threads == 2 and "2 torch threads" in busy.note and "--threads 1" in busy.note
    assert choose_threads(1, environ={}, load=6.0, cores=2).note is None  # one thread waits on nobody


def test_omp_num_threads_is_the_users_choice():
    """Bug: the default replaced what OMP_NUM_THREADS says (torch already follows it: threads None leaves it)."""
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "3"}, load=0.0, cores=8).threads is None
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "1"}, load=9.0, cores=2).note is None
    assert "3 torch threads" in choose_threads(None, environ={"OMP_NUM_THREADS": "3"}, load=9.0, cores=2).note
    assert choose_threads(5, environ={"OMP_NUM_THREADS": "3"}, load=0.0, cores=8).threads == 5  # --threads wins


def test_one_core_needs_no_note():
    assert choose_threads(None, environ={}, load=5.0, cores=1) == choose_threads(None, environ={}, load=0.0, cores=1)
    assert choose_threads(None, environ={}, load=5.0, cores=1).threads == 1


def test_physical_cores_is_at_least_one_and_at_most_the_usable_cpus():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


# --- the default's rule (issue 40): never more threads than the load leaves free cores; one on 2 cores ------------

def test_two_cores_get_one_thread_at_any_load():
    """Bug: on 2 cores the default took the second core whenever the load average was below 2, and a job starting
    later made both threads spin."""
    assert FEW_CORES == 2
    for load in (0.0, 0.4, 1.0, 1.5, 1.99, 2.0, 7.0):
        assert default_threads(load, 2) == 1
        assert choose_threads(None, environ={}, load=load, cores=2).threads == 1
    assert default_threads(0.0, 1) == 1


def test_more_cores_get_the_free_ones_rounded():
    """free = cores - load, rounded to the nearest, in [1, cores]: worked by hand."""
    assert [default_threads(load, 4) for load in (0.0, 0.49, 0.51, 1.4, 2.5, 3.51, 9.0)] == [4, 4, 3, 3, 2, 1, 1]
    assert [default_threads(load, 8) for load in (0.3, 2.6, 7.4)] == [8, 5, 1]
    # through choose_threads below the busy edge (load < cores): the same count, no note
    assert choose_threads(None, environ={}, load=2.6, cores=8) == ThreadChoice(5, None)
    assert choose_threads(None, environ={}, load=3.9, cores=4) == ThreadChoice(1, None)


def test_oversubscribed_rule_and_record():
    """Oversubscribed: start load >= cores, or end load > cores (the run's own threads then counted)."""
    from decodelab.core.engine.machine_load import machine_note, machine_record, oversubscribed

    assert oversubscribed(2.0, 0.0, 2) and oversubscribed(0.0, 2.01, 2)
    assert not oversubscribed(1.99, 2.0, 2) and not oversubscribed(0.5, 1.5, 4)
    assert machine_record(1.0, 1.5, 2) is None
    rec = machine_record(2.345, 1.0, 2)
    assert rec == {"oversubscribed": True, "load_average_start": 2.35, "load_average_end": 1.0, "physical_cores": 2}
    note = machine_note(rec)
    assert note.startswith("note: load average 2.4 at the start and 1.0 at the end on 2 cores") and "\n" not in note


def test_a_run_timed_on_an_oversubscribed_machine_says_so(cli, toy_model_dir, monkeypatch):
    """Bug: the README's batch example printed speedup_vs_static=0.11 on a busy machine with no word that the
    figure was taken there. The field in -f json and -f jsonl's summary, the note on stderr; nothing when free."""
    import json

    from decodelab.cli import machine

    loads = iter([0.2, 0.3])
    monkeypatch.setattr("decodelab.cli.pipeline.load_average", lambda: next(loads))
    monkeypatch.setattr(machine, "load_average", lambda: next(loads))
    monkeypatch.setattr("decodelab.cli.pipeline.physical_cores", lambda: 2)
    code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-n", "2", "-f", "json")
    assert code == 0, err
    assert "machine" not in json.loads(out) and "oversubscribed" not in err, (out, err)
    for fmt in ("json", "jsonl"):
        loads = iter([3.0, 1.0])
        code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-n", "2", "-f", fmt)
        assert code == 0, err
        doc = json.loads(out if fmt == "json" else out.splitlines()[-1])
        assert doc["machine"] == {"oversubscribed": True, "load_average_start": 3.0, "load_average_end": 1.0,
                                  "physical_cores": 2}
        assert err.count("the machine was oversubscribed") == 1
        assert doc["tokens_per_s" if fmt == "jsonl" else "summary"]  # the figure it qualifies is there
    loads = iter([0.5, 2.5])  # busy only at the end
    code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-n", "2", "-f", "json")
    assert json.loads(out)["machine"]["load_average_end"] == 2.5
    # a command that loads no model afterwards carries nothing over from the run before
    code, out, err = cli("models", "-f", "json")
    assert code == 0 and "oversubscribed" not in out + err


def test_openmp_waits_passively_unless_the_user_chose(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE is set by the CLI before torch loads, and never over a user's own policy."""
    from decodelab.cli import main

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    main.passive_openmp()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    main.passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10")
    main.passive_openmp()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_console_script_sets_passive_waiting_before_torch_loads():
    """In a fresh process: by the time torch is imported, the policy is in the environment OpenMP reads."""
    import subprocess
    import sys

    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import decodelab.cli.main; "
            "assert 'torch' not in sys.modules, 'torch loaded first'; print(os.environ['OMP_WAIT_POLICY'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
    assert r.returncode == 0 and r.stdout == "PASSIVE\n", r.stderr


def test_what_counts_as_a_speed_figure():
    """The machine field goes only on output with a speed figure: a key ending in _per_s or naming a speedup,
    found in dicts, lists and dataclasses (rows and summaries not yet made dicts); nothing else."""
    from dataclasses import dataclass

    from decodelab.cli.machine import timed

    @dataclass
    class Row:
        tokens_per_s: float = 1.0

    @dataclass
    class Plain:
        perplexity: float = 1.0

    assert timed({"rows": [Row()]}) and timed({"summary": {"speedup_vs_static": 0.1}})
    assert timed([{"type": "summary", "decode_tokens_per_s": 3.0}])
    assert not timed({"rows": [Plain()], "stages": [{"prob": 0.5}]}) and not timed({"seconds": 2.0})
