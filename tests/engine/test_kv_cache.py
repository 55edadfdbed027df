"""KVCacheManager / FreeBlockQueue on their own: block accounting, ref counts, prefix caching,
LRU eviction. No model: requests are built straight from EngineCoreRequests."""
import itertools

from engine.core.kv_cache import Block, FreeBlockQueue, KVCacheManager
from engine.core.request import Request
from engine.protocol import EngineCoreRequest
from engine.sampling_params import SamplingParams

BS = 4  # block size used throughout
_ids = itertools.count()


def make_request(tokens, cache_salt: str | None = None, lora_id: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(EngineCoreRequest(f"r{next(_ids)}", list(tokens), SamplingParams(**params), lora_id=lora_id,
                                     cache_salt=cache_salt))


def admit(kv: KVCacheManager, req: Request) -> int:
    """Schedule a whole waiting request the way the scheduler does; returns the tokens hit."""
    computed, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    req.num_computed_tokens = req.num_tokens
    return num_hit


def free_order(q: FreeBlockQueue) -> list[int]:
    ids, b = [], q.head.next
    while b is not q.tail:
        ids.append(b.block_id)
        b = b.next
    assert len(ids) == q.num_free
    return ids


def snapshot(kv: KVCacheManager):
    return (free_order(kv.free_queue), dict(kv.cached), {k: list(v) for k, v in kv.req_blocks.items()},
            dict(kv.req_num_hashed), [(b.ref_cnt, b.block_hash, b.token_ids) for b in kv.blocks],
            kv.num_queries, kv.num_hits)


# ---- FreeBlockQueue -------------------------------------------------------------------------
def test_free_queue_lru_order_and_middle_removal():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert free_order(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # from the middle
    assert free_order(q) == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.append(blocks[2])
    assert free_order(q) == [1, 3, 4, 0, 2]
    assert [q.popleft().block_id for _ in range(5)] == [1, 3, 4, 0, 2]
    assert q.num_free == 0 and q.head.next is q.tail and q.tail.prev is q.head


# ---- allocation and free --------------------------------------------------------------------
def test_allocate_and_free_returns_pool_to_idle():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    reqs = [make_request(range(100 * i, 100 * i + n)) for i, n in enumerate((1, 4, 5, 11))]
    for r in reqs:
        admit(kv, r)
    assert [len(kv.block_ids(r.request_id)) for r in reqs] == [1, 1, 2, 3]
    assert kv.num_free_blocks == 10 - 7
    assert abs(kv.usage - 0.7) < 1e-9
    all_ids = sum((kv.block_ids(r.request_id) for r in reqs), [])
    assert len(set(all_ids)) == len(all_ids)  # no block handed out twice
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.blocks)
    assert kv.req_blocks == {} and kv.req_num_hashed == {}


def test_decode_growth_allocates_a_block_only_at_the_boundary():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    r = make_request(range(6))
    admit(kv, r)
    assert len(kv.block_ids(r.request_id)) == 2
    r.all_token_ids.append(6)  # 7 tokens: still fits in 2 blocks
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    assert len(kv.block_ids(r.request_id)) == 2
    r.all_token_ids.append(7)
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    r.all_token_ids.append(8)  # the 9th token needs a third block
    assert kv.allocate_slots(r, 1)
    assert len(kv.block_ids(r.request_id)) == 3
    assert kv.num_free_blocks == 7


# ---- prefix caching -------------------------------------------------------------------------
def test_shared_prefix_ref_counts_and_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=True)
    prefix = list(range(1000, 1012))  # 3 full blocks
    a = make_request(prefix + [1, 2])
    b = make_request(prefix + [7, 8, 9])
    assert admit(kv, a) == 0
    assert kv.prefix_hit_rate == 0.0
    assert admit(kv, b) == 12
    assert b.num_computed_tokens == b.num_tokens
    ids_a, ids_b = kv.block_ids(a.request_id), kv.block_ids(b.request_id)
    assert ids_a[:3] == ids_b[:3]  # the shared prefix blocks
    assert ids_a[3] != ids_b[3]
    assert [kv.blocks[i].ref_cnt for i in ids_a[:3]] == [2, 2, 2]
    assert kv.blocks[ids_a[3]].ref_cnt == 1 and kv.blocks[ids_b[3]].ref_cnt == 1
    assert kv.num_hits == 12 and kv.num_queries == a.num_tokens + b.num_tokens
    assert abs(kv.prefix_hit_rate - 12 / 29) < 1e-9
    assert kv.num_free_blocks == 20 - 5
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in ids_a[:3]] == [1, 1, 1]
    assert kv.num_free_blocks == 20 - 4  # only a's private block came back
    kv.free(b)
    assert kv.num_free_blocks == 20 and all(blk.ref_cnt == 0 for blk in kv.blocks)


