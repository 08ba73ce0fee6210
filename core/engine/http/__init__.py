"""A served model as a decodelab backend, reached over HTTP with the standard library only, one file per part:

* :mod:`.transport` -- JSON over HTTP to the one URL given (no proxy, no redirect), each failure one line;
* :mod:`.wire` -- the records an answer becomes (positions, labels, scored and generated sequences, the sampling
  settings a request writes) and the rules that read an engine's values;
* :mod:`.adapter` -- the protocol one server kind implements, and the registry the client picks from;
* :mod:`.vllm`, :mod:`.sglang`, :mod:`.llamacpp` -- one adapter per engine, each registering itself;
* :mod:`.client` -- :class:`~.client.ServedEngine`, which resolves the model and the adapter and sends requests.

Adding an engine is one adapter module, imported below. Where the facts come from: ``docs/engines.md``.
"""

from . import vllm, sglang, llamacpp  # noqa: F401  (each registers its adapter, in the order refusals list them)
