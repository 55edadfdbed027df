"""The engine core: EngineCore (one step; owner of the pause, sleep and weight-version state),
the Scheduler (continuous batching, preemption, held requests), the KV cache block manager (prefix
caching), Request and the streaming-input state machine. Token ids only. Imports engine.worker
(through the executor) and the root contracts."""
