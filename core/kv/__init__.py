"""KV-cache policies: what a decoding run keeps of the keys and values it has computed.

The protocol, the spec parser and the registry are in :mod:`.protocol`; each policy is one module that registers
itself there, imported here once in the order ``decodelab models`` lists them.
"""

from . import full, paged, quant, recompute, static, window  # noqa: E402,F401  (each registers itself)
from . import h2o, knorm, pyramidkv, snapkv, tova  # noqa: E402,F401  (the score-based presses)
from . import keydiff, expected  # noqa: E402,F401  (query-free presses)
from . import turbo  # noqa: E402,F401  (TurboQuant-style codes)
from .protocol import (
                       ALIASES,
                       CAPABILITIES,
                       POLICIES,
                       CacheSpec,
                       KVPolicy,
                       ModelInfo,
                       Rotary,
                       compresses_once,
                       engine_reading,
                       feed_invariant,
                       listing,
                       make_policy,
                       parse_cache_spec,
                       parse_policy_list,
                       split_policy_list,
                       policy_capabilities,
                       register,
                       require,
                       tensor_nbytes,
)

__all__ = ["ALIASES", "CAPABILITIES", "POLICIES", "CacheSpec", "KVPolicy", "ModelInfo", "Rotary", "compresses_once",
           "engine_reading", "feed_invariant", "listing", "make_policy", "parse_cache_spec", "parse_policy_list",
           "policy_capabilities",
           "register", "require", "split_policy_list", "tensor_nbytes"]
