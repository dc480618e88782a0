"""The decoder's key/value cache: what incremental decoding keeps between steps.

Torch alone, like ``model.py`` beside it (an export with aiayn's own code ships both). The
model's layers read and extend it (``append_positions``); searches reorder, join, narrow
and trim it. Incremental decoding with it gives the same logits as a full forward pass (a
test).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values kept between decoding steps, one pair of dicts per decoder layer.

    ``layers[i]["self"]`` holds the self-attention K/V of all positions decoded so far,
    (B, H, t, d_k), grown by one position per step; ``layers[i]["cross"]`` holds the K/V
    of the encoder memory, (B', H, S, d_k), computed at the first step and reused. A beam
    search keeps those once per sentence (B' = B / beam: its beams share one memory, and
    their queries are folded onto it, ``fold_beams``); every other search once per row.

    ``start`` (None unless rows joined, see ``join``): (B,) the column where each row's
    target begins. The columns before it are padding that its self-attention never sees,
    and its positions in the sinusoid table count from it.

    Each step of a beam search copies the self-attention K/V (the beams change parents),
    and a search that sentences join and leave copies the cross-attention K/V too. Those
    copies go into buffers with spare rows and, for self-attention, a spare column (the
    dicts' ``"buffers"``; ``"k"``, ``"v"`` are views of them). The next position is then
    written into the spare column instead of concatenated (which copied everything a
    second time per step), and sentences that join are written into the spare rows (a
    join copies only its own rows). The figures: docs/translating.md#how-decoding-works.

    ``indirect`` keeps each self-attention K/V where it was written instead: a step's new
    position goes to the row's own slot of a ``Store``, and each row keeps, per position, the
    slot its beam's ancestor wrote it in, so a beam's reorder copies a small table of slots
    rather than every cached K/V. A kernel that reads keys through the table
    (aiayn.inference.native's step attention) then never gathers them; ``append_positions``
    gathers them for everyone else. ``positions``: the room each store has from the start
    (the model's ``max_len``), so that it seldom grows.
    """

    def __init__(self, n_layers: int, indirect: bool = False, positions: int = 256):
        self.layers: list[dict[str, dict[str, Tensor]]] = [
            {"self": {}, "cross": {}} for _ in range(n_layers)
        ]
        self.length = 0  # positions already decoded (the next position's index)
        self.start: Tensor | None = None
        self.indirect = indirect
        # A kernel's own account of where this cache lies (the int8 step's places), kept by
        # that kernel for as long as the cache lives: nothing here reads it.
        self.kernel_places = None
        if indirect:
            for layer in self.layers:
                layer["self"]["store"] = Store(positions)

    def positions(self) -> int | Tensor:
        """The position of the next token: one for all rows, or (B,) with ``start``."""
        return self.length if self.start is None else self.length - self.start

    def self_mask(self, T: int, device: torch.device) -> Tensor:
        """True-may-attend for the self-attention of T new queries after the t cached
        positions: query i sees the keys up to its own position t + i, (T, t + T); with
        ``start`` only its own row's keys from there on, (B, 1, T, t + T)."""
        keys = torch.arange(self.length + T, device=device)
        if T == 1 and self.start is not None:  # a step: every key is at or before the query
            return (keys >= self.start[:, None])[:, None, None, :]
        mask = keys <= torch.arange(self.length, self.length + T, device=device)[:, None]
        if self.start is None:
            return mask
        return mask & (keys >= self.start[:, None])[:, None, None, :]

    def reorder(self, index: Tensor, kinds: tuple[str, ...] = ("self", "cross"),
                within_sentences: bool = False, ancestry: Tensor | None = None) -> None:
        """Keep rows ``index`` of the cached tensors of ``kinds`` (beam search: the
        self-attention K/V follow the chosen beams, the cross-attention K/V of a sentence's
        beams the sentence). ``within_sentences``: each row takes a row of its own sentence
        (a beam step that every sentence survives), so keeps its ``start``. ``ancestry``: the
        slot table this reorder gives the indirect stores (``Store.reorder``), made already
        (by the int8 kernel's beam step)."""
        for layer in self.layers:  # every store follows the same rows: the first's table serves all
            for kind in kinds:
                if kind == "self" and self.indirect:
                    ancestry = layer[kind]["store"].reorder(index, ancestry)
                elif "k" in layer[kind]:
                    _select_rows(layer[kind], index, room=int(kind == "self"))
        if self.start is not None and "self" in kinds and not within_sentences:
            self.start = self.start.index_select(0, index)

    def follow(self, ancestry: Tensor) -> None:
        """Every row takes the past of the beam a fused beam step chose for it, every sentence
        staying: the indirect stores take ``ancestry``, the slot table that step made
        (``reorder``'s with ``within_sentences``, made already)."""
        for layer in self.layers:
            layer["self"]["store"].follow(ancestry)

    def join(self, other: KVCache, copies: int = 1) -> None:
        """Append the rows of ``other``, whose cross-attention K/V are filled and which has
        decoded nothing yet (sentences joining a running search at its next step), each
        memory row the memory of ``copies`` decoder rows (a sentence's beams). Their
        self-attention columns so far are zeros and masked (``start``); cross-attention K/V
        of other source lengths are zero-padded on the right (the caller's source padding
        mask hides them)."""
        if other.length:
            raise ValueError("only a cache that has decoded nothing can join another")
        joining = other.layers[0]["cross"]["k"]
        n, device = joining.size(0) * copies, joining.device
        if self.start is None:  # rows of its own so far all began at column 0
            rows = self.layers[0]["cross"].get("k")
            self.start = torch.zeros(0 if rows is None else rows.size(0) * copies,
                                     dtype=torch.long, device=device)
        self.start = torch.cat([self.start, torch.full((n,), self.length, dtype=torch.long,
                                                       device=device)])
        ancestry = None
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if "k" in mine["cross"]:
                _join_rows(mine["cross"], theirs["cross"]["k"], theirs["cross"]["v"])
            else:
                mine["cross"].update(k=theirs["cross"]["k"], v=theirs["cross"]["v"])
            if self.indirect:  # every store has the same slots: the first's table serves all
                ancestry = mine["self"]["store"].add_rows(n, ancestry)
            elif self.length:
                zeros = joining.new_zeros(n, *mine["self"]["k"].shape[1:])
                _join_rows(mine["self"], zeros, zeros, room=1)

    def narrow_memory(self, width: int) -> None:
        """Keep the first ``width`` source positions of the cross-attention K/V (the others
        are padding in every row)."""
        for layer in self.layers:
            cross = layer["cross"]
            for name in ("k", "v"):
                if name in cross:
                    cross[name] = cross[name][:, :, :width]

    def trim(self, columns: int) -> None:
        """Drop the first ``columns`` positions, padding of every row (all rows started
        later): what a search that sentences keep joining must do to stay bounded."""
        if columns <= 0:
            return
        for layer in self.layers:
            cache = layer["self"]
            if self.indirect:
                cache["store"].trim(columns)
                continue
            for name in ("k", "v"):
                cache[name] = cache[name][:, :, columns:]
            if "buffers" in cache:
                cache["buffers"] = tuple(b[:, :, columns:] for b in cache["buffers"])
        self.length -= columns
        self.start = self.start - columns


