"""planner_svc: sizes the replica fleet from queues, request lengths, SLOs and load/warm-up time (pure core + connectors)."""
