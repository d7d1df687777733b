"""The native API: shared contexts (create, extend, generate, release), agents, explain.

::

    POST   /v1/contexts                    {messages | text, ttl}  -> ContextInfo (prefill + pin)
    GET    /v1/contexts/{id}                                       -> ContextInfo
    POST   /v1/contexts/{id}/extend        {messages | text, ttl}  -> ContextInfo (incremental)
    POST   /v1/contexts/{id}/generate      {agent, messages | text, sampling..., stream}
                                                                   -> Generation | SSE GenerationChunk*
    DELETE /v1/contexts/{id}                                       -> ContextReleased
    GET    /v1/agents                                              -> AgentList (with families)
    POST   /v1/explain                     {agent, messages | prompt | context_id + turn}
                                                                   -> Explanation
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from agentshare.protocol import (
    AgentList,
    ContextCreate,
    ContextExtend,
    ContextInfo,
    ContextReleased,
    ExplainRequest,
    Explanation,
    GenerateRequest,
    Generation,
    GenerationChunk,
    GenerationUsage,
    RequestTimeline,
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
from server.api.openai_render import Choices, finish_of
from server.api.prompts import chat_request_prompt, completion_prompts
from server.api.sse import DONE, event_stream, prime, sse, sse_error
from server.api.state import ServerState
from server.api.tenancy import Tenant
from server.engine.sampling import SamplingParams
from server.engine.sequence import Timeline, TokenEvent
from server.engine.sequence import Usage as EngineUsage
from server.prompt import Prompt

router = APIRouter()


@router.get("/v1/agents", response_model=AgentList)
async def list_agents(request: Request, _: Caller) -> AgentList:
    state = server_state(request)
    return AgentList(family=state.facts.family, data=[c.info() for c in state.facts.agents.values()])


@router.post("/v1/contexts", response_model=ContextInfo, status_code=201)
async def create_context(body: ContextCreate, request: Request, who: Caller) -> ContextInfo:
    state = server_state(request)
    ttl = _ttl(state, body.ttl)
    rec = await until_disconnect(request, state.contexts.create(who.salt, body.messages, body.text, ttl))
    note(request, context_id=rec.id, prompt_tokens=len(rec.token_ids), cached_tokens=rec.cached_tokens)
    return rec.info(state.facts.block_size)


@router.get("/v1/contexts/{context_id}", response_model=ContextInfo)
async def get_context(context_id: str, request: Request, who: Caller) -> ContextInfo:
    state = server_state(request)
    return state.contexts.get(who.salt, context_id).info(state.facts.block_size)


@router.post("/v1/contexts/{context_id}/extend", response_model=ContextInfo)
async def extend_context(context_id: str, body: ContextExtend, request: Request,
                         who: Caller) -> ContextInfo:
    state = server_state(request)
    ttl = _ttl(state, body.ttl) if body.ttl is not None else None
    rec = await until_disconnect(request, state.contexts.extend(who.salt, context_id, body.messages, body.text, ttl))
    note(request, context_id=rec.id, prompt_tokens=len(rec.token_ids), cached_tokens=rec.cached_tokens)
    return rec.info(state.facts.block_size)


@router.delete("/v1/contexts/{context_id}", response_model=ContextReleased)
async def release_context(context_id: str, request: Request, who: Caller) -> ContextReleased:
    state = server_state(request)
    released = await state.contexts.release(who.salt, context_id)
    return ContextReleased(id=context_id, released=released)


@router.post("/v1/contexts/{context_id}/generate", response_model=Generation)
async def generate(context_id: str, body: GenerateRequest, request: Request,
                   who: Caller) -> Response | Generation:
    state = server_state(request)
    card = agent(state, body.agent, param="agent")
    rec = state.contexts.get(who.salt, context_id)
    prompt = rec.turn_prompt(state.facts.tokenizer, body.messages, body.text)
    params = SamplingParams.from_spec(body.sampling(), default_max_tokens=state.config.default_max_tokens)
    rid = new_id("gen")
    note(request, request_id=rid, agent=card.name, context_id=rec.id, stream=body.stream,
         prompt_tokens=len(prompt.token_ids))
    events = stream_choices(state.backend, state.metrics, rid, card.name, [prompt], params, salt=who.salt,
                            prompt_param="messages" if body.kind == "chat" else "text")
    head = {"id": rid, "agent": card.name, "context_id": rec.id}
    if body.stream:
        primed = await until_disconnect(request, prime(events))
        return event_stream(_generation_chunks(primed, head, request))
    acc = Choices(n_per_prompt=1, total=1)
    last: list[TokenEvent] = []

    def add(item: ChoiceEvent) -> None:
        acc.add(item)
        if item.event.finish_reason is not None:
            last.append(item.event)

    await until_disconnect(request, collect(events, add))
    st = acc.states[0]
    assert st.usage is not None
    note(request, cached_tokens=st.usage.cached_tokens, completion_tokens=st.usage.completion_tokens)
    return Generation(text="".join(st.text), finish_reason=finish_of(st.finish) or "stop",
                      usage=_usage(st.usage), token_ids=st.token_ids, timeline=_timeline(last[-1].timeline),
                      **head)  # type: ignore[arg-type]


async def _generation_chunks(events: AsyncIterator[ChoiceEvent], head: dict[str, str],
                             request: Request) -> AsyncIterator[bytes]:
    try:
        async for item in events:
            ev = item.event
            check_finish(ev)
            usage = _usage(ev.usage) if ev.usage is not None else None
            if usage is not None:
                note(request, cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens)
            yield sse(GenerationChunk(text=ev.text, token_ids=[] if ev.token_id is None else [ev.token_id],
                                      finish_reason=finish_of(ev.finish_reason), usage=usage,
                                      timeline=_timeline(ev.timeline), **head))  # type: ignore[arg-type]
        yield DONE
    except ApiError as err:
        yield sse_error(err)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


@router.post("/v1/explain", response_model=Explanation)
async def explain(body: ExplainRequest, request: Request, who: Caller) -> Explanation:
    state = server_state(request)
    card = agent(state, body.agent, param="agent")
    prompt = _explain_prompt(state, who, body)
    report = await state.backend.explain(card.name, prompt, salt=who.salt)
    first = report.first_miss
    return Explanation(
        agent=card.name, shares_prefill=card.shares_prefill, prompt_tokens=len(prompt.token_ids),
        block_size=report.block_size, blocks=report.blocks, cached_blocks=report.cached_blocks,
        cached_tokens=report.cached_tokens, first_miss_block=first,
        first_miss_token=None if first is None else first * report.block_size,
        recompute_layers=report.recompute_layers, fill_blocks=report.fill_blocks,
    )


def _explain_prompt(state: ServerState, who: Tenant, body: ExplainRequest) -> Prompt:
    tok = state.facts.tokenizer
    if body.context_id is not None:
        return state.contexts.get(who.salt, body.context_id).turn_prompt(tok, body.messages, body.text)
    if body.messages is not None:
        if not body.messages:
            raise unprocessable("messages: send at least one message", param="messages")
        return chat_request_prompt(tok, body.messages)
    return completion_prompts(tok, body.prompt or "")[0]


def _ttl(state: ServerState, ttl: float | None) -> float:
    ttl = state.config.context_ttl if ttl is None else ttl
    if ttl > state.config.max_context_ttl:
        raise unprocessable(f"ttl: at most {state.config.max_context_ttl:g} seconds", param="ttl")
    return ttl


def _usage(u: EngineUsage) -> GenerationUsage:
    return GenerationUsage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                           computed_tokens=u.prompt_tokens - u.cached_tokens, completion_tokens=u.completion_tokens)


def _timeline(t: Timeline | None) -> RequestTimeline | None:
    return None if t is None else RequestTimeline.model_validate(dataclasses.asdict(t))
