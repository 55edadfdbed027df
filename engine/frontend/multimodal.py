"""Images in prompts for a vision-language model (Idefics3 / SmolVLM; the vision tower is
engine/model/vision.py): the frontend half.

    {"prompt": "What is in <image>?", "multi_modal_data": {"image": image or [images]}}

One `<image>` marker in the text per image, in order. An image is a PIL image, the bytes of an
image file, a data URL (data:image/png;base64,...) or a local file path (the Python API; the
HTTP server takes data URLs only). The model's Hugging Face processor expands each marker into
its placeholder tokens (a <fake_token_around_image>, row/column tags and image_seq_len <image>
tokens per tile: the image is cut into tiles plus one downscaled global tile) and makes the
pixel values; each image becomes one MMFeature (its tiles' pixels, the positions of its
placeholder tokens, a hash of the image) that travels with the request to the engine core.
The hash keys the runner's encoder cache and salts the prefix-cache hashes of the blocks that
hold the image's placeholders.
"""
import base64
import hashlib
import io
from pathlib import Path

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.model.vision import tokens_per_tile
from engine.protocol import MMFeature


class ImageProcessor:
    def __init__(self, folder: str, mc: ModelConfig):
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(folder)
        tok = self.hf.tokenizer
        self.image_marker = self.hf.image_token  # "<image>": in the text, and as the placeholder token
        self.image_token_id = mc.vision["image_token_id"]
        self.global_token_id = tok.convert_tokens_to_ids("<global-img>")
        self.tokens_per_tile = tokens_per_tile(mc.vision)
        if self.hf.image_seq_len != self.tokens_per_tile:
            raise ValueError(f"{folder}: the processor's image_seq_len {self.hf.image_seq_len} does not match the "
                             f"model's {self.tokens_per_tile} tokens per tile")

    def split_chat(self, messages: list[dict]) -> tuple[list[dict], list]:
        """(messages with each image part replaced by {"type": "image"} (the processor's chat
        template writes its <image> marker there), the images in order)."""
        out, images = [], []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, list):
                out.append(m)
                continue
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": p.get("text") or ""})
                elif kind in ("image_url", "image"):
                    image = p.get(kind)
                    image = image.get("url") if isinstance(image, dict) else image
                    if image is None:
                        raise InvalidRequestError(f"an {kind} part needs its image ({{'type': 'image_url', "
                                                  "'image_url': {'url': 'data:image/png;base64,...'}})",
                                                  "messages.content")
                    images.append(image)
                    parts.append({"type": "image"})
                else:
                    raise InvalidRequestError(f"content part type {kind!r} is not supported (text, image_url, "
                                              "image)", "messages.content")
            out.append(dict(m, content=parts))
        return out, images

    def process(self, text: str, images) -> tuple[list[int], list[MMFeature]]:
        """(prompt token ids with the placeholders, one MMFeature per image); InvalidRequestError
        for images that cannot be read or markers that do not match them."""
        images = [load_image(x) for x in (images if isinstance(images, (list, tuple)) else [images])]
        if text.count(self.image_marker) != len(images):
            raise InvalidRequestError(f"the prompt has {text.count(self.image_marker)} {self.image_marker} markers for "
                                      f"{len(images)} images (one marker per image, in order)", "prompt")
        out = self.hf(text=[text], images=[images] if images else None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, []
        tiles = out["pixel_values"][0]  # (tiles of every image, C, H, W): each image's tiles, global one last
        per_image = self._placeholder_runs(ids)
        if len(per_image) != len(images) or sum(len(runs) for runs in per_image) != tiles.shape[0]:
            raise InvalidRequestError("the prompt's image placeholders do not match its images (does the text "
                                      "hold <global-img> or <image> tokens of its own?)", "prompt")
        features, t = [], 0
        for image, runs in zip(images, per_image):
            digest = hashlib.blake2b(image.tobytes(), digest_size=16)
            digest.update(f"{image.mode}{image.size}".encode())
            features.append(MMFeature(digest.hexdigest(), [p for run in runs for p in run],
                                      tiles[t:t + len(runs)].contiguous()))
            t += len(runs)
        return ids, features

    def _placeholder_runs(self, ids: list[int]) -> list[list[list[int]]]:
        """Per image, its tiles' runs of placeholder positions: a run right after <global-img>
        (the global tile) ends an image."""
        images, current, run = [], [], []
        for i, t in enumerate(ids + [-1]):
            if t == self.image_token_id:
                run.append(i)
                continue
            if run:
                if len(run) != self.tokens_per_tile:
                    raise InvalidRequestError(f"a run of {len(run)} image placeholder tokens (a tile has "
                                              f"{self.tokens_per_tile}): do not write them into the prompt", "prompt")
                current.append(run)
                if ids[run[0] - 1] == self.global_token_id:
                    images.append(current)
                    current = []
                run = []
        return images if not current else []


def load_image(x):
    """A PIL RGB image from a PIL image, file bytes, a data URL or a local path."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    try:
        if isinstance(x, (bytes, bytearray)):
            data = bytes(x)
        elif isinstance(x, str) and x.startswith("data:"):
            head, _, payload = x.partition(",")
            if not head.endswith(";base64"):
                raise InvalidRequestError("an image data URL must be base64 (data:image/png;base64,...)", "image")
            data = base64.b64decode(payload, validate=True)
        elif isinstance(x, str) and x.startswith(("http://", "https://")):
            raise InvalidRequestError("image URLs are not fetched (no network access): send a data URL", "image")
        elif isinstance(x, (str, Path)):
            data = Path(str(x).removeprefix("file://")).read_bytes()
        else:
            raise InvalidRequestError(f"an image must be a PIL image, bytes, a data URL or a path, got "
                                      f"{type(x).__name__}", "image")
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, UnidentifiedImageError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"the image cannot be read: {e}", "image") from e
    return image.convert("RGB")
