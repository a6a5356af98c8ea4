"""BlockPool: ref-counted allocation, prefix reuse of full blocks by chain hash, eviction order, misuse errors."""
import pytest

from ascend_emu.errors import ArgumentError, CapacityError
from serving.kv_cache import ROOT_HASH, BlockPool, block_hash

BS = 16


def fill(pool, tokens):
    """Allocate and register the full blocks of ``tokens`` as a sequence would; returns (blocks, hashes)."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = pool.commit(blocks[i], parent, tokens[i * BS:(i + 1) * BS])
        hashes.append(parent)
    return blocks, hashes


def test_allocate_free_refcounts_and_usage():
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used == 3 and pool.num_free == 5 and pool.usage == 3 / 8
    assert all(pool.ref_count(b) == 1 for b in a)
    pool.free(a)
    assert pool.num_used == 0 and pool.usage == 0.0
    with pytest.raises(ArgumentError, match="double free"):
        pool.free([a[0]])


def test_capacity_and_argument_errors():
    pool = BlockPool(4, BS)
    pool.allocate(3)
    with pytest.raises(CapacityError, match="2 blocks asked, 1 free of 4"):
        pool.allocate(2)
    with pytest.raises(ArgumentError, match="out of range"):
        pool.free([4])
    with pytest.raises(ArgumentError, match="block_size"):
        BlockPool(4, 32)
    with pytest.raises(ArgumentError, match="num_blocks"):
        BlockPool(0, BS)
    assert BlockPool(2, 128).blocks_for(129) == 2 and pool.blocks_for(0) == 0 and pool.blocks_for(16) == 1


def test_prefix_match_uses_full_blocks_only():
    pool = BlockPool(16, BS)
    seq = list(range(100, 140))                       # 40 tokens: 2 full blocks + 8
    blocks, hashes = fill(pool, seq)
    hit, hit_hashes = pool.match_prefix(seq)
    assert hit == blocks[:2] and hit_hashes == hashes  # the partial third block is never shared
    assert not pool.is_cached(blocks[2])
    # same first 20 tokens then different: only the first full block matches
    assert pool.match_prefix(seq[:20] + [1] * 20)[0] == blocks[:1]
    assert pool.match_prefix(seq, max_blocks=1)[0] == blocks[:1]
    assert pool.match_prefix(seq[:15])[0] == []        # shorter than a block


def test_hash_chain_depends_on_parent():
    pool = BlockPool(16, BS)
    a, b = list(range(16)), list(range(16, 32))
    fill(pool, a + b)
    # block b after a different first block is a different prefix: no match even though b's tokens are cached
    assert pool.match_prefix(list(range(50, 66)) + b)[0] == []
    assert block_hash(ROOT_HASH, a) != block_hash(block_hash(ROOT_HASH, b), a)


def test_shared_blocks_refcounts_and_free():
    pool = BlockPool(8, BS)
    seq = list(range(48))
    blocks, _ = fill(pool, seq)
    hit, _ = pool.match_prefix(seq + [7])
    assert hit == blocks
    pool.acquire(hit)
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2] and pool.num_used == 3   # shared blocks count once
    pool.free(blocks)
    assert pool.num_used == 3 and [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    pool.free(hit)
    assert pool.num_used == 0
    # freed blocks keep their hashes: a later request can take them back out of the free list
    hit2, _ = pool.match_prefix(seq)
    assert hit2 == blocks
    pool.acquire(hit2)
    assert pool.num_free == 5 and pool.num_used == 3


def test_eviction_takes_least_recently_freed_and_tail_first():
    pool = BlockPool(4, BS)
    seq = list(range(64))
    blocks, _ = fill(pool, seq)                       # all 4 blocks, all registered
    pool.free(blocks)                                 # freed tail first
    pool.allocate(1)                                  # evicts the last block of the sequence, not the first
    assert pool.match_prefix(seq)[0] == blocks[:3]
    pool.allocate(2)
    assert pool.match_prefix(seq)[0] == blocks[:1]


def test_commit_misuse_and_duplicates():
    pool = BlockPool(4, BS)
    b = pool.allocate(2)
    with pytest.raises(ArgumentError, match="only full blocks"):
        pool.commit(b[0], ROOT_HASH, [1] * 15)
    with pytest.raises(ArgumentError, match="not allocated"):
        pool.commit(3, ROOT_HASH, [1] * 16)
    with pytest.raises(ArgumentError, match="only cached blocks"):
        pool.acquire([b[0]])
    h = pool.commit(b[0], ROOT_HASH, [1] * 16)
    assert pool.commit(b[0], ROOT_HASH, [1] * 16) == h          # idempotent
    with pytest.raises(ArgumentError, match="other contents"):
        pool.commit(b[0], ROOT_HASH, [2] * 16)
    assert pool.commit(b[1], ROOT_HASH, [1] * 16) == h          # same prefix elsewhere: stays unregistered
    assert not pool.is_cached(b[1]) and pool.match_prefix([1] * 16)[0] == [b[0]]
