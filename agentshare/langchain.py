"""LangChain chat model: :class:`ChatAgentshare`, an agent of an agentshare server as a ``BaseChatModel``.

It speaks the server's OpenAI-compatible ``/v1/chat/completions`` (``httpx``: a sync client for
``invoke``/``stream``/``batch``, an async one for ``ainvoke``/``astream``), so tools and
``response_format`` are the server's. ``model`` (alias ``agent``) names the agent, i.e. the
decode module. A ``shared_context`` is pinned once on the server (the native contexts API) and
put before every call's messages, so several instances (different agents) share its prefill::

    ChatAgentshare(agent="planner", shared_context=doc) ─┐  messages = doc + this call's
    ChatAgentshare(agent="coder",   shared_context=doc) ─┴─> /v1/chat/completions ─> the doc's
                                                              blocks: pinned once, read by both

This module imports ``langchain_core`` (install the extra: ``pip install 'agentshare[langchain]'``);
``agentshare`` itself does not import it.

Examples:
    >>> from langchain_core.messages import HumanMessage, SystemMessage
    >>> llm = ChatAgentshare(client=client, agent="coder", max_tokens=4, temperature=0)
    >>> msg = await llm.ainvoke([SystemMessage("Answer briefly."), HumanMessage("Name a colour.")])
    >>> msg.response_metadata["model_name"], msg.usage_metadata["output_tokens"]
    ('coder', 4)
    >>> team = [ChatAgentshare(client=client, agent=a, shared_context="Spec: square(x) returns x * x.",
    ...                        max_tokens=2) for a in ("base", "coder")]
    >>> reads = [(await m.ainvoke("Plan it.")).usage_metadata["input_token_details"]["cache_read"] for m in team]
    >>> [r >= 32 for r in reads]                    # each reads the pinned context's two full blocks
    [True, True]
    >>> for m in team:
    ...     await m.aclose()                        # unpins the shared context
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

import anyio
import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.messages.utils import message_chunk_to_message
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
    make_invalid_tool_call,
    parse_tool_call,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from agentshare import protocol
from agentshare.client import AsyncClient
from agentshare.connection import DONE, content_body, response_error, sse_event
from agentshare.errors import ConnectionFailed

_PATH = "/v1/chat/completions"


class ChatAgentshare(BaseChatModel):
    """An agent of an agentshare server as a LangChain chat model.

    Where the server is: ``client`` (an :class:`~agentshare.AsyncClient`: its URL and API key,
    and the local server it launched, if it did), else ``base_url`` (+ ``api_key``), else a
    local server is launched on first use (as ``AsyncClient()`` does) and stopped by
    :meth:`close`/:meth:`aclose`.

    Its fields (keyword arguments):

    - ``model``: the agent (decode module) answering; alias ``agent``. Default ``"base"``.
    - ``shared_context``: messages (LangChain messages, ``{"role", "content"}`` dicts, or strings:
      user messages; a string alone is one) pinned once on the server when first needed, put
      before every call's messages, and unpinned by :meth:`close`/:meth:`aclose`.
    - ``context_ttl``: seconds the server keeps ``shared_context`` pinned (server default: 600).
    - ``temperature``, ``max_tokens``, ``top_p``, ``top_k``, ``seed``, ``stop``: sampling
      (``None``: the server's).
    - ``model_kwargs``: more fields of the request body.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(default="base", alias="agent")
    base_url: str | None = None
    api_key: SecretStr | None = None
    client: AsyncClient | None = Field(default=None, exclude=True)
    timeout: float = 600.0
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    streaming: bool = False
    shared_context: str | list[Any] | None = None
    context_ttl: float | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)

    _owned: AsyncClient | None = PrivateAttr(default=None)
    _sync_http: httpx.Client | None = PrivateAttr(default=None)
    _context_id: str | None = PrivateAttr(default=None)
    _context_messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "agentshare"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url, **self._sampling()}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agentshare"
        params["ls_model_name"] = kwargs.get("model", self.model)
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if self.max_tokens is not None:
            params["ls_max_tokens"] = self.max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ---- where the server is -----------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        key = self.api_key.get_secret_value() if self.api_key is not None else (
            self.client.api_key if self.client is not None else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _launcher(self) -> AsyncClient | None:
        """The client whose server is ours to reach: the given one, else one launched on demand."""
        if self.client is not None:
            return self.client
        if self.base_url is not None:
            return None
        with self._lock:
            if self._owned is None:
                key = self.api_key.get_secret_value() if self.api_key is not None else None
                self._owned = AsyncClient(api_key=key, timeout=self.timeout)
        return self._owned

    def _url_sync(self) -> str:
        launcher = self._launcher()
        if launcher is None:
            return str(self.base_url).rstrip("/")
        server = launcher.server
        if server is not None and not server.running:
            with self._lock:
                if not server.running:
                    _in_launcher_thread(lambda: anyio.run(server.start), on_error=server.kill)
        return _require_url(launcher.base_url)

    async def _url_async(self) -> str:
        launcher = self._launcher()
        if launcher is None:
            return str(self.base_url).rstrip("/")
        if launcher.server is not None and not launcher.server.running:
            await launcher.start()
        return _require_url(launcher.base_url)

    def _http(self) -> httpx.Client:
        url = self._url_sync()
        with self._lock:
            if self._sync_http is None:
                self._sync_http = httpx.Client(base_url=url, headers=self._headers(),
                                               timeout=httpx.Timeout(self.timeout, connect=10.0))
            return self._sync_http

    def _ahttp(self, url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, headers=self._headers(), timeout=httpx.Timeout(self.timeout, connect=10.0))

    # ---- the shared context ------------------------------------------------------------------

    def _context_body(self) -> dict[str, Any]:
        shared = [self.shared_context] if isinstance(self.shared_context, str) else self.shared_context or []
        body = content_body([_to_wire(m) for m in shared])
        if self.context_ttl is not None:
            body["ttl"] = self.context_ttl
        return body

    def _pinned(self, info: Any) -> str | None:
        """Keep a new pin; returns the id of a pin to release (one a concurrent first call made too)."""
        cid = protocol.ContextInfo.model_validate(info).id
        with self._lock:
            if self._context_id is not None:
                return cid
            self._context_messages = self._context_body()["messages"]
            self._context_id = cid
        return None

    def _ensure_context_sync(self) -> None:
        if self.shared_context and self._context_id is None:
            http = self._http()
            resp = _checked(_send(lambda: http.post("/v1/contexts", json=self._context_body()), "/v1/contexts"))
            extra = self._pinned(resp.json())
            if extra is not None:
                http.delete(f"/v1/contexts/{extra}")

    async def _ensure_context_async(self, url: str) -> None:
        if self.shared_context and self._context_id is None:
            async with self._ahttp(url) as http:
                try:
                    resp = await http.post("/v1/contexts", json=self._context_body())
                    extra = self._pinned(_checked(resp).json())
                    if extra is not None:
                        await http.delete(f"/v1/contexts/{extra}")
                except httpx.TransportError as exc:
                    raise ConnectionFailed(f"POST {url}/v1/contexts: {exc!r}") from exc

    @property
    def context_id(self) -> str | None:
        """The pinned shared context's id (``None`` until the first call, or without one)."""
        return self._context_id

    def close(self) -> None:
        """Unpin the shared context, close the connection, and stop a server this model launched."""
        if self._context_id is not None:
            cid, self._context_id = self._context_id, None
            try:
                self._http().delete(f"/v1/contexts/{cid}")
            except httpx.HTTPError:
                pass  # the server is gone: its pin went with it (a remote pin expires after its TTL)
        if self._sync_http is not None:
            self._sync_http.close()
            self._sync_http = None
        if self._owned is not None and self._owned.server is not None:
            self._owned.server.kill()
            self._owned = None

    async def aclose(self) -> None:
        """:meth:`close`, from async code."""
        if self._context_id is not None:
            cid, self._context_id = self._context_id, None
            try:
                async with self._ahttp(await self._url_async()) as http:
                    await http.delete(f"/v1/contexts/{cid}")
            except httpx.HTTPError:
                pass
        if self._sync_http is not None:
            self._sync_http.close()
            self._sync_http = None
        if self._owned is not None:
            await self._owned.aclose()
            self._owned = None

    # ---- requests ----------------------------------------------------------------------------

    def _sampling(self) -> dict[str, Any]:
        fields = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                  "top_k": self.top_k, "seed": self.seed}
        return {k: v for k, v in fields.items() if v is not None}

    def _body(self, messages: list[BaseMessage], stop: list[str] | None, stream: bool, **kwargs: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, **self._sampling(), **self.model_kwargs}
        stops = stop if stop is not None else self.stop
        if stops:
            body["stop"] = list(stops)
        body.update({k: v for k, v in kwargs.items() if v is not None})
        body["messages"] = [*self._context_messages, *(_to_wire(m) for m in messages)]
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return _merged(self._stream(messages, stop, run_manager, **kwargs))
        self._ensure_context_sync()
        http = self._http()
        body = self._body(messages, stop, False, **kwargs)
        return _result(_checked(_send(lambda: http.post(_PATH, json=body), _PATH)).json())

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return _merged([c async for c in self._astream(messages, stop, run_manager, **kwargs)])
        url = await self._url_async()
        await self._ensure_context_async(url)
        body = self._body(messages, stop, False, **kwargs)
        async with self._ahttp(url) as http:
            try:
                resp = await http.post(_PATH, json=body)
            except httpx.TransportError as exc:
                raise ConnectionFailed(f"POST {url}{_PATH}: {exc!r}") from exc
        return _result(_checked(resp).json())

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        self._ensure_context_sync()
        http = self._http()
        body = self._body(messages, stop, True, **kwargs)
        try:
            with http.stream("POST", _PATH, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _checked(resp)
                for line in resp.iter_lines():
                    event = sse_event(line)
                    if event is DONE:
                        return
                    if event is not None:
                        chunk = _chunk(event)
                        if run_manager and chunk.text:
                            run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                        yield chunk
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"POST {http.base_url}{_PATH}: {exc!r}") from exc
        raise _cut_short(str(http.base_url))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        url = await self._url_async()
        await self._ensure_context_async(url)
        body = self._body(messages, stop, True, **kwargs)
        async with self._ahttp(url) as http:
            try:
                async with http.stream("POST", _PATH, json=body) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        _checked(resp)
                    async for line in resp.aiter_lines():
                        event = sse_event(line)
                        if event is DONE:
                            return
                        if event is not None:
                            chunk = _chunk(event)
                            if run_manager and chunk.text:
                                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                            yield chunk
            except httpx.TransportError as exc:
                raise ConnectionFailed(f"POST {url}{_PATH}: {exc!r}") from exc
        raise _cut_short(url)

    # ---- tools and structured output ---------------------------------------------------------

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: dict[str, Any] | str | bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (OpenAI format, via ``convert_to_openai_tool``).

        Args:
            tool_choice: ``"auto"``, ``"none"``, ``"required"`` (or ``"any"``, or ``True``), a
                tool's name, or an OpenAI ``{"type": "function", "function": {"name": ...}}``.
            parallel_tool_calls: whether the model may call several tools in one answer.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type | None = None, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers parsed into ``schema`` (a pydantic class, a JSON schema, a TypedDict).

        Args:
            method: ``"json_schema"`` (the server constrains the answer to the schema:
                ``response_format`` ``json_schema``), ``"function_calling"`` (one forced tool
                call), or ``"json_mode"`` (any JSON object; say the schema in the prompt).
            include_raw: return ``{"raw", "parsed", "parsing_error"}`` instead of raising.
        """
        if kwargs:
            raise ValueError(f"with_structured_output: unknown arguments {sorted(kwargs)}")
        pydantic_cls = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
        parser: Runnable[Any, Any]
        if method == "function_calling":
            if schema is None:
                raise ValueError("with_structured_output(method='function_calling') needs a schema")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False,
                                  ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = (PydanticToolsParser(tools=[pydantic_cls], first_tool_only=True) if pydantic_cls is not None
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method == "json_schema":
            if schema is None:
                raise ValueError("with_structured_output(method='json_schema') needs a schema")
            json_schema = convert_to_json_schema(schema)
            fmt: dict[str, Any] = {"name": json_schema.get("title", "output"), "schema": json_schema}
            if strict is not None:
                fmt["strict"] = strict
            llm = self.bind(response_format={"type": "json_schema", "json_schema": fmt},
                            ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema})
            parser = PydanticOutputParser(pydantic_object=pydantic_cls) if pydantic_cls is not None else JsonOutputParser()
        elif method == "json_mode":
            llm = self.bind(response_format={"type": "json_object"},
                            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = PydanticOutputParser(pydantic_object=pydantic_cls) if pydantic_cls is not None else JsonOutputParser()
        else:
            raise ValueError(f"with_structured_output: method {method!r}: use 'json_schema', "
                             "'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


# ---- wire format ---------------------------------------------------------------------------------

_launches: queue.Queue[tuple[Callable[[], None], list[BaseException], threading.Event]] = queue.Queue()
_launcher_lock = threading.Lock()
_launcher_thread: threading.Thread | None = None


def _in_launcher_thread(start: Callable[[], None], *, on_error: Callable[[], None]) -> None:
    """Run ``start`` (a local server's launch) in the one long-lived launcher thread, and wait.

    Not in the caller's thread: it may run an event loop (sync ``invoke`` in a notebook), or be a
    ``batch`` worker that exits soon; and the launched child gets SIGTERM when the *thread* that
    forked it exits (``PR_SET_PDEATHSIG``), so that thread lives as long as the process.
    """
    global _launcher_thread
    with _launcher_lock:
        if _launcher_thread is None:
            _launcher_thread = threading.Thread(target=_launcher_loop, name="agentshare-launcher", daemon=True)
            _launcher_thread.start()
    error: list[BaseException] = []
    done = threading.Event()
    _launches.put((start, error, done))
    done.wait()
    if error:
        on_error()
        raise error[0]


def _launcher_loop() -> None:
    while True:
        start, error, done = _launches.get()
        try:
            start()
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)
        finally:
            done.set()


def _require_url(url: str | None) -> str:
    if url is None:
        raise ConnectionFailed("the agentshare server has no URL yet: start its client first")
    return url.rstrip("/")


def _send(call: Callable[[], httpx.Response], path: str) -> httpx.Response:
    try:
        return call()
    except httpx.TransportError as exc:
        raise ConnectionFailed(f"{path}: {exc!r}") from exc


def _checked(resp: httpx.Response) -> httpx.Response:
    """The response, or its status's :class:`~agentshare.errors.AgentshareError` (read first when streamed)."""
    if resp.status_code < 400:
        return resp
    raise response_error(resp.status_code, resp.content, resp.headers.get("retry-after"))


def _cut_short(url: str) -> ConnectionFailed:
    return ConnectionFailed(f"POST {url}{_PATH}: the stream ended before [DONE] (connection closed mid-response); "
                            "retry the request")


def _content(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, Mapping) and p.get("type") == "text":
            parts.append(str(p.get("text", "")))
        elif isinstance(p, Mapping) and p.get("type") in ("tool_use", "function_call", "reasoning", "thinking"):
            continue  # carried as tool_calls, or not for the model to read again
        else:
            raise ValueError(f"message content part {p!r}: this server reads text only (no images, audio or files)")
    return "".join(parts)


def _to_wire(m: BaseMessage | Mapping[str, Any] | str) -> dict[str, Any]:
    """A LangChain message (or an OpenAI-style dict, or a string: a user message) as an OpenAI
    chat message dict.

    >>> _to_wire(AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1"}]))
    {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c1', 'type': 'function', 'function': {'name': 'add', 'arguments': '{"a": 1}'}}]}
    >>> _to_wire(ToolMessage("2", tool_call_id="c1"))
    {'role': 'tool', 'content': '2', 'tool_call_id': 'c1'}
    """
    if isinstance(m, Mapping):
        return dict(m)
    if isinstance(m, str):
        return {"role": "user", "content": m}
    out: dict[str, Any]
    if isinstance(m, SystemMessage):
        out = {"role": "system", "content": _content(m.content)}
    elif isinstance(m, HumanMessage):
        out = {"role": "user", "content": _content(m.content)}
    elif isinstance(m, AIMessage):
        text = _content(m.content)
        out = {"role": "assistant", "content": text or (None if m.tool_calls else "")}
        calls = [{"id": c.get("id") or f"call_{i}", "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)}}
                 for i, c in enumerate(m.tool_calls)]
        calls += [{"id": c.get("id") or f"call_invalid_{i}", "type": "function",
                   "function": {"name": c.get("name") or "", "arguments": c.get("args") or ""}}
                  for i, c in enumerate(m.invalid_tool_calls)]
        if calls:
            out["tool_calls"] = calls
    elif isinstance(m, ToolMessage):
        out = {"role": "tool", "content": _content(m.content), "tool_call_id": m.tool_call_id}
    elif isinstance(m, ChatMessage):
        out = {"role": m.role, "content": _content(m.content)}
    else:
        raise ValueError(f"message of type {m.type!r}: send system, human, ai, tool or chat messages")
    if m.name and not isinstance(m, ToolMessage):
        out["name"] = m.name
    return out


def _usage(usage: Mapping[str, Any] | None) -> UsageMetadata | None:
    if not usage:
        return None
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return UsageMetadata(input_tokens=prompt, output_tokens=completion,
                         total_tokens=int(usage.get("total_tokens", prompt + completion)),
                         input_token_details={"cache_read": cached})


def _result(data: Mapping[str, Any]) -> ChatResult:
    generations = []
    usage = _usage(data.get("usage"))
    for choice in data.get("choices", []):
        msg = choice.get("message") or {}
        calls, invalid = [], []
        for raw in msg.get("tool_calls") or []:
            try:
                calls.append(parse_tool_call(raw, return_id=True))
            except Exception as exc:  # an unparsable call is kept, as LangChain keeps one
                invalid.append(make_invalid_tool_call(raw, str(exc)))
        meta = {"model_name": data.get("model"), "finish_reason": choice.get("finish_reason"),
                "id": data.get("id"), "system_fingerprint": data.get("system_fingerprint"),
                "model_provider": "agentshare"}
        message = AIMessage(content=msg.get("content") or "", tool_calls=[c for c in calls if c],
                            invalid_tool_calls=invalid, usage_metadata=usage, response_metadata=meta,
                            id=data.get("id"))
        generations.append(ChatGeneration(message=message, generation_info={"finish_reason": choice.get("finish_reason")}))
    return ChatResult(generations=generations, llm_output={"model_name": data.get("model"), "id": data.get("id")})


def _chunk(event: Mapping[str, Any]) -> ChatGenerationChunk:
    choices = event.get("choices") or []
    delta = (choices[0].get("delta") or {}) if choices else {}
    finish = choices[0].get("finish_reason") if choices else None
    chunks = [tool_call_chunk(name=(c.get("function") or {}).get("name"), args=(c.get("function") or {}).get("arguments"),
                              id=c.get("id"), index=c.get("index"))
              for c in delta.get("tool_calls") or []]
    meta: dict[str, Any] = {"model_provider": "agentshare"}
    if finish is not None:
        meta.update(finish_reason=finish, model_name=event.get("model"), system_fingerprint=event.get("system_fingerprint"))
    message = AIMessageChunk(content=delta.get("content") or "", tool_call_chunks=chunks,
                             usage_metadata=_usage(event.get("usage")), response_metadata=meta, id=event.get("id"))
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish} if finish else None)


def _merged(chunks: Iterator[ChatGenerationChunk] | list[ChatGenerationChunk]) -> ChatResult:
    total: ChatGenerationChunk | None = None
    for c in chunks:
        total = c if total is None else total + c
    if total is None:
        raise ConnectionFailed("the server's stream carried no chunk")
    return ChatResult(generations=[ChatGeneration(message=message_chunk_to_message(total.message),
                                                  generation_info=total.generation_info)])


def _tool_choice(choice: dict[str, Any] | str | bool, names: list[str]) -> dict[str, Any] | str:
    """LangChain's tool_choice values in OpenAI's terms.

    >>> _tool_choice("any", ["add"]), _tool_choice("add", ["add"])
    ('required', {'type': 'function', 'function': {'name': 'add'}})
    """
    if isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, str):
        if choice not in names:
            raise ValueError(f"tool_choice {choice!r}: not one of the bound tools {names}")
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"tool_choice {choice!r}: give 'auto', 'none', 'required', 'any', or a tool's name")
