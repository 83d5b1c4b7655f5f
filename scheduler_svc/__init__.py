"""scheduler_svc: the per-replica scheduler (pure core + gRPC service)."""
