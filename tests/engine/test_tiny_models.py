"""Acceptance on tiny random-weight models of every supported family: our engine's greedy tokens
and logprobs against Hugging Face `generate` in float32.

Each model is built from its transformers config class (hidden 64, 4 heads, 2 KV heads, head_dim
16, the default model's 49152-token vocabulary so its tokenizer fits), randomly initialized with
a fixed seed (norm weights and biases perturbed too, so a mis-loaded one shows), saved with
save_pretrained and loaded by `engine.LLM` from that folder. The prompts are token ids of
several lengths, batched together; two share a 40-token prefix (prefix cache), and one model
runs with a small token budget (chunked prefill). Mistral's sliding window (16) is shorter than
every sequence but the shortest.
"""
import inspect

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

import engine
from engine.default_model import default_model_path

VOCAB = 49152
MAX_TOKENS = 24
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6)

MODELS = {
    # Qwen2: q/k/v biases, tied embeddings
    "qwen2": (Qwen2Config, dict(num_hidden_layers=2, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), {}),
    # Qwen3: q/k RMSNorm, explicit head_dim, untied
    "qwen3": (Qwen3Config, dict(num_hidden_layers=3, head_dim=16, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), {}),
    # Llama with llama3 rope scaling whose three frequency bands all occur at head_dim 16
    "llama3": (LlamaConfig, dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 256}),
               dict(max_num_batched_tokens=32)),
    # Mistral with a sliding window far shorter than the sequences, tied, chunked prefill too
    "mistral": (MistralConfig, dict(num_hidden_layers=4, head_dim=16, sliding_window=16, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                dict(max_num_batched_tokens=40)),
    # Qwen3-MoE: 8 experts, top 2 renormalised, layer 1 dense (mlp_only_layers), q/k norms
    "qwen3_moe": (Qwen3MoeConfig, dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), {}),
    # Mixtral: 4 experts, top 2 (always renormalised), chunked prefill
    "mixtral": (MixtralConfig, dict(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=None, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                dict(max_num_batched_tokens=40)),
}

PROMPT_LENGTHS = (5, 17, 33, 70, 48)
# the engine core in this process: same numerics as the child process, without its start-up cost
INPROC = {"multiprocess": False} if "multiprocess" in inspect.signature(engine.LLM).parameters else {}


def make_prompts():
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    prompts[4][:40] = prompts[3][:40]  # shares 40 tokens (two full blocks and a half) with prompt 3
    return prompts


