"""The vocabulary client and server share; the server imports nothing else of the client.

errors.py          the domain errors and their gRPC status codes
dtypes.py          torch dtype <-> wire DType <-> safetensors name: one table
roles.py           model role name <-> wire ModelRole: one table
transports.py      the names of UpdateWeights' data planes
shared_memory.py   who can open whose memfd, and the seals a shared-memory update needs
cuda_ipc.py        who can open whose CUDA IPC handles, a GPU's name across processes, bounds
codec.py           torch tensors <-> rollserve.v1.Tensor
wire.py            UpdateWeights' messages, hand-encoded and parsed without copies
process_group.py   the torch.distributed side of a weights group (both ranks' builders)
requests.py        the options of MakeExperience and UpdateWeights, as frozen dataclasses
reward_moments.py  LightRFT's running reward moments, threaded by the trainer between requests
results.py         the replies a trainer reads (Health, UpdateWeights) as plain dataclasses
experience/        Experience: the proto's micro-batches as torch tensors
"""
