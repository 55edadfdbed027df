"""The process layer: engine cores in their own processes and the frontend's handle on them.
core_client (in process, one ZMQ engine core, data-parallel replicas), core_proc (the engine-core
process: handshake, IO threads, busy loop), managers (starting and watching cores: local
processes or Ray actors), coordinator (replica loads for routing), serial (msgpack frames).
Imports engine.core; the wire types live in engine.protocol."""
