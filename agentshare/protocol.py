"""Wire schemas of the agentshare server: the OpenAI-compatible API and the native API.

Pydantic only (no torch): the SDK imports this module, and so does the server. Requests
tolerate unknown fields (clients send e.g. ``user`` or ``metadata``), except the sampling knobs
this server does not implement (:data:`UNSUPPORTED_SAMPLING`, e.g. ``min_p``), which are refused
rather than silently ignored; optional knobs default to ``None`` so the server applies its own
defaults. Each generating request says what it asks of the sampler in one
:class:`SamplingSpec` (its ``sampling()``), from which the server builds its sampling parameters. Responses mirror OpenAI's shapes field for
field, so the ``openai`` package's own types validate them.

::

    OpenAI-compatible                 native
    ─────────────────                 ──────
    ChatCompletionRequest             ContextCreate / ContextExtend -> ContextInfo
      -> ChatCompletion | Chunk*      GenerateRequest -> Generation | GenerationChunk*
    CompletionRequest                 ExplainRequest -> Explanation
      -> Completion (also streamed)   AgentList (AgentInfo*), Health
    ModelList (Model*)                ErrorResponse (every error, both APIs)

>>> req = ChatCompletionRequest.model_validate(
...     {"model": "coder", "messages": [{"role": "user", "content": "hi"}],
...      "max_completion_tokens": 8, "repetition_penalty": 1.1})
>>> req.token_limit(), req.messages[0].text()
(8, 'hi')
>>> spec = req.sampling()
>>> spec.max_tokens, spec.repetition_penalty, spec.temperature
(8, 1.1, None)
>>> ErrorResponse.of("bad value", param="n").model_dump()["error"]["type"]
'invalid_request_error'

Text must be valid Unicode (a lone surrogate such as ``"\\ud800"`` cannot be tokenized), and a
seed must fit the 64-bit generator for every choice (``seed + n - 1 < 2**64``):

>>> from pydantic import ValidationError
>>> try:
...     CompletionRequest.model_validate({"model": "base", "prompt": "x", "seed": 2**64 - 1, "n": 2})
... except ValidationError as exc:
...     print(exc.errors()[0]["msg"].split(":")[0])
Value error, seed
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # per stop sequence
MAX_TOP_K = 2**31 - 1
SEED_LIMIT = 2**64  # seeds are 64-bit: 0 <= seed + i < 2**64 for every choice i


def valid_unicode(value: str) -> str:
    """``value`` unchanged if it is valid Unicode text; a lone surrogate (which JSON's ``\\ud800``
    escapes can carry, but no tokenizer can encode) raises an ``invalid_unicode`` error.

    >>> valid_unicode("héllo")
    'héllo'
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "invalid Unicode: a lone surrogate (U+{code}) at character {position}; send valid UTF-8 text",  # pragma: no mutate
            {"code": f"{ord(value[exc.start]):04X}", "position": exc.start},
        ) from None
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
"""A string field of a request: valid Unicode (no lone surrogates)."""

# ---- common --------------------------------------------------------------------------------


class _Request(BaseModel):
    """A request body: unknown fields are kept, never refused."""

    model_config = ConfigDict(extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorBody(_Response):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error shape."""

    error: ErrorBody

    @classmethod
    def of(cls, message: str, *, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> ErrorResponse:
        return cls(error=ErrorBody(message=message, type=type, param=param, code=code))


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(_Request):
    """One chat message. ``content`` may be a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role!r} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message carries tool calls, not a {self.role!r} one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template reads (``developer`` reads as system)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class FunctionCall(_Request):
    name: Text
    arguments: Text  # JSON text


class ToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    """``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: Text
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class ResponseFormat(_Request):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class ConstraintSpec(BaseModel):
    """What a request's output must match: ``kind`` is ``json_schema`` (``value``: the schema as
    JSON text), ``json_object`` (no value), ``regex`` (the pattern), ``choice`` (a JSON list of
    strings) or ``lark`` (a grammar in llguidance's Lark dialect)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_schema", "json_object", "regex", "choice", "lark"]
    value: str = ""


class SamplingSpec(BaseModel):
    """What a generating request asks of the sampler, in the engine's terms: one field per field
    of the server's ``SamplingParams`` (same names; a test checks the two lists are equal), where
    ``None`` leaves the server's default. The server builds its parameters from it in one place
    (``SamplingParams.from_spec``), and a request model makes it in one method (``sampling()``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the top k
    forced_tokens: tuple[int, ...] = ()
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    constraint: ConstraintSpec | None = None


UNSUPPORTED_SAMPLING: dict[str, tuple[object, ...]] = {
    # sampling knobs of vLLM, HF, llama.cpp and others this server does not implement -> the values
    # that ask for nothing (accepted, as is null); any other value is refused with a 400
    "min_p": (0,), "typical_p": (1,), "top_a": (0,), "tfs": (1,), "tfs_z": (1,), "epsilon_cutoff": (0,),
    "eta_cutoff": (0,), "min_tokens": (0,), "min_new_tokens": (0,), "best_of": (1,), "use_beam_search": (False,),
    "num_beams": (1,), "length_penalty": (1,), "early_stopping": (False,), "no_repeat_ngram_size": (0,),
    "mirostat": (0,), "mirostat_mode": (0,), "repeat_penalty": (1,), "penalize_nl": (False,),
    "dry_multiplier": (0,), "xtc_probability": (0,), "smoothing_factor": (0,), "logit_bias": ({},),
    "bad_words": ([],), "allowed_token_ids": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "logits_processors": ([],),
}


class _Sampling(_Request):
    """Fields shared by every generating request; ``None`` means the server's default."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # vLLM's extension; -1 or 0: off
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Text | list[Text] | None = None
    ignore_eos: bool = False  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's extension; 1: off
    frequency_penalty: float | None = Field(None, ge=-2, le=2)  # 0: off
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # 0: off
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self) -> SamplingSpec:
        """What this request asks of the sampler: its fields named as the spec's, with the
        request's own limit, stop list and logprobs count."""
        given = {name: getattr(self, name) for name in SamplingSpec.model_fields if name in type(self).model_fields}
        return SamplingSpec(**{**given, "max_tokens": self.token_limit(), "stop": self.stop_list(),
                               "logprobs": self.logprob_count()})

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """Top logprobs per token (0: the chosen token's only; None: no logprobs)."""
        return getattr(self, "logprobs", None)

    @model_validator(mode="after")
    def _refuse_unsupported_sampling(self) -> _Sampling:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSUPPORTED_SAMPLING.get(name)
            if neutral is not None and value is not None and value not in neutral:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "{name}: not supported by this server; omit it (or send null{neutral}). The sampling "
                    "fields it implements: temperature, top_p, top_k, seed, stop, repetition_penalty, "
                    "frequency_penalty, presence_penalty",  # pragma: no mutate
                    {"name": name, "neutral": "".join(f" or {json.dumps(v)}" for v in neutral)})
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence holds at most {MAX_STOP_CHARS} characters")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class _OpenAISampling(_Sampling):
    model: Text
    n: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(None, min_length=1)
    """vLLM's extension: requests with different salts never share prefix-cache blocks (on top of
    the API key's tenant), e.g. to serve each agent from a cache of its own."""

    @model_validator(mode="after")
    def _seed_fits_every_choice(self) -> _OpenAISampling:
        n = self.n or 1
        if self.seed is not None and self.seed + n - 1 >= SEED_LIMIT:
            raise ValueError(f"seed: choice i samples with seed + i, so seed + n - 1 must be below 2**64; "
                             f"got seed {self.seed} with n {n}: lower the seed")
        return self


# ---- OpenAI-compatible: requests ---------------------------------------------------------------


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique; got {names}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is not among the "
                             f"request's tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs at least one entry in 'tools'")
        return self

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (what newer clients such as ChatOpenAI send), else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_OpenAISampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)


# ---- OpenAI-compatible: responses --------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunction(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(_Response):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    """A text completion, and also each chunk of a streamed one (OpenAI reuses the shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Fidelity(_Response):
    """What sharing the prefill costs an agent, as ``agentshare finetune --fidelity`` measured it on
    held-out rows: its score on the shared prefill and on its own, in ``metric`` (``exact``: share
    of answers right; ``tokens``: share of reference tokens reproduced), the gap in points (own −
    shared, positive: sharing costs) with its 95 % CI, and the layer split it chose."""

    metric: str
    points: float  # the gap the search accepted
    shared: float
    own: float
    gap_points: float
    ci_points: list[float]
    recompute_layers: int
    layers: int
    rows: dict[str, int] = Field(default_factory=dict)


