from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class ModelRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_ROLE_UNSPECIFIED: _ClassVar[ModelRole]
    MODEL_ROLE_ACTOR: _ClassVar[ModelRole]
    MODEL_ROLE_CRITIC: _ClassVar[ModelRole]
    MODEL_ROLE_REWARD: _ClassVar[ModelRole]
    MODEL_ROLE_REFERENCE: _ClassVar[ModelRole]

class UpdateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_MODE_UNSPECIFIED: _ClassVar[UpdateMode]
    UPDATE_MODE_FULL: _ClassVar[UpdateMode]
    UPDATE_MODE_PARTIAL: _ClassVar[UpdateMode]
    UPDATE_MODE_LORA: _ClassVar[UpdateMode]

class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATUS_UNSPECIFIED: _ClassVar[ServingStatus]
    SERVING_STATUS_LOADING: _ClassVar[ServingStatus]
    SERVING_STATUS_SERVING: _ClassVar[ServingStatus]
    SERVING_STATUS_WAITING_FOR_WEIGHTS: _ClassVar[ServingStatus]
    SERVING_STATUS_DRAINING: _ClassVar[ServingStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_BOOL: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
MODEL_ROLE_UNSPECIFIED: ModelRole
MODEL_ROLE_ACTOR: ModelRole
MODEL_ROLE_CRITIC: ModelRole
MODEL_ROLE_REWARD: ModelRole
MODEL_ROLE_REFERENCE: ModelRole
UPDATE_MODE_UNSPECIFIED: UpdateMode
UPDATE_MODE_FULL: UpdateMode
UPDATE_MODE_PARTIAL: UpdateMode
UPDATE_MODE_LORA: UpdateMode
SERVING_STATUS_UNSPECIFIED: ServingStatus
SERVING_STATUS_LOADING: ServingStatus
SERVING_STATUS_SERVING: ServingStatus
SERVING_STATUS_WAITING_FOR_WEIGHTS: ServingStatus
SERVING_STATUS_DRAINING: ServingStatus

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RaggedTokenIds(_message.Message):
    __slots__ = ("values", "lengths")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class TextPrompts(_message.Message):
    __slots__ = ("texts", "apply_chat_template")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    apply_chat_template: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., apply_chat_template: _Optional[bool] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "stop_sequences", "stop_strings", "seed", "ignore_eos", "logprobs_use_temperature")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_USE_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    logprobs_use_temperature: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., stop_sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs_use_temperature: _Optional[bool] = ...) -> None: ...

