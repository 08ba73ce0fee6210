"""``paged``: keys and values in a pool of fixed-size physical blocks, mapped per sequence by a block table.

The pool of each layer is one tensor of slots ``[blocks * block + 1, kv_heads, head_dim]``; slot ``p * block + o``
is offset ``o`` of physical block ``p``, and the last slot is scratch (padding writes land there and are never
read unmasked). A sequence's logical position ``l`` lives in physical block ``table[l // block]`` at offset
``l % block``. Blocks are allocated on demand from a free list and carry reference counts.

Prefix caching: a FULL block is named by ``hash(parent block's hash, its token ids, model, dtype)``, so a hit
means every token before it is identical too (the same ids, not merely the same text). A new sequence shares
the longest run of cached full blocks of its tokens (reference count + 1) and computes only the rest. A block
whose count falls to 0 goes to the end of the free list but keeps its hash: it can still be found (and revived)
until allocation reaches it at the front of the list (least recently released first).

Attention stays exact: for each forward the rows' blocks are gathered into a padded ``[B, H, L, D]`` view and the
model gets a 4D additive mask (0 where query ``q`` of row ``b`` may see key ``l``: ``l <= position(b, q)``; the
dtype's minimum elsewhere, so those weights are exactly 0 after the softmax). New tokens of a row are
LEFT-padded to the longest row, so the last column holds every row's last token (``keep="last"`` works).

Two ways to drive it: the scheduler (:mod:`decodelab.core.methods.batch.scheduler`) names rows and their new tokens with
:meth:`PagedPolicy.plan` before each forward; a plain one-row run (``sample --cache paged``) plans itself.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ConfigError
from .protocol import KVPolicy, ModelInfo, positive_int, register, tensor_nbytes

SOLO = "solo"  # the row a self-planned (one-row) run uses


# --- block arithmetic and names --------------------------------------------------------------------------------


def full_blocks(tokens: int, block: int) -> int:
    """Blocks completely filled by ``tokens`` tokens (the ones that can be named and shared)."""
    return tokens // block


def blocks_for(tokens: int, block: int) -> int:
    """Blocks needed to hold ``tokens`` tokens: ceil(tokens / block)."""
    return -(-tokens // block)


def block_hash(parent: bytes | None, token_ids, salt: str) -> bytes:
    """The name of a full block: its parent's name, its token ids and the model/dtype (``salt``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00root")
    h.update(salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_hashes(token_ids: list[int], block: int, salt: str) -> list[bytes]:
    """Names of every full block of ``token_ids``, each chained on the one before."""
    names, parent = [], None
    for i in range(full_blocks(len(token_ids), block)):
        parent = block_hash(parent, token_ids[i * block : (i + 1) * block], salt)
        names.append(parent)
    return names


class PoolFull(Exception):
    """No free block is left (the scheduler preempts a sequence and retries)."""


# --- the pool ---------------------------------------------------------------------------------------------------


class BlockPool:
    """Reference counts, the free list (released blocks in release order, still findable by name) and the
    name -> block map of full blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.name_of: list[bytes | None] = [None] * num_blocks
        self.by_name: dict[bytes, int] = {}

    @property
    def used(self) -> int:
        """Blocks some sequence holds (reference count > 0)."""
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise PoolFull
        block, _ = self.free.popitem(last=False)  # least recently released first
        name = self.name_of[block]
        if name is not None:  # its cached content is overwritten from now on
            del self.by_name[name]
            self.name_of[block] = None
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]  # revived from the free list
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def name(self, block: int, name: bytes) -> None:
        """Make a just-filled block findable; a block with the same name already cached keeps the name."""
        if name not in self.by_name:
            self.by_name[name] = block
            self.name_of[block] = name

    def lookup(self, name: bytes) -> int | None:
        return self.by_name.get(name)


@dataclass
class Sequence:
    """One row's block table: ``computed`` tokens have keys and values stored; ``tokens`` are their ids (known
    ids only: a self-planned run does not see them and names no block)."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    named: int = 0  # leading full blocks already named (cached or registered)
    names: list[bytes] = field(default_factory=list)


@dataclass
class Plan:
    """One forward: rows, their new-token counts, and the index tensors the cache layers use."""

    keys: list[str]
    counts: list[int]
    new_tokens: list[list[int] | None]
    positions: Tensor  # [B, n] per-row positions (pads at 0)
    mask: Tensor  # [B, 1, n, L] additive
    write: Tensor  # [B * n] slot of each new token (pads: the scratch slot)
    gather: Tensor  # [B * L] slot of each key of the padded view (beyond a row's length: the scratch slot)
    length: int  # L


# --- the policy ------------------------------------------------------------------------------------------------