class Model(_Response):
    """One agent, as ``/v1/models`` lists it (OpenAI's fields plus the family)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentshare"
    family: str | None = None
    kind: str | None = None
    fidelity: Fidelity | None = None  # what sharing costs this agent, measured when it was trained


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[Model]


# ---- native API ------------------------------------------------------------------------------


class _MessagesOrText(_Request):
    """Exactly one of ``messages`` (chat) or ``text`` (plain text)."""

    messages: list[ChatMessage] | None = None
    text: Text | None = None

    @model_validator(mode="after")
    def _one_of(self) -> _MessagesOrText:
        if (self.messages is None) == (self.text is None):
            raise ValueError("messages: send exactly one of 'messages' (a chat) or 'text' (plain text)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: send at least one message")
        return self

    @property
    def kind(self) -> Literal["chat", "text"]:
        return "chat" if self.messages is not None else "text"


class ContextCreate(_MessagesOrText):
    """Prefill a shared context once and pin it for ``ttl`` seconds (default: the server's)."""

    ttl: float | None = Field(None, gt=0)


class ContextExtend(_MessagesOrText):
    """Append messages (or text) to a context: only the new tokens are prefilled."""

    ttl: float | None = Field(None, gt=0)


class ContextInfo(_Response):
    id: str
    object: Literal["context"] = "context"
    kind: Literal["chat", "text"]
    tokens: int  # tokens of the whole context
    cached_tokens: int  # of those, served from cache by the last create/extend
    computed_tokens: int  # of those, prefilled by the last create/extend
    pinned_tokens: int  # tokens in full pinned blocks (the trailing partial block is not pinned)
    ttl: float
    expires_at: float  # unix time


class ContextReleased(_Response):
    id: str
    object: Literal["context.released"] = "context.released"
    released: bool


class GenerateRequest(_Sampling, _MessagesOrText):
    """Generate from a context for one agent: ``messages``/``text`` is the agent's own turn."""

    agent: Text
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class GenerationUsage(_Response):
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    completion_tokens: int


class RequestTimeline(_Response):
    """Where one generation's time went, and where its prompt's KV came from. Seconds are measured
    from its arrival in the engine that generated it (a router's placement time is ``route_s``);
    ``computed_tokens + reused_tokens + imported_tokens`` is the prompt."""

    queue_s: float = Field(description="arrival to admission (its KV reserved)")
    ttft_s: float | None = Field(description="arrival to the first token (null: none generated)")
    e2e_s: float = Field(description="arrival to the end")
    decode_steps: int = Field(description="tokens generated after the first (one decode step each)")
    computed_tokens: int = Field(description="prompt tokens the generating engine computed")
    reused_tokens: int = Field(description="prompt tokens read from that engine's own cache")
    imported_tokens: int = Field(0, description="prompt tokens whose KV came over a link from a prefill worker")
    prefill: str = Field("local", description='where the shared prefix was prefilled: "local" or the prefill worker')
    route: str = Field("colocated", description='the router\'s placement reason ("colocated": no router)')
    route_s: float = Field(0.0, description="seconds the router took to place the request")
    remote_computed_tokens: int = Field(0, description="of the imported tokens, those the prefill worker computed")
    transfer_bytes: int = Field(0, description="KV bytes moved for it over the link")
    transfer_s: float = Field(0.0, description="seconds those KV frames took on the link")
    transfer_codec: str | None = Field(None, description="the transfer's payload codec (null: no transfer)")


class Generation(_Response):
    id: str
    object: Literal["generation"] = "generation"
    agent: str
    context_id: str
    text: str
    finish_reason: Literal["stop", "length"]
    usage: GenerationUsage
    token_ids: list[int] = Field(default_factory=list)
    timeline: RequestTimeline | None = None


class GenerationChunk(_Response):
    id: str
    object: Literal["generation.chunk"] = "generation.chunk"
    agent: str
    context_id: str
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Literal["stop", "length"] | None = None
    usage: GenerationUsage | None = None
    timeline: RequestTimeline | None = None  # on the final chunk


class AgentInfo(_Response):
    name: str
    object: Literal["agent"] = "agent"
    kind: str  # the decode-module kind: "base", "lora", "full", or any kind the server registers
    family: str | None  # the family whose prefill it shares; None: a private prefill
    shares_prefill: bool
    placement: Literal["turn", "header"]
    reason: str = ""
    recompute_layers: int = 0  # top layers it recomputes over the shared prefix (0: it reads the base's KV)
    fidelity: Fidelity | None = None  # what sharing costs it, measured when it was trained (None: not measured)


class AgentList(_Response):
    object: Literal["list"] = "list"
    family: str
    data: list[AgentInfo]


class ExplainRequest(_Request):
    """What the cache would serve for this request now. ``messages`` as in a chat request
    (context = all but the last); ``prompt`` as in a completion; or a context plus a turn."""

    agent: Text
    messages: list[ChatMessage] | None = None
    prompt: Text | None = None
    context_id: Text | None = None
    text: Text | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ExplainRequest:
        if self.context_id is None and (self.messages is None) == (self.prompt is None):
            raise ValueError("messages: send 'messages' or 'prompt' (or a 'context_id' with its turn)")
        return self


class Explanation(_Response):
    object: Literal["explanation"] = "explanation"
    agent: str
    shares_prefill: bool
    prompt_tokens: int
    block_size: int
    blocks: int  # full blocks of the prompt
    cached_blocks: int
    cached_tokens: int
    first_miss_block: int | None  # index of the first block not in cache (None: all hit)
    first_miss_token: int | None  # its first token position
    recompute_layers: int = 0  # a layer-split agent's recomputed top layers (0: none)
    fill_blocks: int = 0  # of the missed blocks, those it would fill from the family's cache (top layers only)


class Health(_Response):
    """``/health``. ``status`` is ``degraded`` (still HTTP 200: the server answers what it can)
    when some agent cannot be served now: the engine is stuck in a step or stopped, or, behind a
    router, no decode worker serving that agent is up; ``reasons`` says which."""

    status: Literal["ok", "degraded"] = "ok"
    family: str
    agents: int
    waiting: int
    running: int
    reasons: list[str] = Field(default_factory=list)
