"""The vLLM backend: the API's :class:`~server.backend.Backend` over supervised vLLM instances.

The routes, the SDK and the rendering are the torch engine's; only the engine differs. One
request to an agent that joins the family::

    1. pin the prefix's store blocks (nothing evicts them while the request runs)
    2. the prefix [0, IP) is in the store?  no: the base instance prefills it once (concurrent
       requests for one prefix wait on that one prefill) and its connector saves the blocks
    3. stream /v1/completions from the agent's instance with {op: load, n: IP}: its connector
       reports the prefix as external cached tokens and loads it; the module computes from IP on
    4. unpin

When the base cannot prefill (it died, it is restarting), or the agent's instance cannot load
the prefix (its connector fails the request before the first token), the instance computes the
whole prompt with the module's weights: a private prefill, under a vLLM cache salt of its own
so that no later request mistakes that KV for the base's. The base agent itself runs on the
base instance with vLLM's prefix cache (its salt: the tenant's). Pinned contexts are base
prefills whose blocks stay pinned for their TTL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from server import positions
from server.backend import (
    AgentCard,
    CacheReport,
    EngineFacts,
    EngineSnapshot,
    EventSource,
    HealthReport,
)
from server.cluster.errors import TransferError
from server.engine.errors import InvalidRequest, PromptTooLong, Unavailable, UnknownModule
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, Timeline, TokenEvent, Usage
from server.policy import placement
from server.policy.snapshot import ClusterSnapshot, RequestSnapshot, Role, WorkerSnapshot
from server.prompt import Prompt
from server.vllm.launch import BASE, VllmInstances, agent_card
from server.vllm.node import NodeClient
from server.vllm.relay import Pushed
from server.vllm.store import KVStore, StoreBlock, open_store, prefix_blocks

log = logging.getLogger("agentshare.vllm")

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


def _salt_tag(salt: str) -> str:
    """vLLM's cache salt allows neither '/' nor '@'; a tenant's salt may hold anything."""
    return hashlib.sha256(salt.encode()).hexdigest()[:32]


def _cache_salt(salt: str, ip: int | None) -> str:
    """The vLLM cache salt of a request: the base agent's (``ip`` None) is the tenant's; a module's
    loaded prefix is salted with its IP; a module's private prefill (``ip`` 0) has a salt of its own,
    so that its module-computed KV is never taken for the base's."""
    tag = _salt_tag(salt)
    return tag if ip is None else f"{tag}.ip{ip}" if ip else f"{tag}.private"


@dataclass(frozen=True, slots=True)
class Route:
    """Where one agent is served: its instance, and the model name requests there carry."""

    instance: str
    model: str
    card: AgentCard
    node: NodeClient | None = None  # served by another host's node (its instance named there)


