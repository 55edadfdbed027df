"""CUDA graphs for all-decode steps.

A decode step of a small model on a GPU is a few hundred short kernels, and launching them from
Python costs more than running them. A graph records one step's launches once and replays them
with one call. A graph replays fixed shapes at fixed addresses, so a step of n sequences runs the
graph of the smallest captured size >= n over static input buffers: rows past n repeat row 0
(same token, position, slot and block table), so they write row 0's own key and value again, the
same bits to the same slot, and their outputs are ignored. No cache block is set aside for them.

Graphs are captured lazily, the first time a size is needed (a warm-up run on a side stream, then
the capture), so start-up pays nothing for sizes a workload never reaches. They read the weights
and the KV cache at the addresses they had then: weight updates copy into those tensors in place
(engine/worker/weight_buffers.py), and whatever moves them (sleep, a new model, a new cache) drops
the graphs through ModelRunner.drop_step_captures().
"""
import bisect

import torch

from engine.model.attention import AttentionMetadata

MAX_CAPTURE_SIZE = 512  # larger decode batches are compute-bound: launches no longer dominate


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to the largest batch the scheduler forms (vLLM's ladder:
    a padded row costs little next to a launch)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else sizes + [top]


class DecodeGraphs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for all sizes: only one replays at a time
        # one side stream for every warm-up and capture: cuBLAS keeps a workspace (32 MiB on Hopper)
        # per stream it has run on, which no empty_cache() returns, so a stream per capture leaks that
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def size_for(self, n: int) -> int | None:
        """The captured size a step of n decodes runs at (None: too many, run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def run(self, model, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """model.forward of an all-decode step through the graph of its padded size. Returns the
        (n, hidden) rows of the real sequences: a view of the graph's output, valid until the next
        replay."""
        size = self.stage(input_ids, positions, md)
        entry = self.graphs.get(size)
        if entry is None:
            entry = self.graphs[size] = self._capture(model, size, kv_caches)
        graph, out = entry
        graph.replay()
        return out[:input_ids.shape[0]]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> int:
        """Copy a step of n decodes into the static buffers, padded with copies of row 0 up to the
        captured size; returns that size."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        width, pad = md.decode_block_table.shape[1], size - n
        for buf, src in ((self.input_ids, input_ids), (self.positions, positions), (self.slots, md.slot_mapping),
                         (self.lens, md.decode_seq_lens)):
            buf[:n].copy_(src)
            if pad:
                buf[n:size].copy_(src[:1].expand(pad))
        self.table[:n, :width].copy_(md.decode_block_table)
        if pad:
            self.table[n:size, :width].copy_(md.decode_block_table[:1].expand(pad, width))
        return size

    def _capture(self, model, size: int, kv_caches) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        md = AttentionMetadata(slot_mapping=self.slots[:size], num_decodes=size,
                               decode_block_table=self.table[:size], decode_seq_lens=self.lens[:size])
        args = (self.input_ids[:size], self.positions[:size], md, kv_caches)
        # the warm-up compiles the Triton kernels for these shapes and lets cuBLAS pick its kernels
        # outside the capture (it writes the real rows' keys and values: the same bits the replay writes)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            model.forward(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a weight receiver thread of this process may touch CUDA during the capture
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = model.forward(*args)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out
