from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "input_ids", "add_special_tokens", "truncate", "sampling", "stopping", "top_n_tokens", "prefill_details", "prefill_top_n_tokens", "skip_special_tokens", "spaces_between_special_tokens", "n", "grammar", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DETAILS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    add_special_tokens: bool
    truncate: int
    sampling: SamplingParameters
    stopping: StoppingCriteria
    top_n_tokens: int
    prefill_details: bool
    prefill_top_n_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    grammar: Grammar
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., add_special_tokens: _Optional[bool] = ..., truncate: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., top_n_tokens: _Optional[int] = ..., prefill_details: _Optional[bool] = ..., prefill_top_n_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "regex", "ebnf", "choice", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    ebnf: str
    choice: ChoiceList
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "min_p", "logit_bias", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    speculative: bool
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos", "stop_token_ids", "min_new_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_new_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class TopToken(_message.Message):
    __slots__ = ("id", "text", "logprob", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ...) -> None: ...

class PrefillToken(_message.Message):
    __slots__ = ("id", "text", "logprob", "top_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopToken]
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[_Union[TopToken, _Mapping]]] = ...) -> None: ...

class FinishDetails(_message.Message):
    __slots__ = ("reason", "generated_tokens", "prompt_tokens", "cached_prompt_tokens", "seed", "queue_time_ns", "inference_time_ns", "preemptions", "cumulative_logprob")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int
    seed: int
    queue_time_ns: int
    inference_time_ns: int
    preemptions: int
    cumulative_logprob: float
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., queue_time_ns: _Optional[int] = ..., inference_time_ns: _Optional[int] = ..., preemptions: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "special", "index", "top_tokens", "prefill", "finish", "sequence")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    index: int
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopToken]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillToken]
    finish: FinishDetails
    sequence: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ..., index: _Optional[int] = ..., top_tokens: _Optional[_Iterable[_Union[TopToken, _Mapping]]] = ..., prefill: _Optional[_Iterable[_Union[PrefillToken, _Mapping]]] = ..., finish: _Optional[_Union[FinishDetails, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "revision", "architecture", "dtype", "device_type", "max_input_tokens", "max_total_tokens", "max_batch_tokens", "max_concurrent_requests", "block_size", "num_kv_blocks", "strategy", "shards", "vocab_size", "eos_token_ids", "tokenizer_json", "tokenizer_config_json", "version", "rank_parameter_bytes", "adapters", "max_sequences_per_request", "runtime", "openai_port")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    OPENAI_PORT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    architecture: str
    dtype: str
    device_type: str
    max_input_tokens: int
    max_total_tokens: int
    max_batch_tokens: int
    max_concurrent_requests: int
    block_size: int
    num_kv_blocks: int
    strategy: str
    shards: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_json: bytes
    tokenizer_config_json: bytes
    version: str
    rank_parameter_bytes: _containers.RepeatedScalarFieldContainer[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_sequences_per_request: int
    runtime: str
    openai_port: int
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., strategy: _Optional[str] = ..., shards: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_json: _Optional[bytes] = ..., tokenizer_config_json: _Optional[bytes] = ..., version: _Optional[str] = ..., rank_parameter_bytes: _Optional[_Iterable[int]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_sequences_per_request: _Optional[int] = ..., runtime: _Optional[str] = ..., openai_port: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "source", "rank", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "message", "adapters")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    message: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serving: _Optional[bool] = ..., message: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("waiting", "running", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits", "preemptions_total", "generated_tokens_total", "steps_total", "ranks", "activation_cache")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CACHE_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions_total: int
    generated_tokens_total: int
    steps_total: int
    ranks: _containers.RepeatedCompositeFieldContainer[StatsResponse]
    activation_cache: ActivationCacheStats
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., steps_total: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[StatsResponse, _Mapping]]] = ..., activation_cache: _Optional[_Union[ActivationCacheStats, _Mapping]] = ...) -> None: ...

class ActivationCacheStats(_message.Message):
    __slots__ = ("lookups", "hits", "misses", "hit_blocks", "miss_blocks", "prefill_tokens_saved", "bytes_read", "bytes_written", "blocks_written", "rejected_entries", "redis_errors", "timeouts", "fetch_seconds_sum", "fetch_count", "redis_up")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REDIS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    FETCH_COUNT_FIELD_NUMBER: _ClassVar[int]
    REDIS_UP_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    misses: int
    hit_blocks: int
    miss_blocks: int
    prefill_tokens_saved: int
    bytes_read: int
    bytes_written: int
    blocks_written: int
    rejected_entries: int
    redis_errors: int
    timeouts: int
    fetch_seconds_sum: float
    fetch_count: int
    redis_up: bool
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., prefill_tokens_saved: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., blocks_written: _Optional[int] = ..., rejected_entries: _Optional[int] = ..., redis_errors: _Optional[int] = ..., timeouts: _Optional[int] = ..., fetch_seconds_sum: _Optional[float] = ..., fetch_count: _Optional[int] = ..., redis_up: _Optional[bool] = ...) -> None: ...
