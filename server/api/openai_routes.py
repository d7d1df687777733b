"""The OpenAI-compatible endpoints: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Clients such as the ``openai`` package, LangChain's ``ChatOpenAI`` and ``vllm bench serve``
work unchanged. Every agent of the family is a "model"; a chat request's messages but the
last are its shared context, so agents asked about one conversation share its prefill.

::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request
from starlette.responses import Response

from agentshare.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    Model,
    ModelList,
    Usage,
)
from server.api.deps import Caller, agent, new_id, note, server_state
from server.api.errors import ApiError, unprocessable
from server.api.generation import (
    ChoiceEvent,
    check_finish,
    collect,
    stream_choices,
    until_disconnect,
)
from server.api.openai_render import Choices, TokenText, finish_of
from server.api.prompts import chat_request_prompt, completion_prompts
from server.api.sse import DONE, event_stream, prime, sse, sse_error
from server.api.tenancy import salted
from server.api.tools import (
    active_tools,
    constraint_of,
    could_be_call,
    listed_tools,
    parse_tool_calls,
    tool_format,
)
from server.engine.sampling import SamplingParams

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request, _: Caller) -> ModelList:
    state = server_state(request)
    return ModelList(data=[Model(id=c.name, created=state.created, family=c.family, kind=c.kind,
                                 fidelity=c.info().fidelity)
                           for c in state.facts.agents.values()])


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request, who: Caller) -> Response | ChatCompletion:
    state = server_state(request)
    _refuse_unsupported(body)
    card = agent(state, body.model)
    fmt = tool_format(state.facts.tokenizer)
    tools = active_tools(body)
    prompt = chat_request_prompt(state.facts.tokenizer, body.messages, listed_tools(body, fmt))
    spec = body.sampling().model_copy(update={"constraint": constraint_of(body, fmt)})
    params = SamplingParams.from_spec(spec, default_max_tokens=state.config.default_max_tokens)
    n, rid = body.n or 1, new_id("chatcmpl")
    note(request, request_id=rid, agent=card.name, n=n, stream=body.stream, prompt_tokens=len(prompt.token_ids))
    events = stream_choices(state.backend, state.metrics, rid, card.name, [prompt], params, n=n,
                           salt=salted(who.salt, body.cache_salt))
    head = {"id": rid, "created": int(time.time()), "model": card.name, "system_fingerprint": state.fingerprint}
    tt = TokenText(state.facts.tokenizer) if body.logprobs else None
    if body.stream:
        primed = await until_disconnect(request, prime(events))
        return event_stream(_chat_chunks(primed, Choices(n_per_prompt=n, total=n), head, tt, body.include_usage,
                                         request, bool(tools)))
    acc = Choices(n_per_prompt=n, total=n)
    await until_disconnect(request, collect(events, acc.add))
    choices = []
    for i, st in enumerate(acc.states):
        text = "".join(st.text)
        calls = parse_tool_calls(text, f"{rid}:{i}") if tools else None
        message = AssistantMessage(content=None, tool_calls=calls) if calls else AssistantMessage(content=text)  # type: ignore[arg-type]
        choices.append(ChatChoice(index=i, message=message,
                                  finish_reason="tool_calls" if calls else finish_of(st.finish) or "stop",
                                  logprobs=tt.chat(st.events) if tt else None))
    usage = _logged_usage(request, acc)
    return ChatCompletion(choices=choices, usage=usage, **head)  # type: ignore[arg-type]


async def _chat_chunks(events: AsyncIterator[ChoiceEvent], acc: Choices, head: dict[str, object],
                       tt: TokenText | None, include_usage: bool, request: Request,
                       tools: bool = False) -> AsyncIterator[bytes]:
    held: dict[int, str] = {}  # per choice: text held back while it may still become a tool call
    try:
        async for item in events:
            check_finish(item.event)
            st, ev = acc.add(item), item.event
            finish: Literal["stop", "length", "tool_calls"] | None = finish_of(ev.finish_reason)
            lp = tt.chat([ev]) if tt is not None and ev.token_id is not None else None
            text, calls = ev.text, None
            if tools and (item.index in held or not st.started):
                text = held.pop(item.index, "") + text
                if finish is not None:
                    calls = parse_tool_calls(text, f"{head['id']}:{item.index}")
                elif could_be_call(text):
                    held[item.index] = text
                    continue
            if not text and finish is None and lp is None:
                continue  # nothing final to say yet (held back for a stop string or a split character)
            if calls:
                delta = Delta(role=None if st.started else "assistant", tool_calls=[
                    DeltaToolCall(index=k, id=c["id"], type="function", function=DeltaFunction(**c["function"]))
                    for k, c in enumerate(calls)])
                finish = "tool_calls"
            else:
                delta = Delta(role=None if st.started else "assistant", content=text)
            st.started = True
            yield sse(ChatCompletionChunk(choices=[ChunkChoice(index=item.index, delta=delta, finish_reason=finish,
                                                               logprobs=lp)], **head))  # type: ignore[arg-type]
        usage = _logged_usage(request, acc)
        if include_usage:
            yield sse(ChatCompletionChunk(choices=[], usage=usage, **head))  # type: ignore[arg-type]
        yield DONE
    except ApiError as err:
        note(request, stream_error=err.code)
        yield sse_error(err)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request, who: Caller) -> Response | Completion:
    state = server_state(request)
    _refuse_unsupported(body)
    if body.echo:
        raise unprocessable("echo: returning the prompt is not supported", param="echo")
    if body.suffix:
        raise unprocessable("suffix: insertion is not supported", param="suffix")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise unprocessable("best_of: only best_of == n is supported", param="best_of")
    card = agent(state, body.model)
    prompts = completion_prompts(state.facts.tokenizer, body.prompt, vocab_size=len(state.facts.tokenizer))
    params = SamplingParams.from_spec(body.sampling(), default_max_tokens=state.config.default_max_tokens)
    rid = new_id("cmpl")
    note(request, request_id=rid, agent=card.name, n=n, stream=body.stream,
         prompt_tokens=sum(len(p.token_ids) for p in prompts))
    events = stream_choices(state.backend, state.metrics, rid, card.name, prompts, params, n=n,
                           salt=salted(who.salt, body.cache_salt),
                            prompt_param="prompt")
    head = {"id": rid, "created": int(time.time()), "model": card.name, "system_fingerprint": state.fingerprint}
    tt = TokenText(state.facts.tokenizer) if body.logprobs is not None else None
    acc = Choices(n_per_prompt=n, total=n * len(prompts))
    if body.stream:
        primed = await until_disconnect(request, prime(events))
        return event_stream(_completion_chunks(primed, acc, head, tt, body.include_usage, request))
    await until_disconnect(request, collect(events, acc.add))
    choices = [CompletionChoice(index=i, text="".join(st.text), finish_reason=finish_of(st.finish) or "stop",
                                logprobs=tt.completion(st.events) if tt else None) for i, st in enumerate(acc.states)]
    usage = _logged_usage(request, acc)
    return Completion(choices=choices, usage=usage, **head)  # type: ignore[arg-type]


async def _completion_chunks(events: AsyncIterator[ChoiceEvent], acc: Choices, head: dict[str, object],
                             tt: TokenText | None, include_usage: bool, request: Request) -> AsyncIterator[bytes]:
    try:
        async for item in events:
            check_finish(item.event)
            offset = sum(map(len, acc.states[item.index].text))
            st, ev = acc.add(item), item.event
            finish = finish_of(ev.finish_reason)
            lp = tt.completion([ev], offset) if tt is not None and ev.token_id is not None else None
            if not ev.text and finish is None and lp is None:
                continue
            st.started = True
            yield sse(Completion(choices=[CompletionChoice(index=item.index, text=ev.text, finish_reason=finish,
                                                           logprobs=lp)], **head))  # type: ignore[arg-type]
        usage = _logged_usage(request, acc)
        if include_usage:
            yield sse(Completion(choices=[], usage=usage, **head))  # type: ignore[arg-type]
        yield DONE
    except ApiError as err:
        note(request, stream_error=err.code)
        yield sse_error(err)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _logged_usage(request: Request, acc: Choices) -> Usage:
    """The response's usage, noted in the request log line."""
    usage = acc.usage()
    note(request, cached_tokens=usage.prompt_tokens_details.cached_tokens, completion_tokens=usage.completion_tokens)
    return usage


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Known OpenAI options this server cannot honour are refused, not silently ignored (unknown
    sampling knobs such as ``min_p`` are refused by the request schema itself)."""
    if body.logit_bias:
        raise unprocessable("logit_bias: not supported", param="logit_bias")