def build_model(name, folder, **config):
    """A random-weight model of family `name` saved to `folder`; `config` overrides COMMON's fields."""
    cls, kwargs, _ = MODELS[name]
    config = cls(**{**COMMON, **config}, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder)
    assert list(folder.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    return model


def hf_greedy(model, prompt):
    """HF greedy generation, EOS ignored: (token ids, raw logits of each generated position)."""
    ids = torch.tensor([prompt], device=model.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, output_logits=True, return_dict_in_generate=True,
                             temperature=None, top_p=None, top_k=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float().cpu()  # (MAX_TOKENS, V)
    return tokens, logits


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    name = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and immune to a busy second core
    folder = tmp_path_factory.mktemp(name)
    model = build_model(name, folder)
    prompts = make_prompts()
    refs = [hf_greedy(model, p) for p in prompts]
    llm = engine.LLM(str(folder), dtype="float32", kv_cache_memory=64 << 20, block_size=16,
                     tokenizer=str(default_model_path()), **INPROC, **MODELS[name][2])
    yield name, model, llm, prompts, refs
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    torch.set_num_threads(threads)


def compare(name, prompts, refs, outs):
    for i, (prompt, (ref_tokens, ref_logits), out) in enumerate(zip(prompts, refs, outs)):
        assert out.prompt_token_ids == prompt
        c = out.outputs[0]
        assert len(c.token_ids) == MAX_TOKENS and c.finish_reason == "length"
        if c.token_ids != ref_tokens:
            j = next(k for k, (a, b) in enumerate(zip(c.token_ids, ref_tokens)) if a != b)
            top2 = ref_logits[j].topk(2).values
            pytest.fail(f"{name} prompt {i} (len {len(prompt)}): greedy tokens differ at output position {j} "
                        f"(ours {c.token_ids[j]}, HF {ref_tokens[j]}); HF top-2 logit gap there "
                        f"{float(top2[0] - top2[1]):.3g}, our logprob of ours {c.logprobs[j]:.6f}, "
                        f"HF logprob of ours {float(ref_logits[j].log_softmax(-1)[c.token_ids[j]]):.6f}")
        ref_lp = ref_logits.log_softmax(-1).gather(1, torch.tensor(ref_tokens)[:, None]).squeeze(1)
        assert len(c.logprobs) == MAX_TOKENS
        diff = (torch.tensor(c.logprobs) - ref_lp).abs()
        assert float(diff.max()) <= 1e-4, (f"{name} prompt {i}: logprobs differ by {float(diff.max()):.2e} "
                                          f"at position {int(diff.argmax())}")


PARAMS = engine.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def test_greedy_tokens_and_logprobs_match_hf(tiny):
    name, model, llm, prompts, refs = tiny
    mc = llm.config.model_config
    cfg = model.config
    assert mc.tie_word_embeddings == cfg.tie_word_embeddings
    assert mc.sliding_window == (16 if name == "mistral" else None)
    assert (mc.rope_scaling or {}).get("rope_type", "default") == cfg.rope_parameters["rope_type"]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    compare(name, prompts, refs, outs)
    assert outs[4].num_cached_tokens == 32 or outs[3].num_cached_tokens == 32  # the shared prefix hit


def test_repeat_with_prefix_cache_and_one_by_one(tiny):
    """The same prompts again (now served from the prefix cache), then one at a time: same result."""
    name, _, llm, prompts, refs = tiny
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    compare(name, prompts, refs, outs)
    assert all(o.num_cached_tokens > 0 for o, p in zip(outs, prompts) if len(p) > 16)
    llm.reset_prefix_cache()
    for i in (0, 3):
        out = llm.generate([prompts[i]], PARAMS, use_tqdm=False)
        assert out[0].num_cached_tokens == 0
        compare(name, [prompts[i]], [refs[i]], out)


def test_sliding_window_is_exercised():
    """Sanity of the Mistral setup: the window really changes HF's result at these lengths."""
    cls, kwargs, _ = MODELS["mistral"]
    torch.manual_seed(0)
    windowed = AutoModelForCausalLM.from_config(cls(**COMMON, **kwargs), attn_implementation="eager").eval()
    full = AutoModelForCausalLM.from_config(cls(**COMMON, **dict(kwargs, sliding_window=None)),
                                            attn_implementation="eager").eval()
    full.load_state_dict(windowed.state_dict())
    ids = torch.tensor([make_prompts()[3]])
    with torch.no_grad():
        a = windowed(ids, attention_mask=torch.ones_like(ids)).logits
        b = full(ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-5)  # inside the window: identical
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-2  # beyond it: different


# The families whose features these kernels see: Qwen3's q/k norms (rotary + KV write), Mistral's
# sliding window and chunked prefill (both attentions). The others differ in what the kernels do
# not touch (biases, rope frequencies, MoE, ties) and cost 30-70 s each in the interpreter.
@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["qwen3", "mistral"], indirect=True)
def test_triton_kernels_in_the_engine_match_hf(tiny, monkeypatch):
    """The CUDA path's Triton kernels (paged decode and varlen prefill attention, residual +
    RMSNorm, rotary + KV write with Qwen3's q/k norms; here in Triton's interpreter on CPU
    tensors) inside the engine: HF's tokens and logprobs through prefix-cache hits, chunked
    prefill and the sliding window, i.e. the kernels take the engine's own metadata."""
    pytest.importorskip("triton")
    import engine.model.attention as attention
    from kernels import triton_attention, triton_norm, triton_rotary

    name, _, llm, prompts, refs = tiny
    ops = llm.client.core.executor.worker.model.ops
    monkeypatch.setattr(attention, "paged_prefill_attention", triton_attention.paged_prefill_attention)
    monkeypatch.setattr(attention, "paged_decode_attention", triton_attention.paged_decode_attention)
    monkeypatch.setattr(ops, "decode_attention", None)  # all-decode steps through attention() too
    monkeypatch.setattr(ops, "add_norm", triton_norm.fused_add_rms_norm)
    monkeypatch.setattr(ops, "rope_and_cache", triton_rotary.rope_and_cache)
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    compare(name, prompts, refs, outs)
    assert outs[4].num_cached_tokens == 32 or outs[3].num_cached_tokens == 32  # the shared prefix hit
