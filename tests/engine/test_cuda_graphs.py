"""The CUDA-graph bookkeeping that needs no GPU: the capture ladder and the padded static inputs
(the replay itself is tests/engine/test_cuda.py's, on a GPU)."""
import torch

from engine.model.attention import AttentionMetadata
from engine.worker.cuda_graphs import MAX_CAPTURE_SIZE, DecodeGraphs, capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_scheduler_limit():
    for max_num_seqs in (1, 3, 5, 8, 10, 256, 1024):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_num_seqs, MAX_CAPTURE_SIZE)
        graphs = DecodeGraphs(max_num_seqs, 4, torch.device("cpu"))
        for n in range(1, sizes[-1] + 1):
            assert n <= graphs.size_for(n) <= max(n + 7, 2 * n)  # padding stays small
        assert graphs.size_for(sizes[-1] + 1) is None  # bigger steps run eagerly
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16]


def test_padding_rows_repeat_row_zero():
    """Padded rows write row 0's key and value to row 0's slot again and read its blocks: nothing
    else of the cache is touched, and the real rows' inputs are the step's."""
    graphs = DecodeGraphs(16, 6, torch.device("cpu"))
    graphs.table.fill_(-1)
    table = torch.tensor([[3, 4, 0], [5, 0, 0], [6, 7, 8]], dtype=torch.int32)
    md = AttentionMetadata(slot_mapping=torch.tensor([70, 81, 140]), num_decodes=3, decode_block_table=table,
                           decode_seq_lens=torch.tensor([23, 2, 45], dtype=torch.int32))
    size = graphs.stage(torch.tensor([11, 12, 13]), torch.tensor([22, 1, 44]), md)
    assert size == 4
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 11]
    assert graphs.positions[:4].tolist() == [22, 1, 44, 22]
    assert graphs.slots[:4].tolist() == [70, 81, 140, 70]
    assert graphs.lens[:4].tolist() == [23, 2, 45, 23]
    assert graphs.table[:4, :3].tolist() == [[3, 4, 0], [5, 0, 0], [6, 7, 8], [3, 4, 0]]


class EagerGraph:
    """Stands in for a captured graph on CPU: a replay runs the forward over the static buffers
    and writes its output where the graph's would be."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.out = model.forward(*args)

    def replay(self):
        self.out.copy_(self.model.forward(*self.args))


def test_padded_decode_steps_give_the_eager_tokens(tiny_folder, default_model_path, monkeypatch):
    """The engine's decode steps through DecodeGraphs' padded static inputs (a replay that runs
    eagerly on CPU): 3 and 5 sequences padded to 4 and 8 decode the tokens of plain steps."""
    from engine import LLM, SamplingParams

    def capture(self, model, size, kv_caches):
        md = AttentionMetadata(slot_mapping=self.slots[:size], num_decodes=size,
                               decode_block_table=self.table[:size], decode_seq_lens=self.lens[:size])
        graph = EagerGraph(model, (self.input_ids[:size], self.positions[:size], md, kv_caches))
        return graph, graph.out

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(tiny_folder, dtype="float32", kv_cache_memory=16 << 20, tokenizer=default_model_path,
              multiprocess=False)
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.client.core.executor.worker.model_runner
        runner.cuda_graphs = DecodeGraphs(8, -(-llm.config.max_model_len // 16), torch.device("cpu"))
        llm.reset_prefix_cache()
        for batch in (prompts[:3], prompts):
            outs = llm.generate(batch, params, use_tqdm=False)
            for out, ref in zip(outs, plain):
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids
                assert max(abs(a - b) for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs)) < 1e-5
        assert set(runner.cuda_graphs.graphs) == {4, 8}
    finally:
        llm.shutdown()