def test_cache_salts_and_loras_never_share_prefix_blocks():
    """vLLM's cache_salt: a salt seeds the hash chain, so only requests with the same salt (and
    the same LoRA adapter) hit each other's blocks."""
    kv = KVCacheManager(num_blocks=40, block_size=BS, enable_caching=True)
    prefix = list(range(1000, 1012))  # 3 full blocks
    first = {}
    for salt, lora in ((None, 0), ("a", 0), ("b", 0), ("a", 1)):
        first[salt, lora] = admit(kv, make_request(prefix + [1], cache_salt=salt, lora_id=lora))
        assert first[salt, lora] == 0, (salt, lora)  # nobody else's blocks
    for salt, lora in ((None, 0), ("a", 0), ("b", 0), ("a", 1)):
        assert admit(kv, make_request(prefix + [2], cache_salt=salt, lora_id=lora)) == 12, (salt, lora)


def test_freed_blocks_still_hit_and_are_revived():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    a = make_request(range(9))  # 2 full blocks + 1 token
    admit(kv, a)
    ids_a = kv.block_ids(a.request_id)
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_request(list(range(8)) + [50, 51])
    assert admit(kv, b) == 8
    assert kv.block_ids(b.request_id)[:2] == ids_a[:2]
    assert kv.num_free_blocks == 8 - 3  # the two revived blocks left the free queue
    assert ids_a[0] not in free_order(kv.free_queue) and ids_a[1] not in free_order(kv.free_queue)


def test_whole_prompt_in_cache_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    toks = list(range(200, 212))  # exactly 3 full blocks
    a = make_request(toks)
    admit(kv, a)
    b = make_request(toks)
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and len(computed) == 2  # the last block is recomputed for its logits
    assert num_hit < b.num_tokens
    assert kv.allocate_slots(b, b.num_tokens - num_hit, computed)
    assert len(kv.block_ids(b.request_id)) == 3
    c = make_request(toks[:5])
    assert kv.get_computed_blocks(c)[1] == 4
    d = make_request(toks[:4])  # one full block and nothing else: the block must be recomputed
    assert kv.get_computed_blocks(d) == ([], 0)


def test_differing_token_in_block_one_stops_the_chain_at_block_zero():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=True)
    base = list(range(300, 316))  # 4 full blocks
    admit(kv, make_request(base + [1]))
    other = list(base)
    other[5] = 9999  # inside block 1
    b = make_request(other + [1])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == BS and len(computed) == 1
    # blocks 2 and 3 hold equal tokens but a different parent, so they must not match either
    assert b.block_hashes[2] not in kv.cached and b.block_hashes[3] not in kv.cached


