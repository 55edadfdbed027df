"""Module-level functions that apply_model runs on the workers' models (the engine-core process
imports them by path: tests.engine.model_fns:<name>)."""


def num_layers(model) -> int:
    return len(model.layers)


def embedding_summary(model) -> dict:
    """Plain values and a tensor: what travels back over msgpack."""
    embed = model.hf_view(model.mc.text_prefix + "embed_tokens.weight")
    return {"shape": list(embed.shape), "dtype": str(embed.dtype).removeprefix("torch."),
            "row0": embed[0].detach().clone()}


class Probes:
    @staticmethod
    def hidden_size(model) -> int:
        return model.embed.shape[1]
