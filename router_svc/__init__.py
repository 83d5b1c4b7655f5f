"""router_svc: picks a compatible, ready, non-draining replica for each request (pure core + gRPC service)."""
