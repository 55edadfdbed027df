"""Hugging Face transformers as the outside reference: greedy tokens and logprobs on the same
weights, one prompt at a time (no padding, so float32 numerics match a correct engine)."""
import torch

# 32 varied chat prompts: questions, instructions, long and short, multi-turn.
CHATS = [
    [{"role": "user", "content": q}] for q in [
        "What is 17 + 25?", "Name three primary colors.", "Who wrote Romeo and Juliet?",
        "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
        "Translate 'good morning' into French and Spanish.", "List five fruits that are red.",
        "What is the difference between a list and a tuple in Python?",
        "Write a Python function that reverses a string.", "Why is the sky blue?",
        "Give me a recipe for pancakes.", "What is the capital of Japan?",
        "Summarize the plot of Cinderella in two sentences.", "How many legs does a spider have?",
        "What is machine learning?", "Tell me a joke about computers.",
        "Describe the water cycle for a ten-year-old, step by step, with an example from everyday life "
        "such as a puddle drying after rain or a cold glass of lemonade sweating on a summer afternoon.",
        "Convert 100 degrees Fahrenheit to Celsius.", "What are the planets of the solar system?",
        "Write a short motivational message for a student before an exam.",
    ]
] + [
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": q}] for q in [
        "What is gravity?", "Who painted the Mona Lisa?", "What does DNA stand for?",
        "How far is the Moon?", "What is an API?", "Why do we sleep?",
    ]
] + [
    [{"role": "user", "content": "Hi! Can you help me plan a trip?"},
     {"role": "assistant", "content": "Of course! Where would you like to go?"},
     {"role": "user", "content": q}] for q in [
        "Paris, for three days.", "Somewhere warm in December.", "Tokyo, on a small budget.",
    ]
] + [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And times 3?"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, and a fruit of that color."}],
    [{"role": "user", "content": "Write the numbers from 1 to 30 separated by commas."}],
]
assert len(CHATS) == 32


def chat_token_ids(tokenizer, chats=CHATS) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for c in chats]


def load_hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # or generate() refills EOS and stops early
    return model


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (greedy token ids, logprob of each, top-2 logit gap at each step)."""
    results = []
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        logits = torch.stack(out.logits, 0)[:, 0].float().cpu()  # (steps, V)
        lps = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
        top2 = logits.topk(2, dim=-1).values
        results.append((tokens, lps, (top2[:, 0] - top2[:, 1]).tolist()))
    return results


@torch.inference_mode()
def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
