"""The frontend's input side: prompts (text, token ids, chat messages, images for a
vision-language model: engine/frontend/multimodal.py) -> validated token ids (and image features)."""

from typing import NamedTuple

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.protocol import EngineCoreRequest, MMFeature
from engine.routed_experts import check_routed_experts
from engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class ProcessedPrompt(NamedTuple):
    """A prompt checked and tokenized (process() passes one through as it is)."""

    text: str | None
    ids: list[int]
    mm_features: list[MMFeature] | None


def load_tokenizer(config: EngineConfig):
    return AutoTokenizer.from_pretrained(config.tokenizer or config.model)


class Processor:
    def __init__(self, config: EngineConfig, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.vocab_size
        self.max_model_len = max_model_len
        eos = config.model_config.eos_token_ids or [tokenizer.eos_token_id]
        self.eos_token_id: int | None = eos[0] if eos and eos[0] is not None else None
        # no token spells more characters than the longest vocabulary entry: a longer text
        # cannot fit in the context, and is refused before the tokenizer spends time on it
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max(longest, 1) * max_model_len
        self.classifier = config.model_config.num_labels > 0
        mc = config.model_config
        self.routed_experts = (config.enable_return_routed_experts, mc.architecture, mc.moe is not None)
        self.images = None
        if config.model_config.vision:
            from engine.frontend.multimodal import ImageProcessor

            self.images = ImageProcessor(config.tokenizer or config.model, config.model_config)

    def supported_tasks(self) -> tuple[str, ...]:
        """What the loaded model serves: a causal LM generates and embeds (pooled hidden states),
        a sequence classifier (a reward model) classifies."""
        return ("classify",) if self.classifier else ("generate", "embed")

    def process(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams | None) -> ProcessedPrompt:
        """Returns (prompt text or None, prompt token ids, its images' features or None); raises
        InvalidRequestError."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params is not None:
            self.check_routed_experts(params)
        if self.classifier and (params is None or params.pooling is None):
            raise InvalidRequestError("this model is a sequence classifier: it serves encode / classify, not "
                                      "generation", "model")
        images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if images is None:
            text, ids = self.tokenize(prompt)
            self.check_token_ids(ids)
            return ProcessedPrompt(text, ids, None)
        if self.images is None:
            raise InvalidRequestError("this model takes no images (multi_modal_data)", "multi_modal_data")
        if not isinstance(images, dict) or set(images) - {"image"}:
            raise InvalidRequestError("multi_modal_data must be {'image': an image or a list of images}",
                                      "multi_modal_data")
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            raise InvalidRequestError("a prompt with images needs its text as 'prompt' (with one <image> marker "
                                      "per image), not token ids", "prompt")
        self.tokenize(text)  # the length checks
        ids, features = self.images.process(text, images.get("image", []))
        self.check_token_ids(ids)
        return ProcessedPrompt(text, ids, features or None)

    def check_routed_experts(self, params: SamplingParams) -> None:
        """return_routed_experts only from an engine that keeps them (the engine core checks it
        too: this is the early answer, before tokenizing)."""
        check_routed_experts(params.return_routed_experts, *self.routed_experts)

    def core_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      lora_id: int = 0, mm_features: list[MMFeature] | None = None,
                      cache_salt: str | None = None) -> list[EngineCoreRequest]:
        """What the engine core runs for one request: itself, or its n children ("<id>-<i>", each
        n=1, seeded seed+i) sharing the prompt's blocks (and its images' encoder outputs)."""
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string if provided", "cache_salt")
        if params.n == 1:
            return [EngineCoreRequest(request_id, token_ids, params, self.eos_token_id, lora_id=lora_id,
                                      mm_features=mm_features, cache_salt=cache_salt)]
        return [EngineCoreRequest(f"{request_id}-{i}", token_ids,
                                  params.clone(n=1, seed=None if params.seed is None else params.seed + i),
                                  self.eos_token_id, lora_id=lora_id, mm_features=mm_features, cache_salt=cache_salt)
                for i in range(params.n)]

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            if len(prompt) > self.max_prompt_chars:
                raise InvalidRequestError(
                    f"the prompt has {len(prompt)} characters: more than {self.max_model_len} tokens "
                    f"(max_model_len) can spell (at most {self.max_prompt_chars} characters)", "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}", "prompt")

    def check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the context holds {self.max_model_len} "
                f"(max_model_len), leaving no room to generate", "prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of the vocabulary [0, {self.vocab_size})", "prompt")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str | dict:
        """The conversation as the chat template renders it. Image parts of a message's content
        ({"type": "image_url", "image_url": {"url": ...}} as OpenAI sends them, or {"type": "image",
        "image": ...}; a vision-language model) make it the prompt dict {"prompt": text,
        "multi_modal_data": {"image": [...]}}, rendered with the processor's template."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("a conversation must be a list of {'role': ..., 'content': ...} dicts")
        template, images = self.tokenizer, []
        if self.images is not None:
            messages, images = self.images.split_chat(messages)
            template = self.images.hf if self.images.hf.chat_template else template
        else:
            messages = [_joined_text(m) for m in messages]
        text = template.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                            **kwargs)
        return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _joined_text(message: dict) -> dict:
    """A text model's message: content parts must all be text (joined into one string)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise InvalidRequestError("only text content parts are supported (this model takes no images)",
                                  "messages.content")
    return dict(message, content="".join(p.get("text") or "" for p in content))
