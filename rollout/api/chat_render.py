"""Chat templates and long texts off the event loop, for every route that renders a conversation
(/generate, /v1/chat/completions, TRL's /chat/, and the prefix-token rule in
rollout/api/chat_prefix.py)."""
import asyncio

from engine.errors import InvalidRequestError
from rollout.api.errors import APIError

INLINE_CHARS = 8192  # shorter texts are tokenized on the event loop (a thread hop costs more)


async def off_loop(fn, *args, size: int, **kwargs):
    """fn(*args) in a worker thread when `size` (characters) makes it long, inline otherwise: a
    long text must not freeze the event loop that serves every other request (the tokenizer
    releases the GIL)."""
    if size > INLINE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def render_chat(state, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False,
                      chat_template_kwargs: dict | None = None, tools: list | None = None) -> str | dict:
    """The conversation as the model's chat template renders it (a 400 naming `messages` if it
    cannot); with images (image_url parts, a vision-language model) the prompt dict
    {"prompt": text, "multi_modal_data": {"image": [urls]}}, rendered by the model's processor."""
    convo = [m.to_template() for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        prompt = await off_loop(state.engine.processor.apply_chat_template, convo,
                                size=sum(len(str(m.get("content") or "")) for m in convo),
                                add_generation_prompt=add_generation_prompt and not continue_final_message,
                                continue_final_message=continue_final_message, **kwargs)
    except InvalidRequestError as e:  # unsupported content parts
        raise APIError(400, str(e), e.param or "messages") from e
    except Exception as e:  # jinja errors, bad roles, ...
        raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from e
    if isinstance(prompt, dict):
        check_image_urls(prompt["multi_modal_data"]["image"], "messages.content")
    return prompt


def check_image_urls(urls: list, param: str) -> None:
    """Images reach the server as data URLs only: a path would read the server's files, and
    there is no network to fetch a URL from."""
    bad = next((u for u in urls if not (isinstance(u, str) and u.startswith("data:"))), None)
    if bad is not None:
        raise APIError(400, f"images must be data URLs (data:image/png;base64,...), got {str(bad)[:40]!r}", param)
