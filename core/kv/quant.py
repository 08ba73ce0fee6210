"""``quant``: keys and values stored quantized (8, 4 or 2 bits packed, or fp8), dequantized when attention needs them.

``quant:bits=B,axis=tensor|token|channel|group|kivi[,group=G][,residual=R][,symmetric=true|false]
[,kivi_keys=chunks|window]``

Each layer's keys and each layer's values are one :class:`Stream`: quantized tokens, oldest first, then a
full-precision tail (the model's own dtype; a rotating layout stores its tail rotated, x R, and attention reads the
stream in that rotated space: see .rotation and .attention). A new token enters the tail; tokens leave it for the quantized part in
*blocks*:

* ``token``, ``group`` (and ``kivi`` values): a token is quantized alone (one scale per token, or per G channels of
  it), so it leaves the tail as soon as ``R`` newer tokens follow it: the last ``R`` tokens stay exact.
* ``channel``, ``tensor`` (and ``kivi`` keys with ``kivi_keys=window``): one scale spans ``G`` tokens (per channel,
  or per whole block of one row), so tokens leave in blocks of ``G`` once ``R + G`` are in the tail: the last ``R``
  tokens (up to ``R + G - 1``) stay exact.
* ``kivi`` keys (``kivi_keys=chunks``, the default): KIVI's own rule (Algorithm 1): the key tail is quantized whole,
  in blocks of ``G``, each time it holds ``R`` tokens, and emptied: after T tokens ``T mod R`` keys are exact (0 to
  R - 1). ``R`` must be a multiple of ``G``.

``kivi`` is KIVI's layout (Liu et al. 2024): keys per channel (their outliers live in fixed channels), values per
token in groups of G channels, asymmetric by default. Without ``group``, the keys' blocks are 32 tokens whatever the
head dim and the values' groups 32 channels, or the whole head where 32 does not divide head_dim. Every batch row
has its own scales (a beam never shares a scale with another beam). Scales and zero points are stored in float16
(bfloat16 for a bfloat16 model).

The tokens of the forward that adds them attend to their own full-precision keys and values; later forwards see
what the cache stores. The model's own sliding layers stay sliding (the window's tokens are kept, older ones dropped).

Capabilities: ``reorder``/``rows`` always (rows of codes, scales, zero points and tails are gathered, which is
exact). ``truncate`` only where the stored state after a rollback equals the state of never having fed the dropped
tokens: every token quantized alone and no residual window (``axis=token|group``, ``residual=0``). With a residual
window, rolled-back tokens would leave behind quantized tokens that should be exact again; with token-spanning
scales, a block's scale would have been set by dropped tokens. Those configurations are refused for ``speculate``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .attention import AttentionSpace
from .protocol import (
    ALIASES,
    KVPolicy,
    ModelInfo,
    boolean,
    choice,
    non_negative_int,
    positive_int,
    register,
)
from .quantize import QTensor, dequantize_view, fp8_supported, quantize_over
from .rotation import KINDS as ROTATIONS, Rotation, as_dtype, make_rotation

AXES = ("tensor", "token", "channel", "group", "kivi")
# how kivi's keys leave their exact tail: KIVI's chunks of R (T mod R exact), or a sliding window of R (R to R + G - 1)
KIVI_KEYS = ("chunks", "window")
DEFAULT_GROUP = 32
DEFAULT_KIVI_RESIDUAL = 32


def parse_bits(key: str, text: str):
    if text == "fp8":
        if not fp8_supported():
            raise ValueError(f"{key}=fp8 needs a torch with float8_e4m3fn; use bits=8")
        return "fp8"
    if text not in ("2", "4", "8"):
        raise ValueError(f"{key} must be 2, 4, 8 or fp8")
    return int(text)


# --- one layout: how a [B, H, n, D] chunk is viewed for its scales ----------------------------------------------------


class Layout:
    """How a stream quantizes: ``axis`` one of token|group|channel|tensor; ``group`` channels per group (group) or
    tokens per block (channel, tensor). Every view has the chunk axis (tokens or blocks) at dim 2."""

    def __init__(self, axis: str, group: int, bits, symmetric: bool, scale_dtype: torch.dtype,
                 rotation: Rotation | None = None):
        self.axis, self.group, self.bits, self.symmetric, self.scale_dtype = axis, group, bits, symmetric, scale_dtype
        self.rotation = rotation  # None, or x R quantized and deq R^T given back (see .rotation)
        self.block = group if axis in ("channel", "tensor") else 1  # tokens that share a scale

    @property
    def rotation_kind(self) -> str:
        return "none" if self.rotation is None else self.rotation.kind

    def quantize(self, x: Tensor) -> QTensor:
        """x [B, H, n, D], n a multiple of ``block`` (rotated first: x R, when the layout rotates)."""
        return self._code(self.rotate_in(x))

    def rotate_in(self, x: Tensor) -> Tensor:
        """What a stream stores, its exact window included: x R (float32 product rounded into x's dtype)."""
        return x if self.rotation is None else as_dtype(self.rotation.forward(x), x.dtype)

    def rotate_out(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored (rotated) tokens back in the model's channels: x R^T in ``dtype``."""
        return as_dtype(x, dtype) if self.rotation is None else as_dtype(self.rotation.back(x), dtype)

    def code(self, x: Tensor) -> QTensor:
        """Quantize tokens already in the stored space (:meth:`rotate_in`): without a rotation, :meth:`quantize`."""
        return self.quantize(x) if self.rotation is None else self._code(x)

    def _code(self, x: Tensor) -> QTensor:
        if self.axis == "token":
            view, dims = x, (-1,)  # scale [B, H, n, 1]
        elif self.axis == "group":
            view, dims = x.unflatten(-1, (x.shape[-1] // self.group, self.group)), (-1,)  # [B, H, n, D/G, 1]
        elif self.axis == "channel":
            view, dims = x.unflatten(2, (-1, self.block)), (-2,)  # [B, H, n/G, 1, D]
        else:  # tensor: one scale per row and block, over heads, tokens and channels
            view, dims = x.unflatten(2, (-1, self.block)), (1, 3, 4)  # [B, 1, n/G, 1, 1]
        return quantize_over(view, self.bits, dims, self.symmetric, self.scale_dtype)

    def tokens(self, q: QTensor) -> int:
        return q.codes.shape[2] * self.block

    def dequantize(self, q: QTensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        """[B, H, n, D] in ``dtype``; ``out``: a [B, H, n, D] tensor (a slice of a larger one, say) to write into.
        A rotating layout dequantizes in float32, rotates back (deq R^T) and rounds once into ``dtype``."""
        if self.rotation is not None:
            back = self.rotation.back(self._dequantize(q, torch.float32))
            if out is None:
                return back.to(dtype)
            return out.copy_(back)
        return self._dequantize(q, dtype, out)

    # the attention space (see .attention): a rotating layout's stored tokens read as they are (x R), the exact
    # ones and the query rotated into it, attention's output rotated back out of it; without a rotation, the identity

    @property
    def rotates(self) -> bool:
        return self.rotation is not None

    def space_width(self, head_dim: int) -> int:
        return head_dim

    def dequantize_in_space(self, q: QTensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        """deq(codes) as stored: x R for a rotating layout (no D x D product per token)."""
        return self._dequantize(q, dtype, out)

    def widen(self, x: Tensor) -> Tensor:
        """Stored exact tokens as attention reads them in the space (the stored space itself)."""
        return x

    query_to_space = rotate_in  # q . k = (q R) . (k R)

    def output_from_space(self, o: Tensor) -> Tensor:
        """Attention's output over values stored as v R, back: o R^T (sum_i a_i v_i R = (sum_i a_i v_i) R)."""
        return o if self.rotation is None else as_dtype(self.rotation.back(o), o.dtype)

    def _dequantize(self, q: QTensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        v = dequantize_view(q, dtype, None if out is None else self.view_of(out))
        if out is not None:
            return out
        if self.axis == "group":
            return v.flatten(-2)  # [B, H, n, D/G, G] -> [B, H, n, D]
        return v.reshape(v.shape[0], v.shape[1], -1, v.shape[-1])  # blocks [B, H, n/G, G, D] -> [B, H, n, D]

    def view_of(self, x: Tensor) -> Tensor:
        """x [B, H, n, D] seen as the quantized view (a view, no copy)."""
        if self.axis == "group":
            return x.unflatten(-1, (x.shape[-1] // self.group, self.group))
        if self.axis in ("channel", "tensor"):
            return x.unflatten(2, (-1, self.block))
        return x

    def nbytes_for(self, tokens: int, rows: int, heads: int, head_dim: int) -> int:
        """Bytes of ``tokens`` quantized tokens (a multiple of ``block``) without building them: codes packed along
        the view's last dim, one scale (and zero) per group."""
        if tokens == 0:
            return 0
        scale_bytes = torch.empty(0, dtype=self.scale_dtype).element_size() * (1 if self.symmetric else 2)
        packed = (lambda n: n) if self.bits in (8, "fp8") else (lambda n: -(-n * self.bits // 8))
        if self.axis == "token":
            return rows * heads * tokens * (packed(head_dim) + scale_bytes)
        if self.axis == "group":
            groups = head_dim // self.group
            return rows * heads * tokens * groups * (packed(self.group) + scale_bytes)
        blocks = tokens // self.block
        codes = rows * heads * tokens * packed(head_dim)
        scales = rows * heads * blocks * head_dim if self.axis == "channel" else rows * blocks
        return codes + scales * scale_bytes

    def describe(self) -> str:
        per = {"token": "per token", "group": f"per token, groups of {self.group} channels",
               "channel": f"per channel, blocks of {self.group} tokens",
               "tensor": f"per row, blocks of {self.group} tokens"}[self.axis]
        code = f"{self.bits}-bit {per}" if self.bits != "fp8" else f"fp8 e4m3 {per}"
        return code if self.rotation is None else f"{code}, rotated ({self.rotation.describe()})"


def cat_q(a: QTensor | None, b: QTensor) -> QTensor:
    if a is None:
        return b
    return QTensor(torch.cat([a.codes, b.codes], 2), torch.cat([a.scale, b.scale], 2),
                   None if a.zero is None else torch.cat([a.zero, b.zero], 2), a.bits, a.last)


def leaving_count(exact: int, residual: int, block: int, chunked: bool = False) -> int:
    """How many of a tail's ``exact`` tokens leave it for the quantized part. Sliding window (the default): the
    tokens beyond the last ``residual``, in whole blocks of ``block``. ``chunked`` (KIVI's keys, Algorithm 1 of Liu
    et al. 2024): the tail is flushed whole each time it holds ``residual`` tokens (``residual`` a multiple of
    ``block``), so it keeps ``exact mod residual``; with ``residual`` 0 the two rules agree (blocks leave as soon as
    they are whole)."""
    if chunked and residual:
        return exact // residual * residual
    return max((exact - residual) // block * block, 0)


class Stream:
    """The keys (or values) of one layer: quantized tokens, then a full-precision tail of the newest ones.
    ``chunked``: the tail leaves in chunks of ``residual`` tokens (:func:`leaving_count`)."""

    def __init__(self, layout: Layout, residual: int, tail_dtype: torch.dtype | None = None, chunked: bool = False):
        self.layout, self.residual, self.chunked = layout, residual, chunked
        self.tail_dtype = tail_dtype  # the exact tail's storage dtype (None: the model's, as fed)
        self._q: QTensor | None = None
        self._tail: Tensor | None = None
        # a member of a :class:`Joint` (its rows there, index ``index``) holds no tensors of its own; ``q`` and
        # ``tail`` then read its rows of the joint's, and setting either gives every member its own copy first
        self.joint: Joint | None = None
        self.index = 0

    @property
    def q(self) -> QTensor | None:
        """The quantized tokens (codes, scales, zero points)."""
        if self.joint is None:
            return self._q
        return None if self.joint.q is None else self.joint.q.map(self.joint.rows_of(self.index))

    @q.setter
    def q(self, value: QTensor | None) -> None:
        self.leave_joint()
        self._q = value

    @property
    def tail(self) -> Tensor | None:
        """The exact tail (stored rotated for a rotating layout)."""
        if self.joint is None:
            return self._tail
        return None if self.joint.tail is None else self.joint.rows_of(self.index)(self.joint.tail)

    @tail.setter
    def tail(self, value: Tensor | None) -> None:
        self.leave_joint()
        self._tail = value

    def leave_joint(self) -> None:
        """Before this stream's tensors change on their own: every member of its joint gets its own copy."""
        if self.joint is not None:
            self.joint.dissolve()

    def own(self, x: Tensor) -> Tensor:
        """A copy of ``x`` in the tail's storage dtype (its own storage, never a view)."""
        return x.to(self.tail_dtype or x.dtype, copy=True)

    @property
    def quantized(self) -> int:
        q = self._q if self.joint is None else self.joint.q  # token counts: every member's are the joint's
        return 0 if q is None else self.layout.tokens(q)

    @property
    def exact(self) -> int:
        tail = self._tail if self.joint is None else self.joint.tail
        return 0 if tail is None else tail.shape[2]

    @property
    def tokens(self) -> int:
        return self.quantized + self.exact

    def append(self, x: Tensor) -> None:
        leaving = self.enter(x)
        if leaving is not None:
            self.add(self.layout.code(leaving))

    @property
    def bypasses_tail(self) -> bool:
        """No residual window, one token a scale and an empty tail: every new token leaves at once, never passing
        through the tail."""
        return self.residual == 0 and self.layout.block == 1 and self.exact == 0

    def enter(self, x: Tensor) -> Tensor | None:
        """New tokens in (rotated first when the layout rotates: the exact tail is stored rotated too, so that
        attention in the rotated space reads it as it is): what leaves the tail for the quantized part, already
        rotated (None: nothing; all of them when the stream :attr:`bypasses_tail`)."""
        x = self.layout.rotate_in(x)
        if self.bypasses_tail:
            return x
        self.extend(x)
        return self.take_leaving()

    # clone/cat/slice-clone: the stream owns exactly the storage it reports (no view into a larger tensor)

    def extend(self, x: Tensor) -> None:
        """New tokens enter the exact tail."""
        self.tail = self.own(x) if self.tail is None else torch.cat([self.tail, self.own(x)], 2)

    def take_leaving(self) -> Tensor | None:
        """The tokens that leave the tail (:func:`leaving_count`; None: none leave); the tail keeps the rest."""
        leaving = leaving_count(self.exact, self.residual, self.layout.block, self.chunked)
        if leaving <= 0:
            return None
        out = self.tail[:, :, :leaving]
        self.tail = self.tail[:, :, leaving:].clone()
        return out

    def add(self, q: QTensor) -> None:
        """Quantized tokens join the stored ones (a first block is copied: it may be a slice of several streams')."""
        self.q = q.map(torch.clone) if self.q is None else cat_q(self.q, q)

    def states(self, dtype: torch.dtype) -> Tensor:
        """Every stored token, dequantized, then the exact tail: [B, H, tokens, D], in the model's channels."""
        parts = [] if self.q is None else [self.layout.dequantize(self.q, dtype)]
        parts += [] if self.tail is None else [self.layout.rotate_out(self.tail, dtype)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)

    def keep_first(self, n: int) -> None:
        """Drop every token from index ``n`` on (rollback). Exact only within the tail or for one-token blocks."""
        if n >= self.quantized:
            if self.tail is not None:
                self.tail = self.tail[:, :, : n - self.quantized].clone()
            return
        if self.layout.block != 1:
            raise ValueError("a rollback into a block of tokens that shares a scale cannot be exact")
        self.q = self.q.map(lambda t: t[:, :, :n].clone())
        self.tail = None

    def drop_first(self, n: int) -> int:
        """Forget the ``n`` oldest tokens where whole blocks allow (sliding layers); returns how many went."""
        blocks = min(n // self.layout.block, 0 if self.q is None else self.q.codes.shape[2])
        if blocks:
            self.q = self.q.map(lambda t: t[:, :, blocks:].clone())
        gone = blocks * self.layout.block
        if self.quantized == 0 and self.tail is not None and n > gone:
            self.tail = self.tail[:, :, n - gone :].clone()
            gone = n
        return gone

    def reorder(self, rows: Tensor) -> None:
        """This stream's rows gathered by ``rows`` (a member of a joint first gets its own copy: the cache reorders
        a whole joint at once, :meth:`Joint.reorder`)."""
        if self.q is not None:
            self.q = self.q.map(lambda t: t.index_select(0, rows.to(t.device)))
        if self.tail is not None:
            self.tail = self.tail.index_select(0, rows.to(self.tail.device))

    def nbytes(self) -> int:
        if self.joint is not None:
            return self.joint.share()
        tail = 0 if self._tail is None else self._tail.numel() * self._tail.element_size()
        return (0 if self._q is None else self._q.nbytes) + tail


class Joint:
    """The stored tokens of several streams of one kind (the keys of every layer, say) as one set of tensors: codes,
    scales, zero points and exact tail, each with the members' rows one after another on the batch dim (member i's
    rows [i B, (i + 1) B)). What the members store is what they would store alone, bit for bit (a scale never spans
    rows); appending to every member is then one operation a tensor instead of one a member. Its bytes are the
    members' together: each member reports its rows' share (every tensor's batch dim is members x B, so the shares
    are equal and add up to the storage exactly)."""

    def __init__(self, members: list[Stream], q: QTensor | None, tail: Tensor | None):
        self.members, self.q, self.tail = members, q, tail
        self.rows = (q.codes if q is not None else tail).shape[0] // len(members)
        for i, stream in enumerate(members):
            stream._q = stream._tail = None
            stream.joint, stream.index = self, i

    @staticmethod
    def of(streams: list[Stream]) -> Joint | None:
        """The joint whose members are exactly ``streams``, in order (None: they are not one joint)."""
        joint = streams[0].joint
        if joint is None or len(joint.members) != len(streams):
            return None
        return joint if all(a is b for a, b in zip(joint.members, streams)) else None

    def rows_of(self, index: int):
        """Member ``index``'s rows of a joint tensor (a view)."""
        return lambda t: t[index * self.rows : (index + 1) * self.rows]

    def share(self) -> int:
        tail = 0 if self.tail is None else self.tail.numel() * self.tail.element_size()
        return ((0 if self.q is None else self.q.nbytes) + tail) // len(self.members)

    def reorder(self, rows: Tensor) -> None:
        """Every member's rows gathered by ``rows`` (as many as each has) in one gather a tensor: member i's row j
        becomes its row rows[j], that is joint row i B + rows[j]."""
        index = (torch.arange(len(self.members), device=rows.device).unsqueeze(1) * self.rows + rows).flatten()

        def gather(t: Tensor) -> Tensor:
            return t.index_select(0, index.to(t.device))

        self.q = None if self.q is None else self.q.map(gather)
        self.tail = None if self.tail is None else gather(self.tail)

    def dissolve(self) -> None:
        """Every member back on its own: a copy of its rows (its own storage, exactly what it reports)."""
        for i, stream in enumerate(self.members):
            take = self.rows_of(i)
            stream._q = None if self.q is None else self.q.map(lambda t: take(t).clone())
            stream._tail = None if self.tail is None else take(self.tail).clone()
            stream.joint = None
        self.members, self.q, self.tail = [], None, None


# --- the streams of every layer at once -----------------------------------------------------------------------------
#
# A model whose layers all attend to every token stores the same number of tokens in every layer, so the layers'
# streams can be worked on side by side, their rows put one after another on the batch dim: each row keeps its own
# scales (a scale never spans rows), and dequantizing or quantizing is element-wise or reduces within a row, so the
# numbers are those of each stream alone, bit for bit, at a twelfth of the operations for twelve layers. A CPU pays a
# fixed cost per tensor operation that a small model's cache operations are dominated by. Nothing is kept between
# forwards but what each stream stores (the stored bytes are unchanged; each layer owns its tensors): at the first
# layer of a forward, the stored tokens of every layer are dequantized once into one workspace per stream kind, with
# room for the forward's new tokens (working memory of that forward, freed after it: for a float32 model as large as
# the full cache); each layer writes its new tokens into its room and attends over its rows; after the forward, the
# tokens that leave the exact tails are quantized in one pass straight from the workspace (where each layer's tail
# and new tokens already lie side by side) and each layer's new tail is copied out of it.


def workable_together(streams: list[Stream]) -> bool:
    """Whether the streams can be worked on together: same layout, same quantized and exact token counts (the same
    code and tail shapes), not empty."""
    if Joint.of(streams) is not None:  # one joint: alike by construction, never empty
        return True
    first = streams[0]
    if first.q is None and first.tail is None:
        return False
    shape = None if first.q is None else first.q.codes.shape
    tail = None if first.tail is None else first.tail.shape
    return all(s.layout is first.layout and (None if s.q is None else s.q.codes.shape) == shape and
               (None if s.tail is None else s.tail.shape) == tail for s in streams)


def quantized_together(streams: list[Stream]) -> QTensor:
    """The quantized tokens of every stream as one QTensor, their rows one after another (a joint's own: no copy)."""
    joint = Joint.of(streams)
    if joint is not None:
        return joint.q
    qs = [s.q for s in streams]
    return QTensor(torch.cat([q.codes for q in qs]), torch.cat([q.scale for q in qs]),
                   None if qs[0].zero is None else torch.cat([q.zero for q in qs]), qs[0].bits, qs[0].last)


def tails_together(streams: list[Stream]) -> Tensor:
    """The exact tails of every stream as one tensor, their rows one after another (a joint's own: no copy)."""
    joint = Joint.of(streams)
    return joint.tail if joint is not None else torch.cat([s.tail for s in streams])


def stored_with_room(streams: list[Stream], new: Tensor) -> Tensor | None:
    """Every stream's stored tokens (dequantized, then the exact tail) with room for this forward's ``new`` tokens
    after them: one [L * B, H, stored + n, D] tensor in ``new``'s dtype, the quantized tokens of all streams
    dequantized in one pass straight into it; stream i's rows are [i B, (i + 1) B). None when the streams differ
    (layout, quantized or exact token counts) or store nothing: each is then worked on alone."""
    if not workable_together(streams):
        return None
    first = streams[0]
    rows, heads, n, dim = new.shape
    quantized, exact = first.quantized, first.exact
    out = torch.empty(len(streams) * rows, heads, quantized + exact + n, dim, dtype=new.dtype, device=new.device)
    if quantized:
        first.layout.dequantize(quantized_together(streams), new.dtype, out=out[:, :, :quantized])
    if exact:  # without a rotation the copy converts the tails' dtype into the model's (one rounding, as .to)
        tails = tails_together(streams)
        out[:, :, quantized : quantized + exact] = first.layout.rotate_out(tails, new.dtype) \
            if first.layout.rotates else tails
    return out


def stored_in_space(streams: list[Stream], new: Tensor) -> Tensor | None:
    """:func:`stored_with_room` for attention in the layout's space (see .attention): [L * B, H, stored + n, W],
    the quantized tokens dequantized as stored (x R, no product per token), the exact tails as stored (rotated
    when they entered), room for the new tokens (each layer writes its own, rotated: :meth:`LayersTogether.update`).
    W > D (turbo's prod keys): the exact tokens' extra dims are zero (no residual). None as
    :func:`stored_with_room`."""
    if not workable_together(streams):
        return None
    first = streams[0]
    rows, heads, n, dim = new.shape
    quantized, exact = first.quantized, first.exact
    width = first.layout.space_width(dim)
    space = torch.empty(len(streams) * rows, heads, quantized + exact + n, width, dtype=new.dtype, device=new.device)
    if quantized:
        first.layout.dequantize_in_space(quantized_together(streams), new.dtype, out=space[:, :, :quantized])
    if width > dim:
        space[:, :, quantized:, dim:] = 0
    if exact:
        space[:, :, quantized : quantized + exact, :dim] = tails_together(streams)
    return space


def append_together(streams: list[Stream], new: list[Tensor]) -> None:
    """:meth:`Stream.append` for each stream; the tokens leaving the tails quantized in one pass when every stream
    has the same layout and the same number leaving (else each on its own)."""
    leaving = [stream.enter(x) for stream, x in zip(streams, new)]
    if all(t is None for t in leaving):
        return
    shapes = {None if t is None else t.shape for t in leaving}
    if len(shapes) == 1 and len({id(s.layout) for s in streams}) == 1 and len(streams) > 1:
        rows = leaving[0].shape[0]
        q = streams[0].layout.code(torch.cat(leaving))
        for stream, part in zip(streams, split_q(q, rows)):
            stream.add(part)
        return
    for stream, t in zip(streams, leaving):
        if t is not None:
            stream.add(stream.layout.code(t))


def split_q(q: QTensor, rows: int) -> list[QTensor]:
    """``q``'s rows in parts of ``rows`` (views), one per stream: what ``q.map`` slicing each part gives."""
    zeros = [None] * (q.codes.shape[0] // rows) if q.zero is None else q.zero.split(rows)
    return [QTensor(c, s, z, q.bits, q.last) for c, s, z in zip(q.codes.split(rows), q.scale.split(rows), zeros)]


def leaving_of(stream: Stream, arriving: int) -> int:
    """How many tokens leave the tail for the quantized part when ``arriving`` tokens enter it (what
    :meth:`Stream.enter` takes from the tail, in whole blocks beyond the last ``residual``)."""
    if stream.bypasses_tail:
        return arriving
    return leaving_count(stream.exact + arriving, stream.residual, stream.layout.block, stream.chunked)


def commit_from_room(groups: list[tuple[list[Stream], Tensor]]) -> None:
    """:func:`append_together` for streams worked on together, taken from this forward's tensors (see
    :func:`stored_with_room`, :func:`stored_in_space`), where every stream's exact tail and new tokens already lie
    side by side: the tokens that leave are quantized in one pass straight from there, and the new tails are copied
    out of it, each group's streams then stored as one :class:`Joint` (one concatenation a tensor for all of them,
    one copy for all their tails). ``groups``: (the streams, their recent tokens [L * B, H, exact + n, D] as stored:
    rotated for a rotating layout), one group, or two of the same layout and token counts (keys and values laid
    out alike), quantized in one pass together (their rows one after another)."""
    first = groups[0][0][0]
    recents = [recent for _, recent in groups]  # each [L * B, H, exact + n, D]
    leaving = leaving_of(first, recents[0].shape[2] - first.exact)
    keeps_tail = not first.bypasses_tail
    parts: list[QTensor | None] = [None] * len(groups)
    if leaving:
        views = [r[:, :, :leaving] for r in recents]
        if keeps_tail and first.tail_dtype is not None:  # they passed through the tail: its rounding, as alone
            views = [v.to(first.tail_dtype) for v in views]
        q = first.layout.code(views[0] if len(views) == 1 else torch.cat(views))
        parts = split_q(q, recents[0].shape[0])  # each group's rows
    for (streams, recent), part in zip(groups, parts):
        join(streams, part, first.own(recent[:, :, leaving:]) if keeps_tail else None)


def join(streams: list[Stream], new: QTensor | None, tail: Tensor | None) -> None:
    """The streams (worked on together) store their quantized tokens then ``new`` (None: none arrive), and ``tail``
    as their exact tails, all as one :class:`Joint`."""
    joint = Joint.of(streams)
    old = quantized_together(streams) if streams[0].quantized else None
    if new is None:
        q = old
    else:
        q = new.map(torch.clone) if old is None else cat_q(old, new)  # a first block may be a view: copied
    if joint is not None:
        joint.q, joint.tail = q, tail
        return
    for stream in streams:
        stream.leave_joint()  # (after their tokens were read)
    Joint(streams, q, tail)


class LayersTogether:
    """The cache's layers worked on together through one forward (see above): ``update`` is what a layer's
    attention calls; ``commit`` (after the forward) appends what it added."""

    def __init__(self, layers: list, space=None):
        self.layers = layers
        self.space = space  # the policy's attention space (see .attention), or None
        self.in_space = False  # this forward attends in the space
        self.stored: tuple | None = None  # this forward's keys and values, all layers (in the space, or not)
        self.views: tuple[tuple | None, tuple | None] = (None, None)  # per stream kind: (layer views, their rooms)
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}

    def update(self, index: int, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        layer = self.layers[index]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if self.stored is None:
            self.in_space = self.space is not None and self.space.on
            build = stored_in_space if self.in_space else stored_with_room
            self.stored = (build([la.k for la in self.layers], key_states),
                           build([la.v for la in self.layers], value_states))
            rows, n = key_states.shape[0], key_states.shape[2]
            self.views = tuple(None if t is None else split_rooms(t, rows, n) for t in self.stored)
        self.pending[index] = (key_states, value_states)
        layer.cumulative_length += key_states.shape[-2]
        if self.in_space:
            return (self._in_space(self.views[0], layer.k, index, key_states),
                    self._in_space(self.views[1], layer.v, index, value_states))
        return (self._with(self.views[0], layer.k, index, key_states),
                self._with(self.views[1], layer.v, index, value_states))

    @staticmethod
    def _in_space(views: tuple | None, stream: Stream, index: int, new: Tensor) -> Tensor:
        """This forward's tokens after the stored ones, in the attention space: rotated into the layer's room
        (O(n D^2): never a stored token)."""
        if views is None:
            return layer_states_in_space(stream, new)
        mine, rooms = views
        room = rooms[index]
        if room.shape[-1] != new.shape[-1]:  # turbo's prod keys: the new tokens' extra dims stay zero
            room = room[..., : new.shape[-1]]
        room.copy_(stream.layout.rotate_in(new))
        return mine[index]

    @staticmethod
    def _with(views: tuple | None, stream: Stream, index: int, new: Tensor) -> Tensor:
        """This forward's tokens in full precision after the stored ones: written into their room, or (streams
        that differ) concatenated."""
        if views is None:
            return layer_states(stream, new)
        mine, rooms = views
        rooms[index].copy_(new)
        return mine[index]

    def commit(self) -> None:
        done = sorted(self.pending)
        layers = [self.layers[i] for i in done]
        rooms = []  # (streams, stored) committed from the workspace
        for kind, stored in enumerate(self.stored or (None, None)):
            streams = [la.k if kind == 0 else la.v for la in layers]
            # from the workspace when it holds what is stored (in the space, or a layout without rotation); a
            # rotating layout's workspace outside the space is rotated back: its new tokens are appended instead
            if stored is not None and len(done) == len(self.layers) and \
                    (self.in_space or not streams[0].layout.rotates):
                dim = self.pending[done[0]][kind].shape[-1]
                rooms.append((streams, stored[:, :, streams[0].quantized :, :dim]))
            else:
                append_together(streams, [self.pending[i][kind] for i in done])
        if len(rooms) == 2 and alike(rooms[0][0][0], rooms[1][0][0]):
            commit_from_room(rooms)  # keys and values quantized in one pass
        else:
            for room in rooms:
                commit_from_room([room])
        self.stored, self.views, self.pending, self.in_space = None, (None, None), {}, False


def alike(a: Stream, b: Stream) -> bool:
    """Two streams quantized the same way that hold the same numbers of quantized and exact tokens."""
    la, lb = a.layout, b.layout
    return (la.axis, la.group, la.bits, la.symmetric, la.scale_dtype, la.rotation_kind, a.residual, a.chunked,
            a.tail_dtype, a.quantized, a.exact) == \
        (lb.axis, lb.group, lb.bits, lb.symmetric, lb.scale_dtype, lb.rotation_kind, b.residual, b.chunked,
         b.tail_dtype, b.quantized, b.exact)


def split_rooms(stored: Tensor, rows: int, n: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Each layer's rows of ``stored`` (views), and the room for its ``n`` new tokens at their end (views)."""
    return stored.split(rows), stored[:, :, stored.shape[2] - n :].split(rows)


def layer_states_in_space(stream: Stream, new: Tensor) -> Tensor:
    """:func:`layer_states` in the attention space: the quantized tokens and the exact tail as stored, then
    ``new`` rotated into the space."""
    layout = stream.layout
    parts = [] if stream.q is None else [layout.dequantize_in_space(stream.q, new.dtype)]
    parts += [] if stream.tail is None else [layout.widen(stream.tail.to(new.dtype))]
    parts.append(layout.widen(layout.rotate_in(new)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def layer_states(stream: Stream, new: Tensor) -> Tensor:
    """One stream's stored tokens, dequantized, then ``new``: what attention sees."""
    if stream.tokens == 0:
        return new
    return torch.cat([stream.states(new.dtype), new], 2)


def held_after(tokens: int, residual: int, block: int, window: int | None = None,
               chunked: bool = False) -> tuple[int, int]:
    """(quantized, exact) tokens a stream holds after ``tokens`` tokens, mirroring :class:`Stream` without tensors
    (sliding layers: fed one token a forward, the decode path). Exact tokens: R + (T - R) mod block once T >= R;
    ``chunked`` (R > 0): T mod R."""
    if window is None:
        if chunked and residual:
            exact = tokens % residual
        else:
            exact = tokens if tokens < residual else residual + (tokens - residual) % block
        return tokens - exact, exact
    quantized = exact = 0
    for _ in range(tokens):
        exact += 1
        leaving = leaving_count(exact, residual, block, chunked)
        if leaving > 0:
            quantized, exact = quantized + leaving, exact - leaving
        extra = quantized + exact - (window - 1)
        if extra > 0:
            gone = min(extra // block, quantized // block) * block
            quantized -= gone
            if quantized == 0 and extra > gone:
                exact -= extra - gone
    return quantized, exact


# --- the cache layer the model calls ------------------------------------------------------------------------------


def _layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class QuantLayerMixin:
    """One attention layer's quantized keys and values (the transformers cache-layer interface: ``update`` returns
    the states attention uses; ``get_mask_sizes`` says how many that is). ``window``: the model's sliding window
    (the layer keeps its last window - 1 tokens, as transformers' sliding layers do); ``hold``: never evict, so a
    rollback finds every token it needs (runs that roll back; attention still sees only the window)."""

    def setup(self, keys: Stream, values: Stream, window: int | None, hold: bool, space=None) -> None:
        self.k, self.v, self.window, self.hold = keys, values, window, hold
        self.space = space  # the policy's attention space (see .attention), or None
        self.is_sliding = window is not None
        self.cumulative_length = 0  # tokens this layer has seen

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def visible(self, query_length: int) -> int:
        """Tokens attention sees in a forward of ``query_length`` new tokens (the new ones included)."""
        if self.window is None:
            return self.cumulative_length + query_length
        return min(self.cumulative_length, self.window - 1) + query_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = self.visible(query_length)
        offset = 0 if self.window is None else max(self.cumulative_length - self.window + 1, 0)
        return kv_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.visible(key_states.shape[-2])
        # this forward's tokens in full precision after the stored ones, dequantized
        keys = self._with(self.k, key_states)
        values = self._with(self.v, value_states)
        self.k.append(key_states)
        self.v.append(value_states)
        self.cumulative_length += key_states.shape[-2]
        if self.window is not None and not self.hold:
            self.evict()
        return keys[:, :, -n:], values[:, :, -n:]

    def _with(self, stream: Stream, new: Tensor) -> Tensor:
        if self.space is not None and self.space.on:
            return layer_states_in_space(stream, new)
        return layer_states(stream, new)

    def evict(self) -> None:
        """Sliding layers: forget tokens older than the last window - 1 (whole blocks at a time)."""
        for stream in (self.k, self.v):
            extra = stream.tokens - (self.window - 1)
            if extra > 0:
                stream.drop_first(extra)

    def keep_first(self, seen: int) -> None:
        """Roll back to ``seen`` tokens."""
        for stream in (self.k, self.v):
            stream.keep_first(seen - (self.cumulative_length - stream.tokens))
        self.cumulative_length = seen

    def crop(self, tokens_to_remove: int) -> None:
        self.keep_first(self.cumulative_length - abs(tokens_to_remove))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        for stream in (self.k, self.v):
            stream.reorder(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices))

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()


_layer_class = None


def quant_layer_class():
    """The layer class, built on transformers' DynamicLayer on first use (so importing decodelab stays light)."""
    global _layer_class
    if _layer_class is None:
        _layer_class = type("QuantLayer", (QuantLayerMixin, _layer_base()), {})
    return _layer_class


class QuantCacheMixin:
    """The model's cache object: with ``together`` set (every layer full attention), a layer's update goes through
    it; else each layer updates on its own."""

    together: LayersTogether | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.together is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return self.together.update(layer_idx, key_states, value_states)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Every layer's rows gathered by ``beam_idx``: a joint store (see :class:`Joint`) once for all its members
        (one gather a tensor), a stream on its own by itself."""
        done: set[int] = set()
        for layer in self.layers:
            for stream in (layer.k, layer.v):
                joint = stream.joint
                if joint is None or beam_idx.numel() != joint.rows:
                    stream.reorder(beam_idx)
                elif id(joint) not in done:
                    joint.reorder(beam_idx)
                    done.add(id(joint))


_cache_class = None


def quant_cache_class():
    """The cache class, built on transformers' DynamicCache on first use."""
    global _cache_class
    if _cache_class is None:
        from transformers import DynamicCache

        _cache_class = type("QuantCache", (QuantCacheMixin, DynamicCache), {})
    return _cache_class


# --- the policy ----------------------------------------------------------------------------------------------------


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


# The exact window (the last ``residual`` tokens) is stored in the model's dtype (``residual_dtype=model``, the
# default: the window bit for bit) or in 16 bits (``16``: float16, bfloat16 for a bfloat16 model; a float16 or
# bfloat16 model's window is unchanged either way). KIVI keeps its window in the 16-bit precision its models run in,
# so the ``int4-kivi`` and ``int2-kivi`` aliases say ``residual_dtype=16``: a float32 model's window is then rounded
# to float16 (its keys and values lose float32's last 13 mantissa bits, nothing else), and its bytes are KIVI's.
RESIDUAL_DTYPES = ("model", "16")


def exact_window_dtype(residual_dtype: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The tail's storage dtype; None: the model's own (no conversion)."""
    wanted = scale_dtype_for(model_dtype) if residual_dtype == "16" else model_dtype
    return None if wanted == model_dtype else wanted


@register
class QuantPolicy(KVPolicy):
    name = "quant"
    capabilities = frozenset({"truncate", "reorder", "rows"})
    summary = ("quantized keys and values (8/4/2 bits packed, fp8), per tensor, token, channel, group or kivi; "
               "rolls back only per token/group with residual=0")
    params = {"bits": parse_bits, "axis": choice(*AXES), "group": positive_int, "residual": non_negative_int,
              "symmetric": boolean, "rotate": choice(*ROTATIONS), "rotate_keys": choice(*ROTATIONS),
              "rotate_values": choice(*ROTATIONS), "residual_dtype": choice(*RESIDUAL_DTYPES),
              "kivi_keys": choice(*KIVI_KEYS)}
    # what an engine's reading turns on when the spec does not say (--semantics): llama.cpp rotates the keys and the
    # values of a quantized cache with a Hadamard matrix (llama.cpp's attention rotation for quantized K/V types)
    engine_defaults = {"llamacpp": {"rotate_keys": "hadamard", "rotate_values": "hadamard"}}

    @staticmethod
    def check_options(values: dict) -> dict:
        """Fill the defaults so the spec names every setting: bits=8, axis=token, residual 0 (32 for kivi),
        symmetric for bits=8 and fp8, asymmetric (zero points) for 4 and 2 bits. ``rotate=K`` is shorthand for
        ``rotate_keys=K,rotate_values=K`` (either given alone wins for its stream); no rotation is named only when
        asked for (the spec stays as before for a cache that does not rotate)."""
        out = dict(values)
        both = out.pop("rotate", None)
        if both is not None:
            out.setdefault("rotate_keys", both)
            out.setdefault("rotate_values", both)
        out.setdefault("bits", 8)
        out.setdefault("axis", "token")
        out.setdefault("residual", DEFAULT_KIVI_RESIDUAL if out["axis"] == "kivi" else 0)
        out.setdefault("symmetric", out["bits"] in (8, "fp8"))
        if out["bits"] == "fp8" and not out["symmetric"]:
            raise ValueError("bits=fp8 is symmetric (no zero point); drop symmetric=false")
        if "group" in out and out["axis"] == "token":
            raise ValueError("group applies to axis=group, channel, tensor or kivi, not to axis=token")
        if "kivi_keys" in out and out["axis"] != "kivi":
            raise ValueError(f"kivi_keys applies to axis=kivi, not to axis={out['axis']}")
        return out

    @staticmethod
    def capabilities_for(options: dict) -> frozenset[str]:
        caps = {"reorder", "rows"}
        if options.get("axis", "token") in ("token", "group") and options.get("residual", 0) == 0:
            caps.add("truncate")
        return frozenset(caps)

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 bits=8, axis: str = "token", group: int | None = None, residual: int = 0, symmetric: bool = True,
                 rotate_keys: str = "none", rotate_values: str = "none", residual_dtype: str = "model",
                 kivi_keys: str = "chunks"):
        super().__init__(info, capacity, needs)
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        self.bits, self.axis, self.residual, self.symmetric = bits, axis, residual, symmetric
        self.rotations = {"key": make_rotation(rotate_keys, info.head_dim),
                          "value": make_rotation(rotate_values, info.head_dim)}
        self.tail_dtype = exact_window_dtype(residual_dtype, info.dtype)
        self.group = self._group(group, info.head_dim)
        # kivi's keys are quantized per channel in blocks of G tokens: any head_dim takes the default 32 (the
        # values' channel groups fall back to the whole head where 32 does not divide head_dim; the keys need not)
        self.key_block = (DEFAULT_GROUP if group is None else group) if axis == "kivi" else self.group
        # KIVI's keys leave their tail in chunks of R (each quantized in blocks of G): R must be a multiple of G
        self.chunked = {"key": axis == "kivi" and kivi_keys == "chunks" and residual > 0, "value": False}
        if self.chunked["key"] and residual % self.key_block:
            raise ConfigError(f"--cache quant:axis=kivi: residual={residual} must be a multiple of group="
                              f"{self.key_block} (keys leave the exact window in chunks of residual tokens, quantized "
                              "in blocks of group tokens); or kivi_keys=window")
        missing = set(needs) - self.capabilities_for({"axis": axis, "residual": residual})
        if missing:
            raise ConfigError(f"--cache quant: this run needs the cache to {sorted(missing)[0]}, which "
                              f"axis={axis},residual={residual} cannot do exactly")
        sd = scale_dtype_for(info.dtype)
        layouts = {"key": self._layout("key", sd), "value": self._layout("value", sd)}
        self.layouts = layouts
        # a rotating layout attends in its rotated space when the runtime wraps the model's attention (.attention)
        self.attention_space = AttentionSpace(layouts["key"], layouts["value"]) \
            if layouts["key"].rotates or layouts["value"].rotates else None
        template = quant_cache_class()(config=info.config)
        layers = []
        for i, layer in enumerate(template.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                window = layer.sliding_window
            elif type(layer) is DynamicLayer:
                window = None
            else:
                raise ConfigError(f"--cache quant: layer {i} of this model is a {type(layer).__name__}; quant "
                                  "handles full and sliding attention layers only")
            new = quant_layer_class()()
            new.setup(self.stream("key"), self.stream("value"), window,
                      hold="truncate" in needs, space=self.attention_space)
            new.is_croppable = "truncate" in self.capabilities_for({"axis": axis, "residual": residual})
            layers.append(new)
        self.model_cache = template
        template.layers = layers
        if all(layer.window is None for layer in layers):  # every layer holds every token: work on them together
            template.together = LayersTogether(layers, self.attention_space)

    def after_forward(self, n: int) -> None:
        if self.model_cache.together is not None:
            self.model_cache.together.commit()
        super().after_forward(n)

    def stream(self, which: str) -> Stream:
        """A new, empty stream of this policy's keys (``which="key"``) or values."""
        return Stream(self.layouts[which], self.residual, self.tail_dtype, self.chunked[which])

    def _group(self, group: int | None, head_dim: int) -> int:
        """Channels per group (axis=group; kivi values) must divide head_dim; the default is 32, or head_dim when
        32 does not divide it. For token blocks (axis=channel|tensor) any size works; default 32."""
        splits_channels = self.axis in ("group", "kivi")
        if group is None:
            return head_dim if splits_channels and head_dim % DEFAULT_GROUP else DEFAULT_GROUP
        if splits_channels and head_dim % group:
            raise ConfigError(f"--cache quant:group={group}: must divide the model's head_dim ({head_dim})")
        return group

    def _layout(self, which: str, scale_dtype: torch.dtype) -> Layout:
        axis, group = self.axis, self.group
        if axis == "kivi":
            axis, group = ("channel", self.key_block) if which == "key" else ("group", self.group)
        return Layout(axis, group, self.bits, self.symmetric, scale_dtype, self.rotations[which])

    @property
    def stored(self) -> int:
        return max((max(layer.k.tokens, layer.v.tokens) for layer in self.model_cache.layers), default=0)

    def truncate(self, seen: int) -> None:
        drop = self.seen - seen
        if drop < 0:
            raise ValueError(f"cannot truncate a cache that has seen {self.seen} tokens to {seen}")
        if drop:
            for layer in self.model_cache.layers:
                if layer.is_initialized:
                    layer.keep_first(seen)
            self.seen = seen

    def reorder(self, rows: Tensor) -> None:
        self.model_cache.reorder_cache(rows)

    def layer_nbytes(self) -> list[int]:
        return [layer.nbytes() for layer in self.model_cache.layers]

    def bytes_at(self, tokens: int, rows: int = 1, exact_dtype: torch.dtype | None = None) -> int:
        """Projected bytes of this cache after ``tokens`` tokens in each of ``rows`` rows, from the layouts' byte
        formulas (tests check them against the stored tensors): per layer, keys and values, quantized + exact.
        ``exact_dtype``: the dtype of the exact window (default the model's, as stored); float16 gives the bytes of
        the same layout in a float16 model (scales and zero points are float16 either way but for bfloat16)."""
        info = self.info
        exact_bytes = torch.empty(0, dtype=exact_dtype or self.tail_dtype or info.dtype).element_size()
        total = 0
        for layer in self.model_cache.layers:
            window = None if layer.hold else layer.window
            for which, layout in self.layouts.items():
                quantized, exact = held_after(tokens, self.residual, layout.block, window, self.chunked[which])
                total += layout.nbytes_for(quantized, rows, info.kv_heads, info.head_dim)
                total += rows * info.kv_heads * exact * info.head_dim * exact_bytes
        return total

    def describe(self) -> dict:
        out = super().describe()
        layers = self.model_cache.layers
        if layers:  # exact_tokens: the most positions any layer holds in the model's dtype (a sliding layer, fewer)
            out.update(keys=self.layouts["key"].describe(), values=self.layouts["value"].describe(),
                       exact_tokens=max(max(layer.k.exact, layer.v.exact) for layer in layers))
            if self.tail_dtype is not None:  # the exact window is not in the model's dtype: say in which
                out["exact_dtype"] = str(self.tail_dtype).removeprefix("torch.")
        return out


# short names (the long form keeps working)
ALIASES.update({
    "int8": "quant:bits=8,axis=token,symmetric=true",
    "fp8": "quant:bits=fp8,axis=token",
    "int4": "quant:bits=4,axis=group",  # group: 32 channels, or the whole head when 32 does not divide head_dim
    "int4-kivi": "quant:bits=4,axis=kivi,residual=32,residual_dtype=16",  # KIVI: the exact window in 16 bits
    "int2-kivi": "quant:bits=2,axis=kivi,residual=32,residual_dtype=16",
})
