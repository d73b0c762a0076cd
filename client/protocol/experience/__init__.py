"""Experience: one micro-batch of the proto's Experience as torch tensors, and its buffer rows.

fields.py    the tensor fields (name, per-row axis, dtype): the one list every loop reads
records.py   Experience and BufferItem, and the shape and dtype checks they run when built
proto.py     Experience <-> rollserve.v1.Experience
batching.py  split into rows, stack rows, join micro-batches (the wire layout throughout)
"""

from .batching import concat_experiences, make_experience_batch, split_experience_batch
from .fields import EXPERIENCE_ACTION_FIELDS, EXPERIENCE_SEQUENCE_FIELDS, EXPERIENCE_TENSOR_FIELDS
from .proto import experience_from_proto, experience_to_proto
from .records import BufferItem, Experience

__all__ = [
    "EXPERIENCE_ACTION_FIELDS",
    "EXPERIENCE_SEQUENCE_FIELDS",
    "EXPERIENCE_TENSOR_FIELDS",
    "Experience",
    "BufferItem",
    "experience_to_proto",
    "experience_from_proto",
    "split_experience_batch",
    "make_experience_batch",
    "concat_experiences",
]
