"""Sluice in front of an unmodified vLLM OpenAI server: the gateway core, the KV-event translation, the agent.

Pure (no I/O, importable in vLLM's own process): `hashing`, `kv`, `gateway`, `sched_cls` (vLLM's
--scheduler-cls, which imports vLLM). With I/O: `link` (HTTP + ZMQ to the engine), `driver`, `replica`.
"""