class AlgorithmOptions(_message.Message):
    __slots__ = ("preset", "advantage_estimator", "gamma", "lam", "kl_coef", "kl_estimator", "kl_clamp", "kl_mode", "reward_placement", "reward_clip", "whitening", "advantage_clip", "group_std_eps", "high_entropy_token_ratio", "dynamic_sampling", "overlong_buffer", "overlong_factor", "clip_filter_eps", "reproduce_upstream_quirks", "experience_norm", "stop_properly_penalty", "overlong_length", "length_normalized_log_probs", "action_mask_rule", "reward_running_norm", "reward_moments")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    LAM_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    KL_CLAMP_FIELD_NUMBER: _ClassVar[int]
    KL_MODE_FIELD_NUMBER: _ClassVar[int]
    REWARD_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REWARD_CLIP_FIELD_NUMBER: _ClassVar[int]
    WHITENING_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_CLIP_FIELD_NUMBER: _ClassVar[int]
    GROUP_STD_EPS_FIELD_NUMBER: _ClassVar[int]
    HIGH_ENTROPY_TOKEN_RATIO_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_BUFFER_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_FACTOR_FIELD_NUMBER: _ClassVar[int]
    CLIP_FILTER_EPS_FIELD_NUMBER: _ClassVar[int]
    REPRODUCE_UPSTREAM_QUIRKS_FIELD_NUMBER: _ClassVar[int]
    EXPERIENCE_NORM_FIELD_NUMBER: _ClassVar[int]
    STOP_PROPERLY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_NORMALIZED_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_RULE_FIELD_NUMBER: _ClassVar[int]
    REWARD_RUNNING_NORM_FIELD_NUMBER: _ClassVar[int]
    REWARD_MOMENTS_FIELD_NUMBER: _ClassVar[int]
    preset: str
    advantage_estimator: str
    gamma: float
    lam: float
    kl_coef: float
    kl_estimator: str
    kl_clamp: float
    kl_mode: str
    reward_placement: str
    reward_clip: float
    whitening: str
    advantage_clip: float
    group_std_eps: float
    high_entropy_token_ratio: float
    dynamic_sampling: bool
    overlong_buffer: int
    overlong_factor: float
    clip_filter_eps: float
    reproduce_upstream_quirks: bool
    experience_norm: bool
    stop_properly_penalty: float
    overlong_length: str
    length_normalized_log_probs: bool
    action_mask_rule: str
    reward_running_norm: str
    reward_moments: RewardMoments
    def __init__(self, preset: _Optional[str] = ..., advantage_estimator: _Optional[str] = ..., gamma: _Optional[float] = ..., lam: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[str] = ..., kl_clamp: _Optional[float] = ..., kl_mode: _Optional[str] = ..., reward_placement: _Optional[str] = ..., reward_clip: _Optional[float] = ..., whitening: _Optional[str] = ..., advantage_clip: _Optional[float] = ..., group_std_eps: _Optional[float] = ..., high_entropy_token_ratio: _Optional[float] = ..., dynamic_sampling: _Optional[bool] = ..., overlong_buffer: _Optional[int] = ..., overlong_factor: _Optional[float] = ..., clip_filter_eps: _Optional[float] = ..., reproduce_upstream_quirks: _Optional[bool] = ..., experience_norm: _Optional[bool] = ..., stop_properly_penalty: _Optional[float] = ..., overlong_length: _Optional[str] = ..., length_normalized_log_probs: _Optional[bool] = ..., action_mask_rule: _Optional[str] = ..., reward_running_norm: _Optional[str] = ..., reward_moments: _Optional[_Union[RewardMoments, _Mapping]] = ...) -> None: ...

class RewardMoments(_message.Message):
    __slots__ = ("count", "mean", "var")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    VAR_FIELD_NUMBER: _ClassVar[int]
    count: float
    mean: float
    var: float
    def __init__(self, count: _Optional[float] = ..., mean: _Optional[float] = ..., var: _Optional[float] = ...) -> None: ...

