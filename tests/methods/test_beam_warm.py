"""`beam` times its search warm (issue 34, item 1): the model's first-call costs are paid before the stopwatch starts,
at the search's own shapes (a one-row prefill, beam-wide decodes), and reported apart as ``warmup_s``, in no rate.
Pinned with an instrumented model whose first forward at each input shape is slow (a GPU's first call of a kernel);
the negative control switches the warm-up off and sees the cost land in the timed part."""

from __future__ import annotations

import time

from conftest import random_model

from decodelab.core.engine import warmup
from decodelab.core.methods import beam as beam_module
from decodelab.core.methods.beam import BeamSearch, BeamSettings, ModelStepper
from decodelab.core.sampling.chain import build_chain

PROMPT = [5, 9, 17, 2]
FIRST_CALL_S = 0.4  # what the instrumented model's first forward at a new shape costs
BEAMS, STEPS = 3, 4


def slow_first_call_per_shape(model) -> list:
    """Each input shape's first forward sleeps FIRST_CALL_S (kernels are chosen and loaded per shape on a GPU);
    later ones run at their own speed. Returns the log of shapes."""
    shapes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = tuple(ids.shape[:1]) + (1 if ids.shape[1] == 1 else "n",)  # decode (rows, 1) or a prefill
        if shape not in shapes:
            time.sleep(FIRST_CALL_S)
        shapes.append(shape)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return shapes


def search(model) -> BeamSearch:
    settings = BeamSettings(beams=BEAMS, max_new_tokens=STEPS, early_stopping="never")
    run = BeamSearch(ModelStepper(model), PROMPT, build_chain({}), settings)
    run.run()
    return run


def test_the_first_call_costs_are_paid_before_the_search_is_timed_and_reported_apart():
    model = random_model("llama", seed=11)
    shapes = slow_first_call_per_shape(model)
    run = search(model)
    summary, timing = run.summary(), run.watch.timing
    assert run.n_steps == STEPS
    assert summary.warmup_s >= 2 * FIRST_CALL_S  # reported: the prefill's and the beam-wide decode's first calls
    assert timing.prefill_s + timing.loop_s + timing.trace_s < FIRST_CALL_S  # excluded from every rate
    assert summary.seconds == timing.total_s and summary.tokens_per_s == STEPS * BEAMS / timing.total_s
    warm = [(1, "n")] + [(BEAMS, 1)] * warmup.WARM_DECODES  # the warm-up's forwards, at the search's shapes, first
    assert shapes == warm + [(1, "n")] + [(BEAMS, 1)] * (STEPS - 1)


def test_a_second_search_at_the_same_width_is_not_warmed_again_and_a_wider_one_is():
    model = random_model("llama", seed=12)
    slow_first_call_per_shape(model)
    assert search(model).summary().warmup_s > 0
    assert search(model).summary().warmup_s == 0.0
    wider = BeamSearch(ModelStepper(model), PROMPT, build_chain({}), BeamSettings(beams=BEAMS + 1, max_new_tokens=2))
    wider.run()
    assert wider.summary().warmup_s >= FIRST_CALL_S  # its (4, 1) decodes are new shapes
    assert wider.watch.timing.loop_s < FIRST_CALL_S


def test_without_the_warm_up_the_first_calls_land_in_the_timed_search(monkeypatch):
    """The negative control: the same instrumented model with the warm-up switched off pays inside the prefill and
    the search, and nothing is reported apart."""
    model = random_model("llama", seed=13)
    slow_first_call_per_shape(model)
    monkeypatch.setattr(beam_module, "warm_up", lambda model, spec=None, rows=1: 0.0)
    run = search(model)
    timing = run.watch.timing
    assert run.summary().warmup_s == 0.0
    assert timing.prefill_s >= FIRST_CALL_S and timing.loop_s + timing.trace_s >= FIRST_CALL_S


def test_a_table_of_fixed_logits_has_nothing_to_warm():
    class Table:
        def start(self, prompt_ids):
            import torch

            return torch.log(torch.tensor([[0.3, 0.7]]))

        def advance(self, parents, parents_t, tokens):
            import torch

            return torch.log(torch.tensor([[0.3, 0.7]] * len(parents)))

    run = BeamSearch(Table(), [1], build_chain({}), BeamSettings(beams=2, max_new_tokens=2))
    run.run()
    assert run.summary().warmup_s == 0.0
