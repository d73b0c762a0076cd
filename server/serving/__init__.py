"""The gRPC face: server, servicer, interceptors, auth, metrics, command line."""