def test_lru_eviction_reuses_least_recently_freed_block_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request(range(0, 8))  # 2 full blocks, both cached
    b = make_request(range(100, 108))
    admit(kv, a)
    admit(kv, b)
    a_ids, b_ids = kv.block_ids(a.request_id), kv.block_ids(b.request_id)
    a_hashes, b_hashes = list(a.block_hashes), list(b.block_hashes)
    assert len(kv.cached) == 4
    kv.free(a)  # tail first: a's block 1, then a's block 0
    kv.free(b)
    assert free_order(kv.free_queue) == [a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    assert len(kv.cached) == 4  # freed blocks keep their hashes

    c = make_request(range(500, 503))  # needs one block: takes a's last block
    admit(kv, c)
    assert kv.block_ids(c.request_id) == [a_ids[1]]
    assert a_hashes[1] not in kv.cached
    assert kv.blocks[a_ids[1]].block_hash is None
    assert a_hashes[0] in kv.cached and b_hashes[0] in kv.cached and b_hashes[1] in kv.cached

    d = make_request(range(600, 603))  # next victim: a's first block
    admit(kv, d)
    assert kv.block_ids(d.request_id) == [a_ids[0]]
    assert a_hashes[0] not in kv.cached and set(b_hashes) <= set(kv.cached)

    # a again: nothing of it is left; b again: both blocks still hit (it needs 1 recomputed token)
    a2 = make_request(list(range(0, 8)) + [1])
    assert kv.get_computed_blocks(a2) == ([], 0)
    b2 = make_request(list(range(100, 108)) + [1])
    computed, num_hit = kv.get_computed_blocks(b2)
    assert num_hit == 8 and [blk.block_id for blk in computed] == b_ids


def test_freed_blocks_without_a_hash_are_reused_first():
    """A freed block that holds nothing a prompt can find (here a partial one) goes out before the
    blocks never used (on CPU their pages are not committed yet) and before cached ones: short
    requests one after another keep taking the same block."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    a = make_request(range(0, 6))  # one full block (cached) and a partial one
    admit(kv, a)
    full, partial = kv.block_ids(a.request_id)
    full_hash = a.block_hashes[0]
    kv.free(a)
    order = free_order(kv.free_queue)
    assert order[0] == partial and order[-1] == full
    for i in range(3):
        r = make_request(range(100 + 10 * i, 103 + 10 * i))
        admit(kv, r)
        assert kv.block_ids(r.request_id) == [partial]
        kv.free(r)
    assert kv.cached[full_hash] is kv.blocks[full] and kv.num_free_blocks == 8


def test_hit_on_freed_block_moves_it_out_of_eviction_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request(range(0, 8))
    admit(kv, a)
    a_ids = kv.block_ids(a.request_id)
    kv.free(a)
    a2 = make_request(list(range(0, 4)) + [77])  # hits a's block 0 only
    assert admit(kv, a2) == 4
    assert kv.block_ids(a2.request_id)[0] == a_ids[0]
    assert a_ids[0] not in free_order(kv.free_queue)
    assert kv.blocks[a_ids[0]].ref_cnt == 1


def test_reset_prefix_cache_drops_every_cached_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    toks = list(range(400, 413))
    a = make_request(toks)
    admit(kv, a)
    running = make_request(range(700, 709))
    admit(kv, running)
    kv.free(a)
    assert kv.cached
    kv.reset_prefix_cache()
    assert kv.cached == {}
    assert all(b.block_hash is None and b.token_ids is None for b in kv.blocks)
    assert kv.num_hits == 0 and kv.num_queries == 0 and kv.prefix_hit_rate == 0.0
    again = make_request(toks)
    assert admit(kv, again) == 0
    # the running request's old blocks are not registered again after the reset
    running.all_token_ids.extend([1, 2, 3, 4])
    assert kv.allocate_slots(running, 4)
    assert all(kv.blocks[i].block_hash is None for i in kv.block_ids(running.request_id))


def test_allocate_slots_false_when_full_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)
    a = make_request(range(0, 9))  # 3 blocks
    admit(kv, a)
    b = make_request(range(50, 55))
    admit(kv, b)  # 2 blocks: pool full
    kv.free(b)  # 2 cached free blocks
    before = snapshot(kv)
    c = make_request(range(800, 813))  # needs 4 blocks, only 2 free
    assert not kv.allocate_slots(c, c.num_tokens)
    assert snapshot(kv) == before
    assert c.request_id not in kv.req_blocks
    # a running request that cannot grow: unchanged too
    a.all_token_ids.extend(range(9, 30))
    assert not kv.allocate_slots(a, 21)
    assert snapshot(kv) == before
    # a prefix hit on a freed block needs 2 new blocks; 2 are free, but one of them is the hit
    # itself (revived from the free queue), so only 1 is really available: refused, unchanged
    d = make_request(list(range(50, 54)) + list(range(900, 905)))
    computed, num_hit = kv.get_computed_blocks(d)
    assert num_hit == 4
    before = snapshot(kv)
    assert not kv.allocate_slots(d, d.num_tokens - num_hit, computed)
    assert snapshot(kv) == before
    assert kv.num_free_blocks == 2


def test_prompt_logprobs_requests_bypass_the_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    toks = list(range(10, 23))
    a = make_request(toks)
    admit(kv, a)
    b = make_request(toks, prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == 0
    assert not set(kv.block_ids(a.request_id)) & set(kv.block_ids(b.request_id))
    assert all(kv.blocks[i].ref_cnt == 1 for i in kv.block_ids(a.request_id))
    c = make_request(toks, prompt_logprobs=None)
    assert kv.get_computed_blocks(c)[1] == 12


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    toks = list(range(10, 23))
    a = make_request(toks)
    admit(kv, a)
    kv.free(a)
    assert kv.cached == {}
    assert admit(kv, make_request(toks)) == 0