class RewardTerm(_message.Message):
    __slots__ = ("source", "weight")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    source: str
    weight: float
    def __init__(self, source: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class BatchingOptions(_message.Message):
    __slots__ = ("micro_batch_size", "generate_batch_size", "forward_batch_size")
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    micro_batch_size: int
    generate_batch_size: int
    forward_batch_size: int
    def __init__(self, micro_batch_size: _Optional[int] = ..., generate_batch_size: _Optional[int] = ..., forward_batch_size: _Optional[int] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("action_entropy", "response_texts")
    ACTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXTS_FIELD_NUMBER: _ClassVar[int]
    action_entropy: bool
    response_texts: bool
    def __init__(self, action_entropy: _Optional[bool] = ..., response_texts: _Optional[bool] = ...) -> None: ...

class MakeExperienceRequest(_message.Message):
    __slots__ = ("token_ids", "texts", "gt_answers", "samples_per_prompt", "sampling", "algorithm", "rewards", "batching", "outputs", "min_policy_version", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    GT_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: RaggedTokenIds
    texts: TextPrompts
    gt_answers: _containers.RepeatedScalarFieldContainer[str]
    samples_per_prompt: int
    sampling: SamplingOptions
    algorithm: AlgorithmOptions
    rewards: _containers.RepeatedCompositeFieldContainer[RewardTerm]
    batching: BatchingOptions
    outputs: OutputOptions
    min_policy_version: int
    request_id: str
    def __init__(self, token_ids: _Optional[_Union[RaggedTokenIds, _Mapping]] = ..., texts: _Optional[_Union[TextPrompts, _Mapping]] = ..., gt_answers: _Optional[_Iterable[str]] = ..., samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., algorithm: _Optional[_Union[AlgorithmOptions, _Mapping]] = ..., rewards: _Optional[_Iterable[_Union[RewardTerm, _Mapping]]] = ..., batching: _Optional[_Union[BatchingOptions, _Mapping]] = ..., outputs: _Optional[_Union[OutputOptions, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class Experience(_message.Message):
    __slots__ = ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "values", "reward", "kl", "advantages", "returns", "action_entropy", "info", "policy_version", "prompt_index", "response_texts", "rollout_log_probs")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_FIELD_NUMBER: _ClassVar[int]
    ACTION_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    BASE_ACTION_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    ACTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXTS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    action_log_probs: Tensor
    base_action_log_probs: Tensor
    values: Tensor
    reward: Tensor
    kl: Tensor
    advantages: Tensor
    returns: Tensor
    action_entropy: Tensor
    info: _containers.MessageMap[str, Tensor]
    policy_version: Tensor
    prompt_index: Tensor
    response_texts: _containers.RepeatedScalarFieldContainer[str]
    rollout_log_probs: Tensor
    def __init__(self, sequences: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., action_mask: _Optional[_Union[Tensor, _Mapping]] = ..., action_log_probs: _Optional[_Union[Tensor, _Mapping]] = ..., base_action_log_probs: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., reward: _Optional[_Union[Tensor, _Mapping]] = ..., kl: _Optional[_Union[Tensor, _Mapping]] = ..., advantages: _Optional[_Union[Tensor, _Mapping]] = ..., returns: _Optional[_Union[Tensor, _Mapping]] = ..., action_entropy: _Optional[_Union[Tensor, _Mapping]] = ..., info: _Optional[_Mapping[str, Tensor]] = ..., policy_version: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_index: _Optional[_Union[Tensor, _Mapping]] = ..., response_texts: _Optional[_Iterable[str]] = ..., rollout_log_probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class MakeExperienceResponse(_message.Message):
    __slots__ = ("experience", "micro_batch_index", "num_micro_batches", "pad_token_id")
    EXPERIENCE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    experience: Experience
    micro_batch_index: int
    num_micro_batches: int
    pad_token_id: int
    def __init__(self, experience: _Optional[_Union[Experience, _Mapping]] = ..., micro_batch_index: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., pad_token_id: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "fan_in_fan_out")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    FAN_IN_FAN_OUT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    fan_in_fan_out: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., fan_in_fan_out: _Optional[bool] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("target", "version", "mode", "total_bytes", "manifest", "sha256", "lora", "allow_non_finite", "shared_memory", "distributed", "cuda_ipc", "parallel")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    target: ModelRole
    version: int
    mode: UpdateMode
    total_bytes: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    sha256: str
    lora: LoraAdapter
    allow_non_finite: bool
    shared_memory: SharedMemorySource
    distributed: DistributedSource
    cuda_ipc: CudaIpcSource
    parallel: ParallelPart
    def __init__(self, target: _Optional[_Union[ModelRole, str]] = ..., version: _Optional[int] = ..., mode: _Optional[_Union[UpdateMode, str]] = ..., total_bytes: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., sha256: _Optional[str] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ..., shared_memory: _Optional[_Union[SharedMemorySource, _Mapping]] = ..., distributed: _Optional[_Union[DistributedSource, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcSource, _Mapping]] = ..., parallel: _Optional[_Union[ParallelPart, _Mapping]] = ...) -> None: ...

class SharedMemorySource(_message.Message):
    __slots__ = ("pid", "fd", "streamed")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    streamed: bool
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., streamed: _Optional[bool] = ...) -> None: ...

class SharedMemoryWritten(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class DistributedSource(_message.Message):
    __slots__ = ("group", "bucket_bytes", "contiguous")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTIGUOUS_FIELD_NUMBER: _ClassVar[int]
    group: str
    bucket_bytes: int
    contiguous: bool
    def __init__(self, group: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., contiguous: _Optional[bool] = ...) -> None: ...

class CudaIpcSource(_message.Message):
    __slots__ = ("buffers", "spans", "host_id")
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    spans: _containers.RepeatedCompositeFieldContainer[CudaIpcSpan]
    host_id: str
    def __init__(self, buffers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ..., spans: _Optional[_Iterable[_Union[CudaIpcSpan, _Mapping]]] = ..., host_id: _Optional[str] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("device_uuid", "device", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class CudaIpcSpan(_message.Message):
    __slots__ = ("begin", "end", "buffer", "offset")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    begin: int
    end: int
    buffer: int
    offset: int
    def __init__(self, begin: _Optional[int] = ..., end: _Optional[int] = ..., buffer: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ParallelPart(_message.Message):
    __slots__ = ("update_id", "streams", "index", "begin", "end")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    streams: int
    index: int
    begin: int
    end: int
    def __init__(self, update_id: _Optional[str] = ..., streams: _Optional[int] = ..., index: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("offset", "data", "crc32")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk", "shm_written")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHM_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: WeightsChunk
    shm_written: SharedMemoryWritten
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[WeightsChunk, _Mapping]] = ..., shm_written: _Optional[_Union[SharedMemoryWritten, _Mapping]] = ...) -> None: ...

class UpdateWeightsAtOnceRequest(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[UpdateWeightsRequest]
    def __init__(self, messages: _Optional[_Iterable[_Union[UpdateWeightsRequest, _Mapping]]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("target", "version", "tensors", "bytes", "seconds", "transport")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    target: ModelRole
    version: int
    tensors: int
    bytes: int
    seconds: float
    transport: str
    def __init__(self, target: _Optional[_Union[ModelRole, str]] = ..., version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class InitWeightsGroupRequest(_message.Message):
    __slots__ = ("group", "master_address", "master_port", "world_size", "rank", "backend", "timeout_s", "lanes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    group: str
    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str
    timeout_s: float
    lanes: int
    def __init__(self, group: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ..., lanes: _Optional[int] = ...) -> None: ...

class InitWeightsGroupResponse(_message.Message):
    __slots__ = ("backend", "device", "lanes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device: str
    lanes: int
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[str] = ..., lanes: _Optional[int] = ...) -> None: ...

class DestroyWeightsGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class DestroyWeightsGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber_id", "max_batches", "window", "taken")
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    max_batches: int
    window: int
    taken: int
    def __init__(self, subscriber_id: _Optional[str] = ..., max_batches: _Optional[int] = ..., window: _Optional[int] = ..., taken: _Optional[int] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("experience", "batch_index", "epoch", "step")
    EXPERIENCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    experience: Experience
    batch_index: int
    epoch: int
    step: int
    def __init__(self, experience: _Optional[_Union[Experience, _Mapping]] = ..., batch_index: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class RolloutProgress(_message.Message):
    __slots__ = ("enabled", "finished", "epoch", "step", "batches_delivered", "batches_dropped_stale", "queued_batches", "subscribers")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    finished: bool
    epoch: int
    step: int
    batches_delivered: int
    batches_dropped_stale: int
    queued_batches: int
    subscribers: int
    def __init__(self, enabled: _Optional[bool] = ..., finished: _Optional[bool] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., batches_delivered: _Optional[int] = ..., batches_dropped_stale: _Optional[int] = ..., queued_batches: _Optional[int] = ..., subscribers: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("role", "source", "architecture", "dtype", "num_parameters", "policy_version")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    role: ModelRole
    source: str
    architecture: str
    dtype: str
    num_parameters: int
    policy_version: int
    def __init__(self, role: _Optional[_Union[ModelRole, str]] = ..., source: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., num_parameters: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "policy_version", "models", "device", "queue_depth", "uptime_s", "server_version", "default_preset", "vocab_size", "max_context_tokens", "rollout", "shm_host_id", "weight_transports", "generation_path", "kv_cache_tokens", "eager_fallbacks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRESET_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EAGER_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    status: ServingStatus
    policy_version: int
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    device: str
    queue_depth: int
    uptime_s: float
    server_version: str
    default_preset: str
    vocab_size: int
    max_context_tokens: int
    rollout: RolloutProgress
    shm_host_id: str
    weight_transports: _containers.RepeatedScalarFieldContainer[str]
    generation_path: str
    kv_cache_tokens: int
    eager_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[ServingStatus, str]] = ..., policy_version: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., device: _Optional[str] = ..., queue_depth: _Optional[int] = ..., uptime_s: _Optional[float] = ..., server_version: _Optional[str] = ..., default_preset: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., rollout: _Optional[_Union[RolloutProgress, _Mapping]] = ..., shm_host_id: _Optional[str] = ..., weight_transports: _Optional[_Iterable[str]] = ..., generation_path: _Optional[str] = ..., kv_cache_tokens: _Optional[int] = ..., eager_fallbacks: _Optional[_Iterable[str]] = ...) -> None: ...
