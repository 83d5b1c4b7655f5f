"""admission_svc: the front door (identity, validation, budgets, backpressure, streaming)."""