@register
class PagedPolicy(KVPolicy):
    name = "paged"
    capabilities = frozenset()  # several rows only through the scheduler; no truncate/reorder
    feed_invariant = True  # nothing is evicted, compressed or quantized between forwards
    summary = "a pool of fixed-size blocks with block tables, a free list and prefix sharing (for batch)"
    params = {"block": positive_int, "blocks": positive_int}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 block: int = 16, blocks: int | None = None):
        super().__init__(info, capacity, needs)
        refuse_sliding(info.config)
        if blocks is None:
            if capacity is None:
                raise ConfigError("--cache paged: give blocks=N (this command does not know its length up front)")
            blocks = blocks_for(capacity, block)
        self.block, self.num_blocks = block, blocks
        self.pool = BlockPool(blocks)
        self.salt = model_salt(info)
        self.scratch = blocks * block  # the last slot
        shape = (blocks * block + 1, info.kv_heads, info.head_dim)
        self.k = [torch.zeros(shape, dtype=info.dtype, device=info.device) for _ in range(info.num_layers)]
        self.v = [torch.zeros(shape, dtype=info.dtype, device=info.device) for _ in range(info.num_layers)]
        self.seqs: dict[str, Sequence] = {}
        self.plan_: Plan | None = None
        self.model_cache = PagedCache(self)

    # --- sequences ---

    def match(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` that cached full blocks cover, leaving at least one token to compute (the
        logits after the last token need a forward)."""
        hit = 0
        for name in chain_hashes(token_ids, self.block, self.salt):
            if self.pool.lookup(name) is None:
                break
            hit += self.block
        while hit > len(token_ids) - 1:
            hit -= self.block
        return max(hit, 0)

    def admit(self, key: str, token_ids: list[int], share: bool = True) -> int:
        """Start a sequence whose tokens will be ``token_ids``; share its cached prefix (unless ``share`` is
        False). Returns the tokens found cached."""
        if key in self.seqs:
            raise ValueError(f"sequence {key!r} is already in the pool")
        hit = self.match(token_ids) if share else 0
        names = chain_hashes(token_ids[:hit], self.block, self.salt)
        seq = Sequence(tokens=list(token_ids[:hit]), computed=hit, named=len(names), names=names)
        for name in names:
            block = self.pool.lookup(name)
            self.pool.share(block)
            seq.blocks.append(block)
        self.seqs[key] = seq
        return hit

    def free(self, key: str) -> None:
        """Release a sequence's blocks, last first (so its tail is the first to be overwritten)."""
        seq = self.seqs.pop(key)
        for block in reversed(seq.blocks):
            self.pool.release(block)

    def reserve(self, key: str, n: int) -> None:
        """Allocate the blocks a sequence needs for ``n`` more tokens (PoolFull when the free list runs out; the
        blocks taken so far stay in its table)."""
        seq = self.seqs[key]
        while len(seq.blocks) < blocks_for(seq.computed + n, self.block):
            seq.blocks.append(self.pool.allocate())

    def table(self, key: str) -> list[int]:
        return list(self.seqs[key].blocks)

    @property
    def blocks_used(self) -> int:
        return self.pool.used

    @property
    def blocks_free(self) -> int:
        return len(self.pool.free)

    # --- one forward ---

    def plan(self, rows: list[tuple[str, list[int] | int]]) -> Tensor:
        """Reserve blocks for the rows' new tokens and prepare the forward; returns the ids [B, n] (left-padded
        with 0). A row is (key, new token ids), or (key, count) when the ids are not known (self-planned)."""
        for key, new in rows:
            self.reserve(key, new if isinstance(new, int) else len(new))
        counts = [new if isinstance(new, int) else len(new) for _, new in rows]
        device, n, bs = self.info.device, max(counts), self.block
        past = [self.seqs[key].computed for key, _ in rows]
        L = max(p + c for p, c in zip(past, counts))
        width = blocks_for(L, bs)
        # built as lists and made tensors once (two tensors, not two a row): new ids left-padded with 0, block
        # tables right-padded with block 0 (never read unmasked)
        ids = torch.tensor([[0] * (n - c) + (list(new) if not isinstance(new, int) else [0] * c)
                            for (_, new), c in zip(rows, counts)], dtype=torch.long)
        table = torch.tensor([padded(self.seqs[key].blocks, width) for key, _ in rows], dtype=torch.long)
        pos, write, gather, mask = layout(past, counts, table, bs, self.scratch, self.info.dtype)
        self.plan_ = Plan([k for k, _ in rows], counts, [None if isinstance(x, int) else list(x) for _, x in rows],
                          pos.to(device), mask.to(device), write.to(device), gather.to(device), L)
        return ids.to(device)

    def positions(self, n: int) -> Tensor:
        if self.plan_ is None:  # a one-row run: plan the solo row itself
            if SOLO not in self.seqs:
                self.seqs[SOLO] = Sequence()
            self.plan([(SOLO, n)])
        return self.plan_.positions

    def attention_mask(self, n: int) -> Tensor | None:
        return self.plan_.mask

    def after_forward(self, n: int) -> None:
        plan, self.plan_ = self.plan_, None
        for key, count, new in zip(plan.keys, plan.counts, plan.new_tokens):
            seq = self.seqs[key]
            seq.computed += count
            if new is None:
                continue
            seq.tokens.extend(new)
            self._name_full_blocks(seq)
        self.seen = max((s.computed for s in self.seqs.values()), default=0)

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Register every block the sequence has just filled, chained on its parent's name."""
        while seq.named < full_blocks(seq.computed, self.block):
            i = seq.named
            parent = seq.names[i - 1] if i else None
            name = block_hash(parent, seq.tokens[i * self.block : (i + 1) * self.block], self.salt)
            self.pool.name(seq.blocks[i], name)
            seq.names.append(name)
            seq.named += 1

    @property
    def stored(self) -> int:
        return max((s.computed for s in self.seqs.values()), default=0)

    def truncate(self, seen: int) -> None:
        raise NotImplementedError("paged: no rollback")

    def reorder(self, rows: Tensor) -> None:
        raise NotImplementedError("paged: rows are sequences of the scheduler")

    def layer_nbytes(self) -> list[int]:
        return [tensor_nbytes(k) + tensor_nbytes(v) for k, v in zip(self.k, self.v)]

    def describe(self) -> dict:
        return {"policy": self.name, "seen": self.seen, "stored": self.stored, "blocks_used": self.blocks_used,
                "blocks_free": self.blocks_free}


def padded(blocks: list[int], width: int) -> list[int]:
    """A block table row of ``width`` entries: the row's blocks, then block 0 (masked wherever it is read)."""
    return blocks[:width] + [0] * (width - len(blocks))


def layout(past: list[int], counts: list[int], table: Tensor, block: int, scratch: int, dtype: torch.dtype):
    """Index tensors of one forward. Row b has ``past[b]`` tokens stored and ``counts[b]`` new ones, left-padded
    to n = max(counts); ``table`` [B, blocks] maps its logical blocks to physical ones (at least ceil(L / block)
    blocks, L the longest row). Returns positions [B, n], the slot each new token is written to [B * n] (padding:
    ``scratch``), the slot of each key of the padded view [B * L] (past a row's length: ``scratch``) and the
    additive mask [B, 1, n, L]."""
    B, n, L = len(past), max(counts), max(p + c for p, c in zip(past, counts))
    past_t, count_t = torch.tensor(past), torch.tensor(counts)
    # query column c of row b is new token j = c - (n - count) at position past + j; j < 0 is padding
    j = torch.arange(n)[None, :] - (n - count_t[:, None])
    real = j >= 0
    pos = torch.where(real, past_t[:, None] + j, torch.zeros_like(j))  # [B, n]

    def slot(p: Tensor) -> Tensor:  # logical position -> pool slot: table[p // block] * block + p % block
        return table.gather(1, p // block) * block + p % block

    write = torch.where(real, slot(pos), torch.full_like(pos, scratch))
    key_pos = torch.arange(L)[None, :].expand(B, L)  # every key position is < L <= the table's blocks x block
    in_row = key_pos < (past_t + count_t)[:, None]
    gather = torch.where(in_row, slot(key_pos), torch.full_like(key_pos, scratch))
    # a real query sees keys at positions <= its own; a padding query sees key 0 only (no empty softmax row)
    allowed = torch.where(real[:, :, None], key_pos[:, None, :] <= pos[:, :, None], key_pos[:, None, :] == 0)
    mask = torch.zeros(B, 1, n, L, dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return pos, write.flatten(), gather.flatten(), mask


class PagedCache:
    """What the model's attention layers call: write the new keys/values into their slots, return the padded view."""

    is_compileable = False

    def __init__(self, policy: PagedPolicy):
        self.policy = policy

    def update(self, keys: Tensor, values: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        plan, p = self.policy.plan_, self.policy
        B, H, n, D = keys.shape
        view = (B, plan.length, H, D)
        p.k[layer_idx].index_copy_(0, plan.write, keys.transpose(1, 2).reshape(B * n, H, D).to(p.k[layer_idx].dtype))
        p.v[layer_idx].index_copy_(0, plan.write, values.transpose(1, 2).reshape(B * n, H, D).to(p.v[layer_idx].dtype))
        k = p.k[layer_idx].index_select(0, plan.gather).view(view).transpose(1, 2)
        v = p.v[layer_idx].index_select(0, plan.gather).view(view).transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.policy.seen


def model_salt(info: ModelInfo) -> str:
    """What names the model and dtype in a block's hash."""
    cfg = info.config
    return f"{getattr(cfg, 'model_type', '?')}|{getattr(cfg, '_name_or_path', '')}|{info.num_layers}|" \
           f"{info.kv_heads}|{info.head_dim}|{info.dtype}"


def refuse_sliding(config) -> None:
    """The gathered view attends to every earlier position: a model with sliding-window layers is refused."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None) or ()
    if any("sliding" in str(t) for t in types):
        raise ConfigError("--cache paged: this model has sliding-window layers, which paged attention here does "
                          "not window; use --cache full")
