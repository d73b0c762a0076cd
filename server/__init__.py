"""rollserve.server: the rollout service (transformers models behind gRPC)."""