class VllmStream:
    """The events of one request, produced by a task that talks to the instances."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.finished = False

    def __aiter__(self) -> VllmStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self.queue.get()
        self.finished = event.finish_reason is not None
        return event

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            if self.task is not None:
                self.task.cancel()  # closes the HTTP stream: vLLM aborts the request and frees its KV


def choose_place(places: SequenceOf[Route], n: int, blocks: SequenceOf[StoreBlock], *, family: str,
                 loads: Mapping[str, _Load], holds: Callable[[Route, bytes], bool],
                 policy: str = placement.DEFAULT) -> tuple[Route, str]:
    """Where a request of ``n`` prompt tokens whose shared prefix is ``blocks`` runs, among its
    agent's ``places``, and why: the placement policy's decode choice (affinity: the place whose
    store ``holds`` the longest part of the prefix; load: ``loads`` of the places, requests in
    flight and the prompt tokens they have yet to compute).

    >>> card = AgentCard("coder", "lora", "f", True)
    >>> here, there = Route("lora-0", "coder", card), Route("node-0/lora-0", "coder", card)
    >>> b = StoreBlock(b"k", b"", 0, 128)
    >>> loads = {"lora-0": _Load(), "node-0/lora-0": _Load()}
    >>> r, why = choose_place([here, there], 300, [b], family="f", loads=loads, holds=lambda r, k: r is there)
    >>> r.instance, why
    ('node-0/lora-0', 'longest_prefix')
    """
    if len(places) == 1:
        return places[0], "only_candidate"
    card = places[0].card
    workers = []
    for i, r in enumerate(places):
        held = 0
        for b in blocks:
            if not holds(r, b.key):
                break
            held = b.end
        load = loads[r.instance]
        workers.append(WorkerSnapshot(i, Role.DECODE, family, cached_tokens=held, running=load.running,
                                      queued_tokens=load.pending))
    request = RequestSnapshot(0, card.name, family if card.shares_prefill else None, max(n, 1))
    decision = placement.place(request, ClusterSnapshot(family, 1, decode=workers), name=policy)
    assert decision.decode.worker_id is not None  # places is never empty
    return places[decision.decode.worker_id], decision.decode.reason.value


class _Failed(RuntimeError):
    """The instance failed a request mid-stream (an error event instead of tokens)."""

    def __init__(self, message: str, *, before_first_token: bool) -> None:
        super().__init__(f"vLLM failed the request: {message}")
        self.before_first_token = before_first_token


@dataclass(slots=True)
class _Load:
    """One place's load, as the placement policy reads it."""

    running: int = 0  # requests in flight there
    pending: int = 0  # prompt tokens they have yet to compute (work ahead of a new request)


class _Claim:
    """One request's share of its place's load: its prompt tokens until its first token, itself
    until it ends."""

    def __init__(self, load: _Load, tokens: int) -> None:
        self.load, self.tokens = load, tokens
        load.running += 1
        load.pending += tokens

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.load.pending += tokens

    def computed(self) -> None:
        """Its prompt is computed (its first token came): no longer work ahead of others."""
        self.load.pending -= self.tokens
        self.tokens = 0

    def release(self) -> None:
        self.computed()
        self.load.running -= 1


