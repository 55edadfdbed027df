"""The frontend: LLM (offline) and AsyncLLM (online) turn prompts into token ids (processor,
multimodal), hand requests to the engine cores through engine.process, and assemble what comes
back into RequestOutputs (output_processor: detokenization, stop strings, n > 1); metrics are
the engine's series as Python objects. Imports engine.process and the root contracts only."""
