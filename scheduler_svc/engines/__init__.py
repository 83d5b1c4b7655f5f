"""Engines other than Sluice's own worker, each behind one adapter that speaks the scheduler's contract.

A replica of any engine is the same thing to admission, the router and the planner: a `SchedulerService` on
gRPC that registers and heartbeats at the router, publishes token deltas, completions and KV events on Redis,
and hands requests to migration by the one DRAIN_HANDOFF rule. `vllm/` adapts an unmodified vLLM server.
"""
