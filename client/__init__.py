"""rollserve.client: the thin trainer-side library (no transformers)."""
