"""Workers: the executor (how the core reaches them), Worker (weights, staged updates, sleep),
ModelRunner (inputs, forward pass, sampling), LoRA adapters and the step profiler. Imports
engine.model and weight_sync's receiving side."""
