"""rollserve v1 wire contract: generated protobuf and gRPC stubs of rollout.proto (never edited)."""
