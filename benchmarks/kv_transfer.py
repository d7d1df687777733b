"""KV transfer between two processes: bytes, encode time, transfer time and throughput per codec
and transport, on SmolLM2-135M's KV shape (30 layers, 3 kv heads, head_dim 64, block 16).

The receiver is a subprocess (this script with ``--serve``) that decodes every frame into its KV
dtype, as a decode worker would; the sender encodes the context in chunks of 32 blocks (512
tokens) beforehand and times open -> ``finish()`` acknowledged (the receiver's decode included,
the encode reported apart). The KV is random normal, not a model's: int8's error on real KV
differs (real K has outlier channels, which the per-channel K scales are there to absorb).
Every frame carries its HMAC-SHA256 under a KV key made for the run (as a cluster's would be):
the figures include computing it on both ends.

    python benchmarks/kv_transfer.py [--contexts 1024,4096] [--codecs bf16,int8,fp32]
        [--transports tcp,shm] [--source bf16] [--reps 3] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from server.cluster import codecs
from server.cluster.codec import Frame, KVChunk, decode, encode
from server.cluster.transport import KVReceiver, open_sender

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # SmolLM2-135M
KEY_ENV = "KV_TRANSFER_BENCH_KEY"  # the receiver's KV key, hex, from the parent
CHUNK_BLOCKS = 32
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# -- the receiving process ---------------------------------------------------------------------


class Decoder:
    """Decodes each frame into the receiver's dtype; reports each transfer on stdout."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.decode_s, self.frames = dtype, 0.0, 0

    async def on_open(self, transfer_id: str, header: dict[str, Any]) -> None:
        self.decode_s, self.frames = 0.0, 0

    async def on_frame(self, transfer_id: str, frame: Frame) -> None:
        t0 = time.perf_counter()
        decode(frame, dtype=self.dtype)
        self.decode_s += time.perf_counter() - t0
        self.frames += 1

    async def on_end(self, transfer_id: str, error: str | None) -> None:
        report = {"transfer_id": transfer_id, "error": error, "decode_s": self.decode_s}
        print(json.dumps(report), flush=True)


