import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    """A tiny random-weight Llama (2 layers, hidden 64, the default model's vocabulary so its
    tokenizer fits), saved once per session: for engine tests that need a model, not its quality."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)
