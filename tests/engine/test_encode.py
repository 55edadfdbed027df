"""encode: pooled final hidden states (last token, mean) of a causal LM, and the label logits of
sequence classifiers (reward models), against transformers on the same random weights in float32
(within 1e-5); mixed with generation in one batch, across chunked prefill and a prefix-cache hit."""
import asyncio

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Qwen2Config)

from engine import LLM, AsyncLLM, InvalidRequestError, SamplingParams

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256, pad_token_id=0)
PROMPTS = [list(range(5, 24)), [100, 200, 300], list(range(1000, 1040))]


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny_lm")
    model.save_pretrained(folder)
    return str(folder), model


def classifier(tmp_path_factory, config_cls, num_labels, seed):
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config_cls(**TINY, num_labels=num_labels),
                                                           dtype=torch.float32)
    with torch.no_grad():  # a visible head (its default init is tiny)
        model.score.weight.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(f"tiny_cls_{num_labels}")
    model.save_pretrained(folder)
    return str(folder), model


def test_embeddings_of_a_causal_lm_equal_transformers(lm_folder, default_model_path):
    folder, hf = lm_folder
    # a 16-token budget: the 19- and 40-token prompts are prefilled in chunks (mean pools across them)
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32", max_num_batched_tokens=16)
    try:
        assert llm.get_supported_tasks() == ("generate", "embed")
        with torch.no_grad():
            hidden = [hf.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
        for pooling, ref in (("last", [h[-1] for h in hidden]), ("mean", [h.mean(0) for h in hidden])):
            outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], pooling=pooling, use_tqdm=False)
            for out, r in zip(outs, ref):
                torch.testing.assert_close(out.data, r, rtol=0, atol=1e-5)
        # a prefix-cache hit (the same prompt again) changes nothing; normalize gives unit length
        again = llm.encode({"prompt_token_ids": PROMPTS[2]}, normalize=True, use_tqdm=False)[0].data
        torch.testing.assert_close(again, torch.nn.functional.normalize(hidden[2][-1], dim=0), rtol=0, atol=1e-5)
        # encode and generate requests in one batch
        mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                             [SamplingParams(pooling="mean"), SamplingParams(max_tokens=3, temperature=0)],
                             use_tqdm=False)
        torch.testing.assert_close(torch.tensor(mixed[0].pooled), hidden[0].mean(0), rtol=0, atol=1e-5)
        assert len(mixed[1].outputs[0].token_ids) == 3
        with pytest.raises(InvalidRequestError, match="pooling"):
            SamplingParams(pooling="max")
        with pytest.raises(InvalidRequestError, match="n=1"):
            SamplingParams(pooling="last", n=2, temperature=1.0)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("config_cls,num_labels", [(LlamaConfig, 1), (Qwen2Config, 3)])
def test_classifier_logits_equal_transformers(tmp_path_factory, default_model_path, config_cls, num_labels):
    folder, hf = classifier(tmp_path_factory, config_cls, num_labels, seed=num_labels)
    llm = LLM(folder, tokenizer=default_model_path, multiprocess=False, dtype="float32")
    try:
        assert llm.get_supported_tasks() == ("classify",)
        outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for out, p in zip(outs, PROMPTS):
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0]  # one unpadded sequence: its last token
            assert out.data.shape == (num_labels,)
            torch.testing.assert_close(out.data, ref, rtol=0, atol=1e-5)
        with pytest.raises(InvalidRequestError, match="classifier"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
    finally:
        llm.shutdown()


def test_async_encode(lm_folder, default_model_path):
    folder, hf = lm_folder

    async def main():
        llm = AsyncLLM(folder, tokenizer=default_model_path, dtype="float32")
        try:
            return [out async for out in llm.encode({"prompt_token_ids": PROMPTS[1]}, pooling="mean", request_id="e")]
        finally:
            llm.shutdown()

    outs = asyncio.run(main())
    with torch.no_grad():
        ref = hf.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0].mean(0)
    assert len(outs) == 1 and outs[0].request_id == "e"
    torch.testing.assert_close(outs[0].data, ref, rtol=0, atol=1e-5)
