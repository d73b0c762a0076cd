"""The engine thread that owns the device, and the jobs the bulk RPCs run on it."""
