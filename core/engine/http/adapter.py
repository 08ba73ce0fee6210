"""The adapter protocol: what one kind of server declares so that the client (:mod:`.client`) can talk to it, and
the registry the client picks an adapter from.

An adapter builds request bodies and reads answers; it never sends anything (the client does, through
:class:`~.transport.Transport`). Adding an engine is one class that declares the members of :class:`Adapter` and
registers itself with :func:`register`; the client finds it by ``--engine-kind NAME`` or by the ``owned_by`` its
``/v1/models`` lists, with no other edit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from ..backend import Capabilities
from .transport import EngineError, Transport
from .wire import Position, SamplingSettings


class Adapter(Protocol):
    """One server kind. Class-level facts, then what an instance built for one logprobs mode knows.

    A class may subclass this protocol to take the defaults below (no tokenize endpoint, no prefix-cache
    counters, no cached-token count); every other member it must define."""

    kind: ClassVar[str]  # the name --engine-kind takes and every label carries
    owned_by: ClassVar[tuple[str, ...]]  # /v1/models ``owned_by`` values (lower case) that name this kind
    default_mode: ClassVar[str]  # the logprobs mode its generation values are read as when none is given
    path: ClassVar[str]  # the completion endpoint
    tokenize_path: ClassVar[str | None] = None  # the endpoint that tokenizes a text (None: none)
    metrics_path: ClassVar[str | None] = None  # Prometheus text with the prefix-cache counters (None: none)
    masked: ClassVar[float | None] = None  # the value the server writes for -inf (None: it writes none)
    answers_model: ClassVar[bool] = False  # the answer names the model, and another name is refused

    values: str  # what the generation values are (wire.RAW, PROCESSED, RAW_LOGITS, PROCESSED_LOGITS)
    prompt_values: str  # what a scored prompt position's values are
    capabilities: Capabilities

    def __init__(self, logprobs_mode: str, max_top_n: int | None) -> None:
        """An EngineError for a mode the server kind cannot give."""

    def check(self, s: SamplingSettings) -> str | None:
        """A setting the server would change or drop without saying so, as one line; None when all are kept."""

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        """The request that scores ``ids`` teacher-forced with the top ``top_n`` alternatives."""

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        """The request that continues ``ids`` with every sampling field of ``s`` written out."""

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        """A score answer as one Position per prompt token (``t`` names failures)."""

    def read_generation(self, t: Transport, body: dict,
                        resp: dict) -> tuple[tuple[int, ...], tuple[Position, ...], str | None]:
        """A generation answer as (new ids, one Position per step, finish reason)."""

    def tokenize_body(self, model: str, text: str, add_special_tokens: bool) -> dict:
        """The request to :attr:`tokenize_path` (only called where it is set)."""
        raise EngineError(f"{self.kind}: no tokenize endpoint")

    @staticmethod
    def cached_tokens(resp: dict) -> int | None:
        """Prompt tokens the server read from its prefix cache, where its answer says (None: it does not)."""
        return None

    def prefix_cache_counters(self, metrics: str) -> dict[str, float]:
        """``hits`` and ``queries`` (tokens) from the text at :attr:`metrics_path` (only called where it is set)."""
        raise EngineError(f"{self.kind}: no prefix-cache counters")


ADAPTERS: dict[str, type[Adapter]] = {}  # kind -> adapter class, in the order registered
OWNERS: dict[str, str] = {}  # /v1/models owned_by (lower case) -> kind

# members every adapter class must define itself (the rest have defaults on the protocol)
REQUIRED = ("kind", "owned_by", "default_mode", "path", "check", "score_body", "generate_body", "read_score",
            "read_generation")


def register(cls: type[Adapter]) -> type[Adapter]:
    """Add an adapter class to the registry (a decorator); a second class for a kind or an owner is refused."""
    missing = [name for name in REQUIRED if getattr(cls, name, None) in (None, getattr(Adapter, name, None))]
    if missing:
        raise TypeError(f"{cls.__name__} lacks {', '.join(missing)} (see Adapter)")
    if cls.kind in ADAPTERS:
        raise ValueError(f"an adapter for {cls.kind!r} is registered already ({ADAPTERS[cls.kind].__name__})")
    taken = [o for o in cls.owned_by if o in OWNERS]
    if taken:
        raise ValueError(f"owned_by {taken[0]!r} names {OWNERS[taken[0]]!r} already")
    ADAPTERS[cls.kind] = cls
    OWNERS.update({o: cls.kind for o in cls.owned_by})
    return cls
