"""KV cache block accounting: a block pool with an LRU free queue, reference counts, and
prefix caching by a hash chain over full blocks.

A full block's hash covers its token ids and its parent's hash, so equal hashes mean equal
prefixes (confirmed by comparing token ids on a hit). Freed blocks keep their hash and stay
findable until the pool hands them out again, least recently freed first. Only this module
knows blocks; the scheduler asks it for slots and the model runner reads block ids.
"""

from engine.core.request import Request


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks: O(1) removal from the
    middle (a cache hit revives a freed block), LRU order, no allocation on the hot path.
    popleft() hands out the head: blocks pushed there with appendleft() go out first."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)  # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_free += 1

    def appendleft(self, b: Block) -> None:
        first = self.head.next
        self.head.next, b.prev, b.next, first.prev = b, self.head, first, b
        self.num_free += 1

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        b = self.head.next
        assert b is not self.tail, "no free blocks"
        self.remove(b)
        return b


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_num_hashed: dict[str, int] = {}  # how many of a request's blocks are in `cached`
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- prefix cache -------------------------------------------------------------------
    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """Extend req.block_hashes to cover its first num_full_blocks blocks."""
        bs, h = self.block_size, req.block_hashes
        toks = req.all_token_ids
        while len(h) < num_full_blocks:
            i = len(h)
            parent = h[-1] if h else req.hash_seed
            key = (parent, tuple(toks[i * bs:(i + 1) * bs]))
            if req.mm_features:  # image placeholders are the same tokens for every image: add the images'
                key += tuple(f.hash for f in req.mm_features  # hashes to the blocks holding them
                             if f.positions[0] < (i + 1) * bs and f.positions[-1] >= i * bs)
            h.append(hash(key))
        return h

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of req's tokens: (blocks, number of tokens they hold).
        At least one token is always left to compute (its logits are needed)."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        bs = self.block_size
        for i, h in enumerate(self._hashes(req, max_blocks)):
            b = self.cached.get(h)
            if b is None or b.token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(b)
        self.num_queries += req.num_tokens
        self.num_hits += len(hits) * bs
        return hits, len(hits) * bs

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register req's blocks that are full once num_tokens tokens are computed."""
        blocks = self.req_blocks[req.request_id]
        start, end = self.req_num_hashed.get(req.request_id, 0), num_tokens // self.block_size
        if end <= start:
            return
        bs = self.block_size
        for i, h in enumerate(self._hashes(req, end)[start:end], start):
            b = blocks[i]
            if b.block_hash is None and h not in self.cached:
                b.block_hash, b.token_ids = h, tuple(req.all_token_ids[i * bs:(i + 1) * bs])
                self.cached[h] = b
        self.req_num_hashed[req.request_id] = end

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        """Make room for num_new_tokens more tokens after req.num_computed_tokens (plus the
        prefix-cache hits `computed`, for a request not yet holding blocks). False if full."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = -(-total // self.block_size) - len(blocks) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # hits sitting in the free queue
        if num_new_blocks > self.num_free_blocks - revived:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        for b in computed:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        blocks.extend(computed)
        if computed:
            self.req_num_hashed[req.request_id] = len(blocks)
        for _ in range(num_new_blocks):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict the least recently used cached block
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = b.token_ids = None
            b.ref_cnt = 1
            blocks.append(b)
        if self.enable_caching:  # (a token still being sampled, async scheduling, is hashed once known)
            self._cache_full_blocks(req, min(total, req.num_tokens))
        return True

    def free(self, req: Request) -> None:
        """Release req's blocks; the tail goes to the free queue first, so it is evicted first.
        A block without a hash (a partial block, a duplicate, caching off) holds nothing a later
        prompt can find: it goes to the head, to be reused before any other. Appended, it would
        wait behind every block never used yet, so each short request (an encode input) would
        take a fresh block and commit its pages: on CPU one call of 10k inputs committed 1.4 GB
        of the 2 GiB pool although it never needed more than a few hundred blocks at once."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_num_hashed.pop(req.request_id, None)
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update no old KV may be reused)."""
        for b in self.cached.values():
            b.block_hash = b.token_ids = None
        self.cached.clear()
        for req_id in self.req_num_hashed:
            self.req_num_hashed[req_id] = 1 << 60  # running requests stop registering old blocks
        self.num_queries = self.num_hits = 0
