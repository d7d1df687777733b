"""Greedy agreement when a shared prefix crosses the wire as int8 (vs bf16), on SmolLM2-135M.

Each prompt is a chat over a 256-token window of real text (the demo's incident report), then
a question. Its shared prefix (the full blocks before the invocation point) is prefilled by one
engine, moved through the real transfer codec (encode -> bytes -> decode) into a second
engine, and the second engine greedily generates ``--tokens`` tokens from it. Arms, same
prompts, same engines:

    local   the decode engine prefills the prefix itself (the reference)
    <codec> the prefix moved through that codec (``--codecs``, default bf16,int8): bf16 is exact
            when the engines run bf16; int8 quantises K per channel and V per token per block
            (KIVI-style) and its blocks land in the lossy namespace

Reported: int8 vs bf16 (the codec's own effect: both arms split prefill and decode the same
way), and each vs local (in bf16 a different split changes reduction order, so even an exact
bf16 move is not bitwise the local run). Per pair: prompts identical over all tokens, and the
mean length of the matching prefix. Every prompt of an arm is batched (continuous batching).
In fp32 engines (``--dtype float32 --codecs fp32,bf16,int8``) reduction order barely matters,
so the codecs' own effect shows.

    python benchmarks/kv_int8_agreement.py [--prompts 50] [--tokens 64] [--threads 2] [--json out.json]
    python benchmarks/kv_int8_agreement.py --dtype float32 --codecs fp32,bf16,int8   # the codecs alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from server.cluster import codecs
from server.cluster.codec import decode, encode, is_lossy
from server.cluster.handoff import Inbound, Outbound
from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.numerics import set_threads
from server.engine.sampling import SamplingParams
from server.models.loader import default_model_dir
from server.prompt import Placement, Prompt, chat_prompt

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "incident-report.md"
QUESTIONS = ("Summarise the passage above.", "What went wrong first?", "List the people involved.",
             "What should be done next?", "Quote the most important number.")


def prompts(core: EngineCore, n: int, window: int = 256) -> list[Prompt]:
    tok = core.tokenizer
    words = tok.encode(TEXT.read_text(), add_special_tokens=False)
    step = max(1, (len(words) - window) // n)
    return [chat_prompt(tok, [{"role": "user", "content": tok.decode(words[i * step : i * step + window])}],
                        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]


def generate(core: EngineCore, batch: list[Prompt], tokens: int, prefix_codec: str | None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        core.add_request(str(i), "base", p, params, prefix_codec=prefix_codec)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while core.has_work:
        for e in core.step():
            if e.token_id is not None:
                out[e.request_id].append(e.token_id)
    return [out[str(i)] for i in range(len(batch))]


def move(prefill: EngineCore, dec: EngineCore, prefix: list[int], codec: str, tid: str) -> tuple[int, int, str | None]:
    """Prefill ``prefix`` on ``prefill`` and import the blocks ``dec`` lacks through ``codec``, as
    the router has the workers do; returns the payload bytes, the tokens moved and the namespace
    codec."""
    loop = asyncio.new_event_loop()
    lossy = codec if is_lossy(codec, dec.kv.spec.dtype) else None
    try:
        inbound = Inbound.expect(dec, tid, prefix, salt="", prefix_codec=lossy, ttl=600)
        if inbound.num_blocks == 0:  # the decode side has it all (a shared system prompt)
            inbound.finish(dec)
            return 0, 0, lossy
        out = Outbound.start(prefill, tid, prefix, salt="", first_block=inbound.first_block, chunk_blocks=32,
                             ttl=600, loop=loop)
        while not out.done:
            prefill.step()
            out.on_step(prefill)
        loop.run_until_complete(asyncio.sleep(0))
        nbytes = 0
        while (chunk := out.queue.get_nowait()) is not None:
            frame = encode(chunk, codec, block_size=dec.config.block_size)
            nbytes += len(frame.payload)
            inbound.write(dec, decode(frame, dtype=dec.kv.spec.dtype))
        inbound.finish(dec)
        prefill.release_context(tid)
        return nbytes, inbound.num_blocks * dec.config.block_size, lossy
    finally:
        loop.close()


def matching(got: list[list[int]], ref: list[list[int]], tokens: int) -> list[int]:
    """Per prompt: how many leading tokens agree."""
    return [next((k for k, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), tokens)
            for g, r in zip(got, ref, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="the engines' dtype (and KV dtype)")
    ap.add_argument("--codecs", default="bf16,int8", help="transfer codecs to compare, e.g. fp32,bf16,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    set_threads(args.threads)
    loaded = load_engine(default_model_dir(), dtype=args.dtype)
    cfg = EngineConfig(kv_cache_bytes=1 << 30)
    batch = prompts(loaded, args.prompts)
    bs = cfg.block_size
    prefixes = [list(p.token_ids[: p.invocation_point(Placement.TURN) // bs * bs]) for p in batch]
    print(f"SmolLM2-135M {args.dtype}, {len(batch)} prompts, {args.tokens} greedy tokens, "
          f"prefix {statistics.mean(map(len, prefixes)):.0f} tokens on average, {args.threads} thread(s)")
    t = time.perf_counter()
    outputs = {"local": generate(loaded.with_config(cfg), batch, args.tokens, None)}
    print(f"  local: {time.perf_counter() - t:.1f} s")
    results: dict[str, dict] = {}
    names = [codecs.get(c).name for c in args.codecs.split(",")]  # any registered codec
    for codec in names:
        t = time.perf_counter()
        prefill, dec = loaded.with_config(cfg), loaded.with_config(cfg)
        nbytes, moved, lossy = 0, 0, None
        for i, prefix in enumerate(prefixes):
            n, tokens, lossy = move(prefill, dec, prefix, codec, f"t{i}")
            nbytes, moved = nbytes + n, moved + tokens
        assert dec.stats.prefill_tokens == 0
        got = generate(dec, batch, args.tokens, lossy)
        saved = sum(map(len, prefixes)) - (dec.stats.cached_prompt_tokens)
        assert saved == 0, f"{saved} prefix tokens were recomputed on the decode side"
        outputs[codec] = got
        results[codec] = {"payload_bytes_per_token": nbytes / max(1, moved), "lossy_namespace": lossy,
                                "seconds": time.perf_counter() - t}
    pairs = [(f"int8 vs {c}", "int8", c) for c in names if c != "int8" and "int8" in names]
    pairs += [(f"{c} vs local", c, "local") for c in names]
    for name, a, b in pairs:
        same = matching(outputs[a], outputs[b], args.tokens)
        results[name] = {"identical": sum(n == args.tokens for n in same),
                         "mean_matching_prefix": statistics.mean(same), "matching_prefix": same}
        print(f"  {name:13s}: {results[name]['identical']}/{len(batch)} identical over {args.tokens} tokens, "
              f"mean matching prefix {results[name]['mean_matching_prefix']:.1f}")
    for codec in names:
        r = results[codec]
        print(f"  {codec}: {r['payload_bytes_per_token']:.0f} payload bytes/token, namespace "
              f"{'lossy/' + r['lossy_namespace'] if r['lossy_namespace'] else 'exact'}, {r['seconds']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": len(batch), "tokens": args.tokens, "dtype": args.dtype,
                                         "codecs": names, "results": results}, indent=2))


if __name__ == "__main__":
    main()
