"""The codec registry: a codec defined here, registered by name, moves KV through the real frame
encode/decode and a real transfer; unknown names fail saying which names exist."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

import pytest
import torch
from typer.testing import CliRunner

from server.cluster import codecs
from server.cluster.codec import Codec, Frame, KVChunk, decode, encode, is_lossy
from server.cluster.codecs import KVShape, UnknownCodec, view
from server.cluster.errors import ProtocolError
from server.cluster.transport import KVReceiver, open_sender

torch.set_num_threads(1)

BLOCK = 4
KEY = b"k" * 32


class Swapped:
    """A toy codec: one float16 section holding V then K. Exact for float16 KV only."""

    name = "toy-swapped"

    def is_lossy(self, source: torch.dtype) -> bool:
        return source != torch.float16

    def sections(self, shape: KVShape) -> dict[str, int]:
        return {"vk": 2 * 2 * shape.values}

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, shape: KVShape, out: Mapping[str, torch.Tensor]
    ) -> None:
        both = view(out["vk"], torch.float16, (2, *shape.full))
        both[0].copy_(v)
        both[1].copy_(k)

    def decode(
        self, sections: Mapping[str, torch.Tensor], shape: KVShape, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        both = view(sections["vk"], torch.float16, (2, *shape.full))
        return both[1].to(dtype, copy=True), both[0].to(dtype, copy=True)


@pytest.fixture
def toy() -> Iterator[Swapped]:
    codec = codecs.register(Swapped())
    try:
        yield codec
    finally:
        codecs.unregister(codec.name)


def chunk(blocks: int = 3, dtype: torch.dtype = torch.float16) -> KVChunk:
    g = torch.Generator().manual_seed(blocks)
    k = torch.randn(2, 2, blocks * BLOCK, 8, generator=g).to(dtype)
    return KVChunk(first_block=1, k=k, v=-2 * k)


def test_built_in_codecs_are_registered_under_the_enums_names() -> None:
    assert codecs.names()[:3] == tuple(Codec) == ("fp32", "bf16", "int8")
    assert all(codecs.get(c).name == c for c in Codec)


def test_a_registered_codec_round_trips_through_the_frame(toy: Swapped) -> None:
    assert toy.name in codecs.names()
    original = chunk()
    frame = encode(original, toy.name, block_size=BLOCK)
    assert frame.header["codec"] == "toy-swapped" and frame.header["num_blocks"] == 3
    assert frame.header["sections"] == {"vk": [0, 2 * 2 * 2 * 2 * 12 * 8]}
    back = decode(frame, dtype=torch.float16)
    assert back.first_block == 1
    assert torch.equal(back.k, original.k) and torch.equal(back.v, original.v)
    assert not is_lossy(toy.name, torch.float16) and is_lossy(toy.name, torch.float32)


def test_a_registered_codec_crosses_a_real_transfer(toy: Swapped) -> None:
    sent = [chunk(1), chunk(2)]

    class Keep:
        async def on_open(self, transfer_id: str, header: dict) -> None:
            self.codec, self.got = header["codec"], []

        async def on_frame(self, transfer_id: str, frame: Frame) -> None:
            self.got.append(decode(frame, dtype=torch.float16))

        async def on_end(self, transfer_id: str, error: str | None) -> None:
            self.error = error

    async def go(handler: Keep) -> None:
        receiver = KVReceiver(handler, key=KEY)
        await receiver.start()
        try:
            sender = await open_sender(receiver.address("tcp"), "t1", codec=toy.name, key=KEY)
            for c in sent:
                await sender.send(encode(c, toy.name, block_size=BLOCK))
            await sender.finish()
        finally:
            await receiver.close()

    handler = Keep()
    asyncio.run(go(handler))
    assert handler.codec == "toy-swapped" and handler.error is None
    assert [torch.equal(g.k, s.k) and torch.equal(g.v, s.v) for g, s in zip(handler.got, sent, strict=True)] == [True, True]


def test_an_unregistered_codec_is_refused_on_the_wire(toy: Swapped) -> None:
    frame = encode(chunk(1), toy.name, block_size=BLOCK)
    codecs.unregister(toy.name)
    try:
        with pytest.raises(ProtocolError, match="unknown codec 'toy-swapped'; registered codecs: fp32, bf16, int8"):
            decode(frame, dtype=torch.float16)
    finally:
        codecs.register(toy)


def test_a_receiver_checks_the_codec_of_an_open_against_the_registry(toy: Swapped) -> None:
    from server.cluster.transport import _check_open

    header = {"kind": "open", "transfer_id": "t1", "mode": "tcp", "codec": toy.name}
    assert _check_open(header) == ("t1", "tcp", "toy-swapped")
    codecs.unregister(toy.name)
    try:
        with pytest.raises(ProtocolError, match="unknown codec 'toy-swapped'; registered codecs: fp32, bf16, int8"):
            _check_open(header)
    finally:
        codecs.register(toy)


def test_unknown_codec_names_fail_listing_the_registered_ones() -> None:
    message = r"unknown codec 'fp8'; registered codecs: fp32, bf16, int8 \(add one with server.cluster.codecs.register\)"
    with pytest.raises(UnknownCodec, match=message):
        encode(chunk(1), "fp8", block_size=BLOCK)
    with pytest.raises(UnknownCodec, match=message):
        is_lossy("fp8", torch.float32)
    with pytest.raises(ValueError, match=message):  # UnknownCodec is a ValueError
        asyncio.run(open_sender("tcp://127.0.0.1:1", "t", codec="fp8", key=KEY))
    with pytest.raises(UnknownCodec, match="unknown codec None"):
        codecs.get(None)


def test_registering_checks_the_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        codecs.register(codecs.get("int8"))
    bad = Swapped()
    bad.name = "Toy Codec"
    with pytest.raises(ValueError, match="lowercase letters, digits"):
        codecs.register(bad)
    assert codecs.names() == ("fp32", "bf16", "int8")


def test_router_config_and_cli_take_registered_names(toy: Swapped) -> None:
    from server.cli import app
    from server.cluster.router import RouterConfig

    assert RouterConfig(codec=toy.name).codec == "toy-swapped"
    assert type(RouterConfig(codec=Codec.INT8).codec) is str  # names, whichever way spelt
    with pytest.raises(UnknownCodec, match="registered codecs: fp32, bf16, int8, toy-swapped"):
        RouterConfig(codec="fp8")
    result = CliRunner().invoke(app, ["router", "--worker", "http://127.0.0.1:1", "--transfer-codec", "fp8"])
    assert result.exit_code == 2
    assert "unknown codec 'fp8'" in result.output and "toy-swapped" in result.output