class VllmBackend:
    """Serve the API from the vLLM instances of :class:`VllmInstances` (already started)."""

    def __init__(self, instances: VllmInstances, *, tokenizer: Any, family: str, modules: dict[str, Path],
                 max_context: int, base_name: str = BASE, pin_ttl: float = 300.0,
                 nodes: SequenceOf[NodeClient] = (), placement_policy: str = placement.DEFAULT) -> None:
        self.instances = instances
        self.family = family
        self.base_name = base_name
        self.pin_ttl = pin_ttl
        self.placement_policy = placement_policy
        # each agent's places: its instance here and/or on nodes; the placement policy picks one
        self.routes: dict[str, list[Route]] = {
            base_name: [Route(BASE, base_name, AgentCard(base_name, "base", family, True))]}
        for spec in instances.instances.values():
            for name in spec.spec.modules:
                if name == base_name:
                    continue
                self.routes[name] = [Route(spec.spec.name, name, agent_card(modules[name], name=name, family=family))]
        self.block_size = 0
        self.store = self._open_store()
        self.nodes = list(nodes)
        for node in self.nodes:
            self._add_node(node)
        self.facts = EngineFacts(family, {n: r[0].card for n, r in self.routes.items()}, tokenizer,
                                 self.block_size, max_context)
        self._load = {r.instance: _Load() for rs in self.routes.values() for r in rs}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._prefills: dict[tuple[str, bytes], asyncio.Future[None]] = {}
        self._contexts: dict[str, str] = {}
        self._counts = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "imported_prompt_tokens": 0,
                        "decode_tokens": 0, "finished": 0, "private_fallbacks": 0,
                        "exported_prefill_tokens": 0, "exported_cached_tokens": 0}
        self._running = 0
        self.collector = _VllmCollector(self)

    def _add_node(self, node: NodeClient) -> None:
        f = node.facts
        if f.family != self.family:
            raise ValueError(f"node {node.url} serves family {f.family[:12]}, this server {self.family[:12]}: give "
                             "both the same base model and --dtype")
        if f.fmt != self.store.fmt or f.block_size != self.block_size:
            raise ValueError(f"node {node.url} lays KV out as {f.fmt} (block size {f.block_size}), this server as "
                             f"{self.store.fmt} (block size {self.block_size}): run the same vLLM build and "
                             "options on every host")
        for name, fields in f.agents.items():
            card = AgentCard(**{k: v for k, v in fields.items() if k != "instance"})
            if name == self.base_name:
                raise ValueError(f"node {node.url} serves an agent named {name!r}, the base's name here")
            places = self.routes.setdefault(name, [])
            if places and places[0].card != card:  # one agent, one module: the same card everywhere
                raise ValueError(f"agent {name!r} is another module on node {node.url} ({card.kind}, shares "
                                 f"prefill: {card.shares_prefill}) than elsewhere ({places[0].card.kind}, shares "
                                 f"prefill: {places[0].card.shares_prefill}): give it the same module directory")
            places.append(Route(f"{node.name}/{fields['instance']}", name, card, node))

    def _open_store(self) -> KVStore:
        store, facts = open_store(self.instances.store.root, capacity_bytes=self.instances.store.capacity_bytes,
                                  role="frontend")
        self.block_size = int(facts["block_size"])  # type: ignore[call-overload]
        return store

    # -- the Backend interface ----------------------------------------------------------------

    def _route(self, module: str) -> Route:
        """The agent's card holder: its first place (every place has the same card)."""
        return self._places(module)[0]

    def _places(self, module: str) -> list[Route]:
        r = self.routes.get(module)
        if r is None:
            raise UnknownModule(module, list(self.routes))
        return r

    def _serving(self, route: Route) -> bool:
        """Whether the place answers now (a place down is left out while another serves the agent)."""
        if route.node is None:
            return self.instances[route.instance].ready
        return route.node.reachable and route.instance.split("/", 1)[1] not in route.node.down

    def _choose(self, places: list[Route], n: int, blocks: list[StoreBlock]) -> tuple[Route, str]:
        return choose_place(places, n, blocks, family=self.family, loads=self._load, policy=self.placement_policy,
                            holds=lambda r, key: self.store.contains(key) if r.node is None else r.node.holds(key))

    @staticmethod
    def _shared_ip(route: Route, prompt: Prompt) -> int:
        """The IP of a request whose prefix the base prefills for another instance; 0 for the
        base agent (its own instance computes everything) and for a private prefill."""
        return 0 if route.card.is_base else positions.invocation_point(prompt, route.card)

    async def submit(self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *,
                     salt: str = "") -> EventSource:
        route = self._route(module)  # unknown agents are refused here, before any work
        n = len(prompt.token_ids)
        if n + 1 > self.facts.max_context:
            raise PromptTooLong(n + 1, self.facts.max_context)
        body = self._sampling(params)
        stream = VllmStream()
        stream.task = asyncio.create_task(self._run(stream, request_id, route, prompt, body, salt))
        return stream

    @staticmethod
    def _sampling(p: SamplingParams) -> dict[str, Any]:
        if p.forced_tokens:
            raise InvalidRequest("forced_tokens is not supported by the vllm engine; use the torch engine")
        if p.constraint is not None:
            raise InvalidRequest("tools, response_format and constrained decoding are not supported by the vllm "
                                 "engine yet; use the torch engine (agentshare serve without --engine vllm)")
        body: dict[str, Any] = {
            "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1, "ignore_eos": p.ignore_eos,
            "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty,
            "presence_penalty": p.presence_penalty,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.logprobs is not None:
            body["logprobs"] = max(p.logprobs, 1)
            body["return_tokens_as_token_ids"] = True
        return body

    async def _run(self, stream: VllmStream, request_id: str, first: Route, prompt: Prompt,
                   sampling: dict[str, Any], salt: str) -> None:
        start = time.monotonic()
        tokens = list(prompt.token_ids)
        ip = self._shared_ip(first, prompt)
        blocks = self._blocks(tokens[:ip], salt) if ip > 0 else []
        places = self._places(first.model)
        route, reason = self._choose([r for r in places if self._serving(r)] or places, len(tokens), blocks)
        pin = f"req-{_salt_tag(request_id)}"
        remote_pin: str | None = None  # the node drops it when the request ends there
        pushed: Pushed | None = None
        shared = ip > 0
        claim = _Claim(self._load[route.instance], len(tokens) - ip)
        self._running += 1
        try:
            if shared:
                keys = [b.key for b in blocks]
                self.store.pin(pin, keys, ttl=self.pin_ttl)
                try:
                    await self._prefill(tokens[:ip], salt, keys)
                    if route.node is not None:  # into the node's store, pinned there until the request ends
                        pushed = await route.node.send_prefix(self._http, self.store, blocks, tokens[:ip], pin=pin,
                                                              ttl=self.pin_ttl)
                        remote_pin = pin
                except (httpx.HTTPError, Unavailable, TransferError, LookupError) as exc:
                    self._private_fallback(request_id, "shared prefill failed", exc, claim, ip)
                    shared = False
            body = {"model": route.model, "prompt": tokens, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}, **sampling}
            if shared:
                body["kv_transfer_params"] = {"agentshare": {"op": "load", "n": ip, "salt": salt}}
            body["cache_salt"] = _cache_salt(salt, None if route.card.is_base else (ip if shared else 0))
            try:
                await self._stream(stream, request_id, route, body, start, imported=ip if shared else 0,
                                   pin=remote_pin, reason=reason, pushed=pushed, claim=claim)
            except _Failed as exc:
                if not (shared and exc.before_first_token):
                    raise
                # the instance could not load the prefix (its connector failed the request):
                # compute it privately, before anything reached the client
                self._private_fallback(request_id, "prefix load failed", exc, claim, ip)
                del body["kv_transfer_params"]
                body["cache_salt"] = _cache_salt(salt, 0)
                await self._stream(stream, request_id, route, body, start, imported=0, reason=reason, claim=claim)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request fails alone; the server keeps serving
            log.warning("vllm request failed", extra={"event": "vllm_error", "request_id": request_id,
                                                      "error": str(exc) or type(exc).__name__})
            stream.queue.put_nowait(TokenEvent(request_id, None, "", finish_reason=FinishReason.ERROR,
                                               error=f"the vllm instance failed: {exc}"))
        finally:
            self._running -= 1
            claim.release()
            if ip > 0:
                self.store.unpin(pin)

    def _private_fallback(self, request_id: str, why: str, exc: BaseException, claim: _Claim, ip: int) -> None:
        """The request's prefix is computed by its own instance: logged, counted, and its place's load."""
        log.warning(f"{why}; private prefill", extra={
            "event": "private_fallback", "request_id": request_id, "error": str(exc) or type(exc).__name__})
        self._counts["private_fallbacks"] += 1
        claim.add(ip)

    def _blocks(self, tokens: list[int], salt: str) -> list[StoreBlock]:
        return prefix_blocks(tokens, family=self.family, salt=salt, block_size=self.block_size)

    async def _prefill(self, prefix: list[int], salt: str, keys: list[bytes]) -> None:
        """The base's KV of ``prefix`` in the store: computed once however many ask at once."""
        if all(self.store.contains(k) for k in keys):
            return
        if not self.instances[BASE].ready:
            raise Unavailable("the base instance is not serving")
        flight = (salt, keys[-1])
        fut = self._prefills.get(flight)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._prefills[flight] = fut
            try:
                body = {"model": self.base_name, "prompt": prefix, "max_tokens": 1, "cache_salt": _cache_salt(salt, None),
                        "kv_transfer_params": {"agentshare": {"op": "save", "n": len(prefix), "salt": salt}}}
                r = await self._http.post(self.instances[BASE].url + "/v1/completions", json=body)
                r.raise_for_status()
                usage = r.json().get("usage") or {}
                reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                self._counts["exported_prefill_tokens"] += len(prefix) - reused  # the base computed them for others
                self._counts["exported_cached_tokens"] += reused
                if not all(self.store.contains(k) for k in keys):
                    raise Unavailable("the base instance answered but saved no prefix (see its log)")
                fut.set_result(None)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
                raise
            finally:
                self._prefills.pop(flight, None)
        else:
            await asyncio.shield(fut)

    async def _stream(self, stream: VllmStream, request_id: str, route: Route, body: dict[str, Any],
                      start: float, *, imported: int, pin: str | None = None, reason: str = "only_candidate",
                      pushed: Pushed | None = None, claim: _Claim | None = None) -> None:
        if route.node is None:
            url, headers = self.instances[route.instance].url + "/v1/completions", None
        else:
            url, headers = route.node.url + "/internal/vllm/completions", route.node.headers(pin)
        first: float | None = None
        count = 0
        finish: FinishReason | None = None
        usage: dict[str, Any] = {}
        async with self._http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:500]
                if resp.status_code == 400:
                    raise InvalidRequest(f"vllm refused the request: {text}")
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for data in _sse(resp.aiter_lines()):
                chunk = json.loads(data)
                if "error" in chunk:  # vLLM failed the request mid-stream
                    err = chunk["error"]
                    raise _Failed(str(err.get("message") if isinstance(err, dict) else err),
                                  before_first_token=first is None)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                    for i, tid in enumerate(ids):
                        if first is None:
                            first = time.monotonic()
                            if claim is not None:
                                claim.computed()
                        count += 1
                        top = [(_token_id(k), v) for k, v in (tops[i] or {}).items()] if i < len(tops) else []
                        stream.queue.put_nowait(TokenEvent(
                            request_id, tid, choice.get("text", "") if i == len(ids) - 1 else "",
                            logprob=lps[i] if i < len(lps) else None, top_logprobs=top))
                    if choice.get("finish_reason"):
                        finish = _FINISH.get(choice["finish_reason"], FinishReason.STOP)
        prompt_tokens = int(usage.get("prompt_tokens", len(body["prompt"])))
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        end = time.monotonic()
        c = self._counts
        c["prompt_tokens"] += prompt_tokens
        c["cached_prompt_tokens"] += cached
        c["imported_prompt_tokens"] += min(imported, cached)
        c["decode_tokens"] += count
        c["finished"] += 1
        timeline = Timeline(queue_s=0.0, ttft_s=None if first is None else first - start, e2e_s=end - start,
                            decode_steps=max(count - 1, 0), computed_tokens=prompt_tokens - cached,
                            reused_tokens=cached - min(imported, cached), imported_tokens=min(imported, cached),
                            prefill=self.instances[BASE].url if imported else "local", route=f"{route.instance}:{reason}",
                            transfer_bytes=pushed.bytes if pushed else 0, transfer_s=pushed.seconds if pushed else 0.0,
                            transfer_codec=route.node.codec if pushed and route.node else None)
        stream.queue.put_nowait(TokenEvent(
            request_id, None, "", finish_reason=finish or FinishReason.STOP,
            usage=Usage(prompt_tokens, cached, count), timeline=timeline))

    async def add_context(self, context_id: str, token_ids: SequenceOf[int], *, ttl: float,
                          salt: str = "") -> TokenEvent:
        ids = list(token_ids)
        if not ids:
            raise InvalidRequest("a shared context needs at least one token")
        keys = [b.key for b in self._blocks(ids, salt)]
        name = f"ctx-{_salt_tag(context_id)}"
        self.store.pin(name, keys, ttl=ttl)
        cached = len(ids) if all(self.store.contains(k) for k in keys) else 0
        try:
            await self._prefill(ids, salt, keys)
        except BaseException:
            self.store.unpin(name)
            raise
        self._contexts[context_id] = name
        return TokenEvent(context_id, None, "", finish_reason=FinishReason.PREFILLED,
                          usage=Usage(len(ids), cached, 0))

    async def release_context(self, context_id: str) -> bool:
        name = self._contexts.pop(context_id, None)
        if name is None:
            return False
        self.store.unpin(name)
        return True

    async def explain(self, module: str, prompt: Prompt, *, salt: str = "") -> CacheReport:
        route = self._route(module)
        ip = self._shared_ip(route, prompt)
        blocks = [b for b in self._blocks(list(prompt.token_ids[:ip]), salt) if b.end - b.start == self.block_size]
        hit = self.store.held_prefix(b.key for b in blocks)
        total = len(prompt.token_ids) // self.block_size
        return CacheReport(self.block_size, total, hit)

    async def snapshot(self) -> EngineSnapshot:
        c = self._counts
        s = self.store.counters_total()
        blocks, held = await asyncio.to_thread(self.store.usage)
        for node in self.nodes:  # the blocks its instances loaded count as hits; its store's memory is not ours
            stats = await node.stats(self._http)
            if stats is not None:
                s.loaded_blocks += int(stats["store"]["loaded_blocks"])
        cap = self.instances.store.capacity_bytes
        per_block = held // blocks if blocks else 0
        return EngineSnapshot(
            prompt_tokens=c["prompt_tokens"], cached_prompt_tokens=c["cached_prompt_tokens"],
            imported_prompt_tokens=c["imported_prompt_tokens"],
            # positions computed: the agents' instances (prompt - cached) and the base, for them
            prefill_tokens=c["prompt_tokens"] - c["cached_prompt_tokens"] + c["exported_prefill_tokens"],
            exported_prefill_tokens=c["exported_prefill_tokens"], exported_cached_tokens=c["exported_cached_tokens"],
            decode_tokens=c["decode_tokens"], finished=c["finished"], hit_blocks=s.loaded_blocks,
            evictions=s.evicted_blocks, blocks_capacity=cap // per_block if per_block else 0,
            blocks_held=blocks, bytes_held=held, running=self._running, contexts=len(self._contexts),
        )

    def health(self) -> HealthReport:
        down = self.instances.down()
        issues = [f"vllm instance {n} is not serving" for n in down] + [i for n in self.nodes for i in n.issues()]
        return HealthReport(0, self._running, tuple(issues))

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.instances.close()


