"""The wire vocabulary client and server share: errors, tensors, framing, Experience."""
