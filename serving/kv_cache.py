"""A paged latent-KV block pool for one DP group: ref-counted blocks and prefix reuse by hashing full blocks.

A full block (``block_size`` computed positions) can be registered under a chain hash of (parent block's hash, the
block's tokens), so a block's hash stands for the whole prefix up to its end. A later request whose tokens start with
the same full blocks takes references on them instead of recomputing. Freed blocks keep their hash until they are
handed out again (least recently freed first), so finished requests' prefixes stay reusable while memory allows.
Partial blocks are never shared: a sequence only ever writes into blocks it alone holds.
"""
from __future__ import annotations

from collections import OrderedDict

from ascend_emu.errors import ArgumentError, CapacityError

BLOCK_SIZES = (16, 128)        # tokens per block (the two sizes)
ROOT_HASH = -1                 # parent hash of a sequence's first block


def block_hash(parent_hash: int, tokens) -> int:
    """Chain hash of a full block. Deterministic across runs (ints and tuples of ints hash without salt); collisions
    are harmless because the pool also compares the stored (parent, tokens) key."""
    return hash((parent_hash, tuple(tokens)))


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token positions. ``usage``: fraction of blocks held by a request."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ArgumentError(f"num_blocks={num_blocks!r} must be an int >= 1")
        if block_size not in BLOCK_SIZES:
            raise ArgumentError(f"block_size={block_size!r}: use one of {BLOCK_SIZES} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ref = [0] * num_blocks
        self._free = OrderedDict((b, None) for b in range(num_blocks))   # allocation order: oldest free first
        self._key = [None] * num_blocks            # (parent hash, tokens) of a registered block
        self._hash = [None] * num_blocks
        self._cached: dict[int, int] = {}          # chain hash -> block id

    # ---- counts -------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no holder (cached-but-free blocks included: they are evicted on allocation)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold ``num_positions`` KV positions."""
        return -(-num_positions // self.block_size)

    # ---- allocation ---------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list:
        """Take ``n`` fresh blocks (ref count 1), evicting their old hashes."""
        if n < 0:
            raise ArgumentError(f"allocate(n={n}): n must be >= 0")
        if n > len(self._free):
            raise CapacityError(f"KV pool: {n} blocks asked, {len(self._free)} free of {self.num_blocks} "
                                f"(block_size {self.block_size})")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._uncache(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: list) -> None:
        """Take a reference on registered (cached) blocks, e.g. a prefix found by ``match_prefix``."""
        for b in blocks:
            self._check_id(b)
            if self._hash[b] is None:
                raise ArgumentError(f"acquire: block {b} holds no registered full block (only cached blocks are shared)")
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def free(self, blocks: list) -> None:
        """Drop one reference on each block; blocks reaching 0 become free (hash kept). Freed in reverse so a
        sequence's tail is evicted before its prefix."""
        for b in blocks:
            self._check_id(b)
            if self._ref[b] <= 0:
                raise ArgumentError(f"free: block {b} is not allocated (double free?)")
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    # ---- prefix hashing -----------------------------------------------------------------------------------------
    def commit(self, block: int, parent_hash: int, tokens) -> int:
        """Register a held block whose ``block_size`` positions are computed for ``tokens``; returns its chain hash.
        If the same prefix is already registered in another block, this block simply stays unregistered."""
        self._check_id(block)
        tokens = tuple(tokens)
        if len(tokens) != self.block_size:
            raise ArgumentError(f"commit: block {block} gets {len(tokens)} tokens, only full blocks "
                                f"({self.block_size}) are hashed")
        if self._ref[block] <= 0:
            raise ArgumentError(f"commit: block {block} is not allocated")
        h = block_hash(parent_hash, tokens)
        if self._hash[block] is not None:
            if self._key[block] != (parent_hash, tokens):
                raise ArgumentError(f"commit: block {block} is already registered with other contents")
            return h
        if h not in self._cached:
            self._cached[h] = block
            self._key[block], self._hash[block] = (parent_hash, tokens), h
        return h

    def match_prefix(self, tokens, max_blocks: int | None = None) -> tuple[list, list]:
        """Longest run of registered full blocks equal to the start of ``tokens``: (block ids, chain hashes).
        Takes no references (call ``acquire``)."""
        bs = self.block_size
        n = len(tokens) // bs if max_blocks is None else min(max_blocks, len(tokens) // bs)
        blocks, hashes, parent = [], [], ROOT_HASH
        for i in range(n):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            b = self._cached.get(h)
            if b is None or self._key[b] != (parent, chunk):
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def is_cached(self, block: int) -> bool:
        self._check_id(block)
        return self._hash[block] is not None

    def _uncache(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            if self._cached.get(h) == b:
                del self._cached[h]
            self._hash[b] = self._key[b] = None

    def _check_id(self, b) -> None:
        if not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise ArgumentError(f"block id {b!r} out of range 0..{self.num_blocks - 1}")