class Store:
    """One layer's self-attention K/V in an indirect cache: R row slots of L positions, kept
    position-major ((L, R, H, d_k): a step writes one block), ``k`` and ``v`` their (R, H, L,
    d_k) views. Row r of the search writes its positions into slot r and reads position j
    from slot ``ancestry[r, j]`` for the first ``ancestry.size(1)`` positions, from slot r
    after: a beam's reorder records where its new rows' pasts lie (``reorder``) instead of
    copying them. Every slot's positions from ``length`` on are unwritten, so the rows after a
    reorder can write there whichever rows they came from. Room for ``positions`` positions
    and spare rows from the start (pages never written take no memory), grown when full;
    every position a row reads, seen or masked, was written (``add_rows``), so is finite."""

    def __init__(self, positions: int = 256):
        self.keys: Tensor | None = None  # (L, R, H, d_k)
        self.values: Tensor | None = None
        self._whole: tuple[Tensor, Tensor] | None = None  # the buffers, trims' positions too
        self.ancestry: Tensor | None = None  # (B, c) slots, int64
        self.rows = 0  # B, the live rows
        self.length = 0  # positions written
        self.positions = positions

    @property
    def k(self) -> Tensor:
        return self.keys.permute(1, 2, 0, 3)

    @property
    def v(self) -> Tensor:
        return self.values.permute(1, 2, 0, 3)

    def append(self, k: Tensor, v: Tensor) -> None:
        """Write the new positions (B, H, T, d_k) of the B live rows into their own slots."""
        B, H, T, d = k.shape
        if self.keys is None:
            self.keys, self.values = self._whole = tuple(
                k.new_empty(max(self.positions, T), _spare_rows(B), H, d) for _ in range(2))
            self.ancestry = torch.empty(B, 0, dtype=torch.long, device=k.device)
            self.rows = B
        if B != self.rows:
            raise ValueError(f"{B} rows appended to a store of {self.rows}")
        self.reserve(B, self.length + T)
        self.keys[self.length:self.length + T, :B] = k.permute(2, 0, 1, 3)
        self.values[self.length:self.length + T, :B] = v.permute(2, 0, 1, 3)
        self.length += T

    def slots(self) -> Tensor:
        """(B, length): the slot each row reads each position from."""
        B, c = self.ancestry.shape
        own = torch.arange(B, device=self.ancestry.device)[:, None].expand(B, self.length - c)
        return torch.cat([self.ancestry, own], dim=1)

    def gather(self) -> tuple[Tensor, Tensor]:
        """Every live row's K/V of all positions, (B, H, length, d_k), gathered."""
        slots, positions = self.slots(), torch.arange(self.length, device=self.keys.device)
        return tuple(x[positions, slots].permute(0, 2, 1, 3) for x in (self.keys, self.values))

    def reorder(self, index: Tensor, ancestry: Tensor | None = None) -> Tensor | None:
        """Keep rows ``index``: row i reads row index[i]'s past. ``ancestry``: what this
        reorder gives a store of the same rows and length (``KVCache``'s other layers, which
        every write, join and trim keeps in step with this one), reused; returns its own."""
        if self.keys is None:
            return None
        if ancestry is None or ancestry.shape != (index.numel(), self.length):
            ancestry = self.slots().index_select(0, index)
        self.ancestry, self.rows = ancestry, index.numel()
        return ancestry

    def follow(self, ancestry: Tensor) -> None:
        """Every row reads its positions from the slots ``ancestry`` gives, (rows, length): a
        reorder whose table was made already (``KVCache.follow``)."""
        if self.keys is None or ancestry.shape != (self.rows, self.length):
            raise ValueError(f"a slot table of {tuple(ancestry.shape)} for a store of "
                             f"{self.rows} rows and {self.length} positions")
        self.ancestry = ancestry

    def add_rows(self, n: int, ancestry: Tensor | None = None) -> Tensor | None:
        """n rows that start now: their earlier positions, masked (``KVCache.start``), read
        the first row's (finite values; their own slots may hold another row's past).
        ``ancestry``: the slot table this gives a store of the same rows and length
        (``KVCache``'s other layers), reused; returns its own."""
        if self.keys is None:
            return None  # nothing written: the first ``append`` has them
        B = self.rows
        self.reserve(B + n, self.length)
        if not B:  # no row reads any slot: theirs are zeroed
            self.keys[:self.length, :n] = 0
            self.values[:self.length, :n] = 0
        if ancestry is None or ancestry.shape != (B + n, self.length):
            slots = self.slots()
            past = (slots[:1].expand(n, self.length) if B else
                    torch.arange(n, device=self.keys.device)[:, None].expand(n, self.length))
            ancestry = torch.cat([slots, past])
        self.ancestry, self.rows = ancestry, B + n
        return ancestry

    def trim(self, columns: int) -> None:
        """Drop the first ``columns`` positions of every row."""
        if self.keys is None:
            return
        self.keys, self.values = self.keys[columns:], self.values[columns:]
        self.ancestry = self.ancestry[:, min(columns, self.ancestry.size(1)):]
        self.length -= columns

    def reserve(self, rows: int, positions: int) -> None:
        """Room for ``rows`` rows of ``positions`` positions (the keys and values may move)."""
        L, R, H, d = self.keys.shape
        if rows <= R and positions <= L:
            return
        if rows <= R and self._to_front(positions):
            return
        R2 = _spare_rows(rows) if rows > R else R
        # (more rows alone: as many positions as the buffer had, trims' included, not only the
        # view's, whose end the next step might reach)
        L2 = max(positions, 2 * L) if positions > L else self._whole[0].size(0)
        self._whole = tuple(old.new_empty(L2, R2, H, d) for old in (self.keys, self.values))
        for old, new in zip((self.keys, self.values), self._whole, strict=True):
            new[:self.length, :R] = old[:self.length]
        self.keys, self.values = self._whole

    def _to_front(self, positions: int) -> bool:
        """Make room for ``positions`` positions in the buffers as they are, where the positions
        trims dropped at their front (``trim``) leave it: the kept ones move back there. A search
        that sentences keep joining trims at most steps, and taking a new buffer each time it
        reached the end cost a serving lane ~3% of its time at 32 clients (fresh pages, each
        touched anew: ~4x this copy). Returns whether it did (not where the gap is under a
        quarter of what moves: a new buffer, twice as long, then reaches its end later)."""
        whole = self._whole[0]
        front = whole.size(0) - self.keys.size(0)
        if positions > whole.size(0) or 4 * front < self.length:
            return False
        for buffer in self._whole:  # in pieces no longer than the gap: none overlaps its source
            for i in range(0, self.length, front):
                n = min(front, self.length - i)
                buffer[i:i + n] = buffer[front + i:front + i + n]
        self.keys, self.values = self._whole
        return True