async def serve(dtype: torch.dtype) -> None:
    receiver = KVReceiver(Decoder(dtype), key=bytes.fromhex(os.environ.pop(KEY_ENV)))
    await receiver.start()
    print(json.dumps({"port": receiver.port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent ends
    await receiver.close()


# -- the sending process -----------------------------------------------------------------------


def make_kv(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, tokens, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def encode_all(k: torch.Tensor, v: torch.Tensor, codec: str) -> list[Frame]:
    step = CHUNK_BLOCKS * BLOCK
    return [
        encode(
            KVChunk(s // BLOCK, k[:, :, s : s + step], v[:, :, s : s + step]),
            codec,
            block_size=BLOCK,
        )
        for s in range(0, k.shape[2], step)
    ]


def reconstruction(k: torch.Tensor, v: torch.Tensor, frames: list[Frame]) -> dict[str, float]:
    """Max abs error and relative RMS error of K and V after the codec, in fp32."""
    out = [decode(f, dtype=torch.float32) for f in frames]
    k2, v2 = torch.cat([c.k for c in out], dim=2), torch.cat([c.v for c in out], dim=2)
    res = {}
    for name, x, y in (("k", k.float(), k2), ("v", v.float(), v2)):
        res[f"{name}_max_abs"] = float((x - y).abs().max())
        res[f"{name}_rel_rms"] = float((x - y).norm() / x.norm())
    return res


async def transfer(address: str, tid: str, codec: str, frames: list[Frame], key: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    sender = await open_sender(address, tid, codec=codec, timeout=60, key=key)
    for frame in frames:
        await sender.send(frame)
    await sender.finish()
    return time.perf_counter() - t0, sender.stats.bytes


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    source = DTYPES[args.source]
    receiver_dtype = DTYPES[args.receiver_dtype or args.source]
    key = os.urandom(32)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve",
        "--threads",
        str(args.threads),
        "--receiver-dtype",
        args.receiver_dtype or args.source,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, KEY_ENV: key.hex()},
    )
    assert proc.stdout is not None and proc.stdin is not None
    port = json.loads(await proc.stdout.readline())["port"]
    rows, errors, n = [], {}, 0
    try:
        for tokens in args.contexts:
            k, v = make_kv(tokens, source)
            for codec in args.codecs:
                encode_s = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    frames = encode_all(k, v, codec)
                    encode_s.append(time.perf_counter() - t0)
                payload = sum(len(f.payload) for f in frames)
                if codec != "fp32" or source != torch.float32:
                    errors[f"{codec}@{tokens}"] = reconstruction(k, v, frames)
                for mode in args.transports:
                    address = f"{mode}://127.0.0.1:{port}"
                    await transfer(address, f"warm{n}", codec, frames[:1], key)  # connect paths warm
                    await proc.stdout.readline()
                    times, decode_s = [], []
                    for _ in range(args.reps):
                        n += 1
                        seconds, wire = await transfer(address, f"t{n}", codec, frames, key)
                        report = json.loads(await proc.stdout.readline())
                        assert report["error"] is None, report
                        times.append(seconds)
                        decode_s.append(report["decode_s"])
                    t = statistics.median(times)
                    rows.append(
                        {
                            "context": tokens,
                            "codec": str(codec),
                            "transport": mode,
                            "payload_bytes_per_1k_tokens": payload * 1000 / tokens,
                            "wire_bytes": wire,
                            "encode_ms_per_1k_tokens": statistics.median(encode_s) * 1e6 / tokens,
                            "transfer_ms_per_1k_tokens": t * 1e6 / tokens,
                            "receiver_decode_ms_per_1k_tokens": statistics.median(decode_s)
                            * 1e6
                            / tokens,
                            "throughput_MBps": wire / t / 1e6,
                        }
                    )
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)
    return {"rows": rows, "reconstruction": errors, "receiver_dtype": str(receiver_dtype)}


def print_report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(
        f"KV of SmolLM2-135M ({LAYERS} layers x {HEADS} kv heads x head_dim {HEAD_DIM}, "
        f"block {BLOCK}); source {args.source}, the receiver process decodes into "
        f"{args.receiver_dtype or args.source}\nframes of {CHUNK_BLOCKS * BLOCK} tokens; "
        f"median of {args.reps}; {args.threads} torch thread(s) per process; MB = 1e6 bytes"
    )
    head = (
        f"{'context':>7} {'codec':>5} {'link':>4} {'payload MB/1k':>13} {'wire MB':>8} "
        f"{'encode ms/1k':>12} {'transfer ms/1k':>14} {'(decode ms/1k)':>14} {'MB/s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        print(
            f"{r['context']:>7} {r['codec']:>5} {r['transport']:>4} "
            f"{r['payload_bytes_per_1k_tokens'] / 1e6:>13.2f} {r['wire_bytes'] / 1e6:>8.1f} "
            f"{r['encode_ms_per_1k_tokens']:>12.1f} {r['transfer_ms_per_1k_tokens']:>14.1f} "
            f"{r['receiver_decode_ms_per_1k_tokens']:>14.1f} {r['throughput_MBps']:>7.0f}"
        )
    per_1k = {r["codec"]: r["payload_bytes_per_1k_tokens"] for r in res["rows"]}
    if "int8" in per_1k and "bf16" in per_1k:
        res["int8_bytes_vs_bf16"] = per_1k["int8"] / per_1k["bf16"]
        print(
            f"int8 bytes per token vs bf16: {res['int8_bytes_vs_bf16']:.3f} "
            f"(codes 0.500, K scales {1 / BLOCK / 2:.3f}, V scales {1 / HEAD_DIM / 2:.4f})"
        )
    print("reconstruction vs the source, random-normal KV (fp32 maths):")
    for key, e in res["reconstruction"].items():
        print(
            f"  {key:>10}: K max abs {e['k_max_abs']:.4f}, rel RMS {e['k_rel_rms']:.4f}; "
            f"V max abs {e['v_max_abs']:.4f}, rel RMS {e['v_rel_rms']:.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--contexts", default="1024,4096", help="context sizes, multiples of 512 tokens"
    )
    ap.add_argument("--codecs", default="bf16,int8,fp32")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument(
        "--source", choices=sorted(DTYPES), default="bf16", help="the sender's KV dtype"
    )
    ap.add_argument("--receiver-dtype", choices=sorted(DTYPES), help="default: the source's")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads in each of the 2 processes"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        asyncio.run(serve(DTYPES[args.receiver_dtype]))
        return
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % (CHUNK_BLOCKS * BLOCK) for c in args.contexts):
        ap.error(f"contexts must be multiples of {CHUNK_BLOCKS * BLOCK} tokens")
    args.codecs = [codecs.get(c).name for c in args.codecs.split(",")]  # any registered codec
    args.transports = args.transports.split(",")
    res = asyncio.run(measure(args))
    res["settings"] = {
        k: v if k != "codecs" else [str(c) for c in v]
        for k, v in vars(args).items()
        if k not in ("json", "serve")
    }
    print_report(args, res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
