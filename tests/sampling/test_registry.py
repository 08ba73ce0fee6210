"""The stage registry's own pieces (core/sampling/registry.py), called in the test body.

The registry's table is built when the module is imported, so its helpers (a stage's default value reader, the
value reader of a stage named by texts, an engine's order, the class binding) run before any test starts; mutation
testing switches a mutant on only inside a test. These cases call each piece again where a mutant can be seen.
Written for the mutation run of core/sampling/chain.py, registry.py and tokens.py (2026-12-02)."""

from __future__ import annotations

from types import SimpleNamespace

from decodelab.core.sampling.registry import BY_NAME, ENGINES, STAGES, Param, Stage, _texts, engine_order, implements
from decodelab.core.sampling.semantics import active_stages
from decodelab.core.sampling.settings import ChainSettings


def test_a_stage_without_a_value_reader_reads_its_first_field_and_a_given_reader_is_kept():
    stage = Stage("x", (Param("first", float, "h"), Param("second", float, "h")))
    assert stage.value(SimpleNamespace(first=0.25, second=9.0), {}) == 0.25
    assert stage.value(SimpleNamespace(first=None, second=9.0), {}) is None
    own = Stage("y", (Param("first", float, "h"),), value=lambda s, resolved: "own")
    assert own.value(SimpleNamespace(first=1.0), {}) == "own"


def test_a_stage_is_switched_on_by_its_first_field_or_any_field():
    """A stage is on when its first field is set (XTC's threshold alone is not), or, for mirostat and the
    constraint, any of its fields; an empty tuple (no --ban given) is off."""
    assert "xtc" not in active_stages(ChainSettings(xtc_threshold=0.2))
    assert "xtc" in active_stages(ChainSettings(xtc_probability=0.5))
    assert "mirostat" in active_stages(ChainSettings(mirostat_eta=0.2))  # its second field
    assert "mirostat" not in active_stages(ChainSettings())
    assert "ban" not in active_stages(ChainSettings()) and "ban" in active_stages(ChainSettings(ban=("x",)))


def test_switched_on_reads_the_first_field_or_any_field():
    """The same facts asked of the registry row (beam's refusal of sampling-only stages calls it)."""
    xtc, mirostat, ban = BY_NAME["xtc"], BY_NAME["mirostat"], BY_NAME["ban"]
    assert not xtc.switched_on(ChainSettings(xtc_threshold=0.2))
    assert xtc.switched_on(ChainSettings(xtc_probability=0.5))
    assert mirostat.switched_on(ChainSettings(mirostat_eta=0.2))  # its second field
    assert not mirostat.switched_on(ChainSettings())
    assert not ban.switched_on(ChainSettings()) and ban.switched_on(ChainSettings(ban=("x",)))


def test_a_stage_named_by_texts_takes_their_resolved_ids_only_when_its_field_is_set():
    value = _texts("ban", "ban")
    assert value(ChainSettings(ban=("x",)), {"ban": ((4, 5),)}) == ((4, 5),)
    assert value(ChainSettings(), {"ban": ((4, 5),)}) is None


def test_an_engine_order_holds_the_stages_that_engine_has_by_their_rank_there():
    """Each engine's order: exactly the stages with a rank for it, ranks increasing; the three engines differ."""
    orders = {engine: engine_order(engine) for engine in ENGINES}
    for engine, order in orders.items():
        assert set(order) == {s.name for s in STAGES if engine in s.engines}
        ranks = [BY_NAME[name].engines[engine] for name in order]
        assert ranks == sorted(ranks) and len(order) >= 5
    assert len(set(orders.values())) == 3
    assert engine_order("none of them") == ()


def test_implements_binds_a_class_or_a_variant_to_its_entry():
    entry = BY_NAME["top-k"]
    own, variants = entry.cls, dict(entry.variants)
    try:
        class Plain:
            pass

        class Other:
            pass

        assert implements("top-k")(Plain) is Plain and entry.cls is Plain
        assert implements("top-k", "test-engine")(Other) is Other
        assert entry.variants["test-engine"] is Other and entry.cls is Plain
        assert entry.class_for("test-engine") is Other and entry.class_for(None) is Plain
    finally:
        entry.cls = own
        entry.variants.clear()
        entry.variants.update(variants)


def test_range_checks_refuse_infinity_and_nan_where_they_ask_for_a_finite_number():
    """``_finite``: a number that is finite. --softcap inf passes "> 0" but is not finite; llama.cpp's min-p accepts
    any number (above 1 keeps one token) but NaN."""
    import math

    import pytest

    from decodelab.core.errors import ConfigError
    from decodelab.core.sampling.registry import check_range, param

    check_range(param("softcap"), 30.0)
    with pytest.raises(ConfigError, match=r"^--softcap inf: must be > 0$"):
        check_range(param("softcap"), math.inf)
    check_range(param("min_p"), 3.0, "llamacpp")
    with pytest.raises(ConfigError, match=r"^--min-p nan: must be a number"):
        check_range(param("min_p"), math.nan, "llamacpp")


def test_value_readers_of_dry_and_the_constraint_and_each_field_once():
    """DRY's breakers default to none when nothing was resolved; the constraint is what resolution read; params()
    lists each field once."""
    from decodelab.core.sampling.registry import _constraint, _dry, params

    assert _dry(ChainSettings(dry_multiplier=0.8), {})["breakers"] == ()
    marker = object()
    assert _constraint(ChainSettings(), {"constraint": marker}) is marker
    fields = [p.field for p in params()]
    assert len(fields) == len(set(fields)) and "temperature" in fields and "dry_breaker" in fields


# mutation run of core/sampling/settings.py (2026-12-02, second round): annotation runs at import time (building
# ChainSettings), where no mutant is switched on; called here in the body


def test_each_settings_field_type_is_an_optional_scalar_a_tuple_of_texts_or_of_pairs():
    from decodelab.core.sampling.registry import Param
    from decodelab.core.sampling.settings import annotation
    assert annotation(Param("temperature", float, "t")) == (float | None)
    assert annotation(Param("top_k", int, "k")) == (int | None)
    assert annotation(Param("ban", str, "b", many=True)) == tuple[str, ...]
    assert annotation(Param("bias", str, "b", pairs=True)) == tuple[tuple[str, float], ...]
    assert annotation(Param("bias", str, "b", many=True, pairs=True)) == tuple[tuple[str, float], ...]
