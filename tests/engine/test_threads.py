"""torch's CPU threads: --threads, OMP_NUM_THREADS, the measured default, and the one line on a busy machine."""

from __future__ import annotations

from decodelab.core.engine.models import choose_threads, physical_cores


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
    assert choose_threads(None, environ={}, load=1.9, cores=2).threads == 2


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