async def _sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            if data.strip() == "[DONE]":
                return
            yield data


def _token_id(key: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` names a token ``token_id:123``."""
    return int(key.rsplit(":", 1)[1]) if key.startswith("token_id:") else -1


class _VllmCollector:
    """Prometheus collector: the store's counters, and every instance's own metrics (labelled
    ``instance``), fetched at scrape time."""

    def __init__(self, backend: VllmBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterable[Metric]:
        b = self.backend
        s = b.store.counters_total()
        g = GaugeMetricFamily("agentshare_vllm_store", "agentshare's vLLM KV store counters", labels=["counter"])
        for name, value in asdict(s).items():
            g.add_metric([name], value)
        yield g
        fb = GaugeMetricFamily("agentshare_vllm_private_fallbacks", "requests served by a private prefill "
                               "because the base instance could not prefill")
        fb.add_metric([], b._counts["private_fallbacks"])
        yield fb
        if b.nodes:
            push = GaugeMetricFamily("agentshare_vllm_node_push", "prefix KV sent to vllm nodes on other hosts",
                                     labels=["node", "counter"])
            for node in b.nodes:
                for counter, value in node.pushed.items():
                    push.add_metric([node.name, counter], value)
            yield push
        for name, inst in b.instances.instances.items():
            if not inst.ready:
                continue
            try:
                text = httpx.get(inst.url + "/metrics", timeout=2).text
            except httpx.HTTPError:
                continue
            yield from _labelled(text, name)
        for node in b.nodes:
            try:
                texts = httpx.get(node.url + "/internal/vllm/metrics", headers=node.headers(), timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            for name, text in texts.items():
                yield from _labelled(text, f"{node.name}/{name}")


def _labelled(text: str, instance: str) -> Iterable[Metric]:
    """An instance's vLLM metrics (Prometheus text), each sample labelled ``instance``."""
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm"):
            continue
        out = Metric(fam.name, fam.documentation, fam.type)
        for sample in fam.samples:
            out.add_sample(sample.name, {**sample.labels, "instance": instance}, sample.value)
        yield out