def fold_beams(q: Tensor, sentences: int) -> Tensor:
    """(sentences * g, H, T, d_k) queries, g sentence-major rows per sentence, as (sentences,
    H, g * T, d_k): cross-attention then reads each sentence's memory K/V once for all its
    beams rather than once per beam (a beam step's largest memory traffic)."""
    n, H, T, d = q.shape
    if n % sentences:
        raise ValueError(f"{n} query rows cannot share the memory of {sentences} sentences")
    return q.view(sentences, n // sentences, H, T, d).transpose(1, 2).reshape(sentences, H, -1, d)


def unfold_beams(x: Tensor, rows: int) -> Tensor:
    """``fold_beams`` undone on what attention made of the folded queries: (sentences, H,
    g * T, e) -> (rows, H, T, e)."""
    sentences, H, gT, e = x.shape
    g = rows // sentences
    return x.view(sentences, H, g, gT // g, e).transpose(1, 2).reshape(rows, H, gT // g, e)


def append_positions(cache: dict, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A decoder layer's self-attention cache with the new positions' K/V (B, H, T, d_k)
    appended: the K/V of every position so far. Written into the buffers' spare column
    when they have one for exactly these (``_select_rows``), else concatenated; with an
    indirect cache's ``Store``, written to the rows' own slots and gathered."""
    if "store" in cache:
        store = cache["store"]
        store.append(k, v)
        return tuple(x.to(k.dtype) for x in store.gather())  # as given, whatever it keeps
    if "k" not in cache:
        cache["k"], cache["v"] = k, v
        return k, v
    (B, _, t, _), T = cache["k"].shape, k.size(2)
    buffers = cache.pop("buffers", None)
    if buffers is not None and buffers[0].size(2) == t + T and k.size(0) == B:
        for name, buffer, new in (("k", buffers[0], k), ("v", buffers[1], v)):
            buffer[:B, :, t:] = new
            cache[name] = buffer[:B]
        cache["buffers"] = buffers
    else:
        cache["k"] = torch.cat([cache["k"], k], dim=2)
        cache["v"] = torch.cat([cache["v"], v], dim=2)
    return cache["k"], cache["v"]


def _spare_rows(rows: int) -> int:
    """Rows to allocate for ``rows`` cached ones: half as many again, at least 8, for the
    sentences that join a search (pages never written take no memory on Linux)."""
    return rows + max(8, rows // 2)


def _select_rows(cache: dict, index: Tensor, room: int) -> None:
    """Keep rows ``index`` of a layer's cached K/V, copied into new buffers with spare rows
    and ``room`` spare columns."""
    B = index.numel()
    buffers = []
    for name in ("k", "v"):
        old = cache[name]
        _, H, t, d = old.shape
        buffer = old.new_empty(_spare_rows(B), H, t + room, d)
        cache[name] = torch.index_select(old, 0, index, out=buffer[:B, :, :t])
        buffers.append(buffer)
    cache["buffers"] = tuple(buffers)


def _join_rows(cache: dict, k: Tensor, v: Tensor, room: int = 0) -> None:
    """Append rows ``k``, ``v`` (n, H, S, d_k) to a layer's cached K/V, the narrower of the
    two zero-padded on the right: in the buffers' spare rows when they fit, else in new
    buffers (with spare rows and ``room`` spare columns)."""
    (B, H, width, d), n = cache["k"].shape, k.size(0)
    buffers = cache.get("buffers")
    if (buffers is None or buffers[0].size(0) < B + n or k.size(2) > width
            or buffers[0].size(2) < width + room):
        old, width = (cache["k"], cache["v"]), max(width, k.size(2))
        buffers = tuple(o.new_empty(_spare_rows(B + n), H, width + room, d) for o in old)
        for buffer, rows in zip(buffers, old, strict=True):
            buffer[:B, :, :rows.size(2)] = rows
            if rows.size(2) < width:
                buffer[:B, :, rows.size(2):width] = 0
    for name, buffer, new in (("k", buffers[0], k), ("v", buffers[1], v)):
        buffer[B:B + n, :, :new.size(2)] = new
        if new.size(2) < width:
            buffer[B:B + n, :, new.size(2):width] = 0
        cache[name] = buffer[:B + n, :, :width]
    cache["buffers"] = buffers
