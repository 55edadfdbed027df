"""The vision tower of an Idefics3 / SmolVLM model: a SigLIP-style ViT (patch convolution, learned
position embeddings, pre-norm encoder layers with bidirectional attention, a final LayerNorm)
and the connector (pixel shuffle: each scale x scale square of patch vectors becomes one vector,
then a linear projection into the decoder's hidden size).

    VisionEncoder(mc.vision, text_hidden, dtype, device).encode(pixel_values)
        pixel_values (tiles, channels, H, W) of one image -> (tiles * tokens_per_tile, text_hidden)

The tiles of one image are the image processor's crops (all of the tile size; no padding), so
every patch is real and no attention mask is needed. Weights are plain tensors by their Hugging
Face names (`tensors`), loaded and pushed like the decoder's.
"""
import torch
import torch.nn.functional as F


def tokens_per_tile(vc: dict) -> int:
    """Placeholder tokens (encoder output rows) per image tile: patches / scale_factor^2."""
    return (vc["image_size"] // vc["patch_size"]) ** 2 // vc["scale_factor"] ** 2


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class VisionEncoder:
    """`compute_dtype`: what the tower computes in (default: the weights' dtype). A bf16 model on a
    CPU whose torch bf16 matmul is slow (no oneDNN bf16, as on AVX2-only CPUs) encodes in
    float32, ~6x faster there at a tile's 1024 rows: the weights are widened per call (a cost
    small beside the matmuls) and the output rounded once to the model's dtype."""

    def __init__(self, vc: dict, text_hidden: int, dtype: torch.dtype, device: torch.device,
                 compute_dtype: torch.dtype | None = None):
        self.dtype, self.device, self.compute_dtype = dtype, device, compute_dtype or dtype
        E, inter, C, p = vc["hidden_size"], vc["intermediate_size"], vc.get("num_channels", 3), vc["patch_size"]
        self.patch, self.heads, self.eps = p, vc["num_attention_heads"], vc.get("layer_norm_eps", 1e-6)
        self.scale_factor = vc["scale_factor"]
        self.per_side = vc["image_size"] // p  # patches per side of a full tile
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]

        def t(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        pre = "model.vision_model."
        w = {pre + "embeddings.patch_embedding.weight": t(E, C, p, p), pre + "embeddings.patch_embedding.bias": t(E),
             pre + "embeddings.position_embedding.weight": t(self.per_side ** 2, E),
             pre + "post_layernorm.weight": t(E), pre + "post_layernorm.bias": t(E),
             "model.connector.modality_projection.proj.weight": t(text_hidden, E * self.scale_factor ** 2)}
        self.num_layers = vc["num_hidden_layers"]
        for i in range(self.num_layers):
            lp = f"{pre}encoder.layers.{i}."
            for n in ("layer_norm1", "layer_norm2"):
                w[f"{lp}{n}.weight"], w[f"{lp}{n}.bias"] = t(E), t(E)
            for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
                w[f"{lp}self_attn.{n}.weight"], w[f"{lp}self_attn.{n}.bias"] = t(E, E), t(E)
            w[f"{lp}mlp.fc1.weight"], w[f"{lp}mlp.fc1.bias"] = t(inter, E), t(inter)
            w[f"{lp}mlp.fc2.weight"], w[f"{lp}mlp.fc2.bias"] = t(E, inter), t(E)
        self.tensors = w

    def _position_ids(self, h: int, w: int) -> torch.Tensor:
        """Idefics3's position ids for an h x w patch grid: fractional coordinates bucketed onto
        the per_side x per_side grid of learned positions (identity for a full tile)."""
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side)
        rows = torch.bucketize(torch.clamp(torch.arange(h, dtype=torch.float32) * (1.0 / h), max=1.0 - 1e-6),
                               boundaries, right=True)
        cols = torch.bucketize(torch.clamp(torch.arange(w, dtype=torch.float32) * (1.0 / w), max=1.0 - 1e-6),
                               boundaries, right=True)
        return (rows[:, None] * self.per_side + cols[None, :]).reshape(-1).to(self.device)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cd = self.compute_dtype
        w = self.tensors if cd == self.dtype else _Widened(self.tensors, cd)
        pre, eps = "model.vision_model.", self.eps
        x = pixel_values.to(self.device, cd)
        x = F.conv2d(x, w[pre + "embeddings.patch_embedding.weight"], w[pre + "embeddings.patch_embedding.bias"],
                     stride=self.patch)  # (tiles, E, h, w)
        tiles, E, gh, gw = x.shape
        x = x.flatten(2).transpose(1, 2)  # (tiles, h * w, E)
        x = x + F.embedding(self._position_ids(gh, gw), w[pre + "embeddings.position_embedding.weight"])
        N, heads = x.shape[1], self.heads
        for i in range(self.num_layers):
            lp = f"{pre}encoder.layers.{i}."
            y = F.layer_norm(x, (E,), w[lp + "layer_norm1.weight"], w[lp + "layer_norm1.bias"], eps)
            q, k, v = (F.linear(y, w[f"{lp}self_attn.{n}.weight"], w[f"{lp}self_attn.{n}.bias"])
                       .view(tiles, N, heads, E // heads).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(tiles, N, E)
            x = x + F.linear(a, w[lp + "self_attn.out_proj.weight"], w[lp + "self_attn.out_proj.bias"])
            y = F.layer_norm(x, (E,), w[lp + "layer_norm2.weight"], w[lp + "layer_norm2.bias"], eps)
            y = self.act(F.linear(y, w[lp + "mlp.fc1.weight"], w[lp + "mlp.fc1.bias"]))
            x = x + F.linear(y, w[lp + "mlp.fc2.weight"], w[lp + "mlp.fc2.bias"])
        x = F.layer_norm(x, (E,), w[pre + "post_layernorm.weight"], w[pre + "post_layernorm.bias"], eps)
        x = pixel_shuffle(x, gh, gw, self.scale_factor)
        proj = w["model.connector.modality_projection.proj.weight"]
        return F.linear(x, proj).reshape(-1, proj.shape[0]).to(self.dtype)


class _Widened:
    """The weights by name, each converted to `dtype` as it is read."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self.tensors, self.dtype = tensors, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.dtype)


def pixel_shuffle(x: torch.Tensor, h: int, w: int, s: int) -> torch.Tensor:
    """(tiles, h * w, E) -> (tiles, h * w / s^2, E * s^2), the connector's layout: each output
    vector concatenates an s x s square of patch vectors (Idefics3Connector.pixel_shuffle)."""
    tiles, _, E = x.shape
    x = x.reshape(tiles, h, w // s, E * s).permute(0, 2, 1, 3)
    x = x.reshape(tiles, w // s, h // s, E * s * s).permute(0, 2, 1, 3)
    return x.reshape(tiles, (h // s) * (w // s), E * s * s)
