"""worker_svc: executes round plans (torch engine or GPU cost model)."""
