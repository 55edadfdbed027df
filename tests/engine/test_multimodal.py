"""A vision-language model (Idefics3 / SmolVLM family: SigLIP-style vision tower, pixel-shuffle
connector, Llama decoder) on a tiny random-weight config: greedy tokens exactly equal to
transformers' in float32 with one and two images per prompt and in a batch; the tower in bf16 (in
float32 where torch's bf16 matmul is slow) against transformers' float32; the encoder cache
hits on a repeated image and is empty after a weight push; prefix caching tells two images
apart although their placeholder tokens are the same; bad image input is refused."""
import base64
import copy
import io

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                          Idefics3Processor)

from engine import LLM, InvalidRequestError, SamplingParams
from engine.model.decoder import _mkldnn_ok

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                 "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vlm(folder, tokenizer_path: str):
    """A tiny random Idefics3 (vision 32x32 tiles of 8x8 patches, 4 tokens per tile; images are
    cut into 32x32 tiles after a resize to at most 64 a side) with SmolLM2's tokenizer plus the
    image tokens, saved with its processor. Returns (model, processor)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>"]
                            + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]})
    processor = Idefics3Processor(Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                                            max_image_size={"longest_edge": 32}),
                                  tok, image_seq_len=4, chat_template=CHAT_TEMPLATE)
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         max_position_embeddings=512),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor


def random_image(h: int, w: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, default_model_path):
    folder = tmp_path_factory.mktemp("vlm")
    model, processor = build_vlm(folder, default_model_path)
    llm = LLM(str(folder), multiprocess=False, dtype="float32", kv_cache_memory=32 << 20)
    yield llm, model, processor, folder
    llm.shutdown()


def reference(model, processor, text: str, images: list) -> list[int]:
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_images_token_exact_vs_transformers(vlm):
    llm, model, processor, _ = vlm
    cat, dog, wide = random_image(48, 40, 1), random_image(20, 30, 2), random_image(16, 60, 3)
    prompts = [("Look: <image> what?", [cat]), ("First <image> then <image>, compare.", [dog, wide]),
               ("No image here.", []), ("Again <image>", [cat])]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in prompts],
                        GREEDY, use_tqdm=False)
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(model, processor, text, images), text
    # the images matter: another image, same text, other tokens
    other = llm.generate({"prompt": "Look: <image> what?", "multi_modal_data": {"image": dog}}, GREEDY,
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != outs[0].outputs[0].token_ids


def test_bf16_encodes_images_as_transformers_does(vlm):
    """bf16 on a CPU whose torch bf16 matmul is slow (no oneDNN bf16: AVX2) encodes in float32: the
    tower's output is transformers' float32 one on the same bf16-rounded weights, rounded once;
    elsewhere it computes in bf16 (within bf16's error of it). A bf16 chat with an image runs."""
    _, model, processor, folder = vlm
    llm = LLM(str(folder), multiprocess=False, dtype="bfloat16", kv_cache_memory=32 << 20)
    try:
        encoder = llm.client.core.executor.worker.model.vision
        widened = not _mkldnn_ok(torch.bfloat16)
        assert encoder.compute_dtype == (torch.float32 if widened else torch.bfloat16)
        inputs = processor(text=["<image>"], images=[[random_image(48, 40, 1)]], return_tensors="pt")
        same_weights = copy.deepcopy(model).to(torch.bfloat16).float()
        with torch.no_grad():
            ref = same_weights.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                        pixel_attention_mask=inputs["pixel_attention_mask"])
        ref = torch.cat(list(ref.pooler_output)).flatten(0, -2)
        got = encoder.encode(inputs["pixel_values"][0])
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        if widened:
            assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
        else:
            assert (got.float() - ref).abs().max() <= 0.05 * ref.abs().max()
        out = llm.generate({"prompt": "Look: <image> what?", "multi_modal_data": {"image": random_image(48, 40, 1)}},
                           GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


def test_encoder_cache_and_prefix_cache_know_images(vlm):
    llm, model, processor, folder = vlm
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    img_a, img_b = random_image(64, 64, 4), random_image(64, 64, 5)  # same size: identical placeholder tokens
    text = "Describe <image> in detail please, " + "and more words to fill whole blocks " * 4

    def run(img):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)[0]

    before = llm.get_stats()
    first = run(img_a)
    stats = llm.get_stats()
    assert stats["encoder_cache_queries"] > before["encoder_cache_queries"]
    assert stats["encoder_cache_hits"] == before["encoder_cache_hits"]  # emptied: a miss
    second = run(img_b)  # same tokens, another image: no prefix-cache hit past the placeholders
    assert second.outputs[0].token_ids == reference(model, processor, text, [img_b])
    assert second.num_cached_tokens < second.prompt_token_ids.index(processor.image_token_id) + 16
    hits = llm.get_stats()["encoder_cache_hits"]
    again = llm.generate({"prompt": "Other words, " + text, "multi_modal_data": {"image": img_a}}, GREEDY,
                         use_tqdm=False)[0]  # the image again, at another position: the encoder cache serves it
    assert llm.get_stats()["encoder_cache_hits"] == hits + 1
    assert again.outputs[0].token_ids == reference(model, processor, "Other words, " + text, [img_a])
    assert run(img_a).outputs[0].token_ids == first.outputs[0].token_ids
    # a weight push (here: one tensor, unchanged) empties the encoder cache
    norm = "model.text_model.norm.weight"
    llm.update_weights_from_tensors([(norm, load_file(folder / "model.safetensors")[norm])])
    assert llm.get_stats()["encoder_cache_usage"] == 0.0
    run(img_a)
    assert llm.get_stats()["encoder_cache_usage"] > 0.0
    assert llm.reset_encoder_cache() and llm.get_stats()["encoder_cache_usage"] == 0.0


def test_bad_images_are_refused(vlm):
    llm = vlm[0]
    img = random_image(32, 32, 6)
    with pytest.raises(InvalidRequestError, match="markers"):
        llm.generate({"prompt": "two markers <image> <image>", "multi_modal_data": {"image": [img]}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        llm.generate({"prompt": "x <image>", "multi_modal_data": {"image": b"not an image"}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="not fetched"):
        llm.generate({"prompt": "x <image>", "multi_modal_data": {"image": "https://example.com/a.png"}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": img}}, GREEDY)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    out = llm.generate({"prompt": "x <image>", "multi_modal_data": {"image": url}}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10  # still serving; a data URL works


def test_text_models_refuse_images(tiny_folder, default_model_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, multiprocess=False, dtype="float32")
    try:
        with pytest.raises(InvalidRequestError, match="takes no images"):
            llm.generate({"prompt": "x <image>", "multi_modal_data": {"image": random_image(8, 8, 0)}}, GREEDY)
    finally:
        llm.shutdown()


def test_chat_with_images_and_chunked_prefill(vlm, default_model_path):
    """LLM.chat takes image parts; a prompt prefilled in 16-token chunks (an image's placeholders
    split across chunks, the image encoded once) gives the same tokens as transformers."""
    _, model, processor, folder = vlm
    llm = LLM(str(folder), multiprocess=False, dtype="float32", kv_cache_memory=32 << 20,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        image = random_image(50, 30, 7)
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "What is it?"}]}]
        out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": "What is it?"}]}], add_generation_prompt=True, tokenize=False)
        assert out.outputs[0].token_ids == reference(model, processor, text, [image])
        stats = llm.get_stats()
        assert stats["encoder_cache_queries"] > 1 and stats["encoder_cache_hits"] == stats["encoder_cache_queries"] - 1
    finally:
        llm.shutdown()
