"""The KV payload codec and the wire framing."""

from __future__ import annotations

import asyncio
import copy
import json
import struct
import zlib

import pytest
import torch

from server.cluster.codec import Codec, Frame, KVChunk, decode, encode, is_lossy
from server.cluster.errors import CorruptPayload, ProtocolError, TransferClosed, Unauthenticated
from server.cluster.wire import DATA, MAGIC, PREFIX, TAG, VERSION, Seal, read_frame, write_frame

torch.set_num_threads(1)

LAYERS, HEADS, DIM, BLOCK = 2, 2, 8, 4


def kv(blocks: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> KVChunk:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, blocks * BLOCK, DIM)
    k = (torch.randn(shape, generator=g) * 3).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return KVChunk(first_block=0, k=k, v=v)


def roundtrip(chunk: KVChunk, codec: Codec, dtype: torch.dtype) -> KVChunk:
    return decode(encode(chunk, codec, block_size=BLOCK), dtype=dtype)


@pytest.mark.parametrize(
    ("source", "codec"),
    [
        (torch.float32, Codec.FP32),
        (torch.bfloat16, Codec.BF16),
        (torch.bfloat16, Codec.FP32),
    ],
)
def test_lossless_codecs_round_trip_exactly(source: torch.dtype, codec: Codec) -> None:
    chunk = kv(3, source)
    back = roundtrip(chunk, codec, source)
    assert back.first_block == 0 and back.k.dtype == source
    assert torch.equal(back.k, chunk.k) and torch.equal(back.v, chunk.v)
    assert back.k.is_contiguous() and back.v.is_contiguous()


def test_decoded_tensors_own_their_memory() -> None:
    frame = encode(kv(1), Codec.FP32, block_size=BLOCK)
    back = decode(frame, dtype=torch.float32)
    expected = back.k.clone()
    frame.payload[:] = bytes(len(frame.payload))  # type: ignore[index]
    assert torch.equal(back.k, expected)


def test_bf16_codec_of_fp32_rounds_to_bf16() -> None:
    chunk = kv(2)
    back = roundtrip(chunk, Codec.BF16, torch.float32)
    assert torch.equal(back.k, chunk.k.to(torch.bfloat16).float())


def test_encode_accepts_non_contiguous_views() -> None:
    chunk = kv(2)
    strided = KVChunk(0, chunk.k.transpose(0, 1).contiguous().transpose(0, 1), chunk.v)
    assert not strided.k.is_contiguous()
    assert torch.equal(roundtrip(strided, Codec.FP32, torch.float32).k, chunk.k)


def test_int8_error_within_half_a_scale() -> None:
    chunk = kv(4)
    frame = encode(chunk, Codec.INT8, block_size=BLOCK)
    back = decode(frame, dtype=torch.float32)
    blocks = 4
    # K: one scale per (layer, head, block, channel) = absmax over the block's tokens / 127
    k = chunk.k.view(LAYERS, HEADS, blocks, BLOCK, DIM)
    k_scale = k.abs().amax(dim=3, keepdim=True) / 127
    k_err = (back.k.view_as(k) - k).abs()
    # the stored fp16 scale is rounded up: at most one fp16 ulp (2**-10 relative) larger
    assert bool((k_err <= k_scale / 2 * (1 + 2**-9) + 1e-7).all()), k_err.max()
    # V: one scale per (layer, head, token) = absmax over head_dim / 127
    v_scale = chunk.v.abs().amax(dim=3, keepdim=True) / 127
    v_err = (back.v - chunk.v).abs()
    assert bool((v_err <= v_scale / 2 * (1 + 2**-9) + 1e-7).all()), v_err.max()
    assert back.k.abs().max() > 0  # not trivially zero


def test_int8_blocks_are_quantised_independently() -> None:
    chunk = kv(4, torch.bfloat16)
    together = roundtrip(chunk, Codec.INT8, torch.bfloat16)
    for b in range(4):
        s = slice(b * BLOCK, (b + 1) * BLOCK)
        alone = KVChunk(first_block=b, k=chunk.k[:, :, s], v=chunk.v[:, :, s])
        back = roundtrip(alone, Codec.INT8, torch.bfloat16)
        assert back.first_block == b
        assert torch.equal(back.k, together.k[:, :, s]) and torch.equal(back.v, together.v[:, :, s])


@pytest.mark.parametrize("codec", list(Codec))
def test_all_zero_blocks_decode_to_zeros(codec: Codec) -> None:
    chunk = kv(3)
    chunk.k[:, :, BLOCK : 2 * BLOCK] = 0  # a whole block of K
    chunk.v[:, :, 5] = 0  # one token of V
    back = roundtrip(chunk, codec, torch.float32)
    assert not back.k.isnan().any() and not back.v.isnan().any()
    assert bool((back.k[:, :, BLOCK : 2 * BLOCK] == 0).all()) and bool((back.v[:, :, 5] == 0).all())
    zeros = KVChunk(
        0, torch.zeros(LAYERS, HEADS, BLOCK, DIM), torch.zeros(LAYERS, HEADS, BLOCK, DIM)
    )
    back = roundtrip(zeros, codec, torch.float32)
    assert bool((back.k == 0).all()) and bool((back.v == 0).all())


def test_int8_saturates_beyond_the_fp16_scale_range_and_rejects_nan() -> None:
    chunk = kv(1)
    chunk.k[0, 0, 0, 0] = 1e7  # scale 1e7/127 > fp16 max: clamped, the code saturates
    back = roundtrip(chunk, Codec.INT8, torch.float32)
    assert back.k[0, 0, 0, 0] == pytest.approx(127 * 65504)
    chunk.v[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        encode(chunk, Codec.INT8, block_size=BLOCK)


def test_int8_payload_is_about_half_of_bf16() -> None:
    chunk = kv(4)
    bf16 = len(encode(chunk, Codec.BF16, block_size=BLOCK).payload)
    int8 = len(encode(chunk, Codec.INT8, block_size=BLOCK).payload)
    # codes: half of bf16; K scales: 2 bytes per channel per block; V scales: 2 bytes per token
    assert int8 == bf16 // 2 + 2 * LAYERS * HEADS * (4 * DIM + 4 * BLOCK)


def test_flipped_payload_byte_is_corrupt() -> None:
    frame = encode(kv(2), Codec.INT8, block_size=BLOCK)
    frame.payload[17] ^= 0x40  # type: ignore[index]
    with pytest.raises(CorruptPayload, match="checksum mismatch"):
        decode(frame, dtype=torch.float32)


def test_crc_is_checked_before_the_header() -> None:
    frame = encode(kv(2), Codec.FP32, block_size=BLOCK)
    frame.payload[0] ^= 1  # type: ignore[index]
    frame.header["num_layers"] = "many"
    with pytest.raises(CorruptPayload):
        decode(frame, dtype=torch.float32)


def tampered(change: dict, *, codec: Codec = Codec.INT8) -> Frame:
    frame = encode(kv(2), codec, block_size=BLOCK)
    header = copy.deepcopy(frame.header)
    for key, value in change.items():
        if value is None:
            del header[key]
        else:
            header[key] = value
    return Frame(header, frame.payload)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_layers": 3}, "sections"),  # wrong shape
        ({"head_dim": 4}, "sections"),
        ({"num_blocks": 2.0}, "must be an integer"),
        ({"block_size": True}, "must be an integer"),
        ({"first_block": -1}, "must be >= 0"),
        ({"num_kv_heads": 0}, "must be >= 1"),
        ({"codec": "fp8"}, "unknown codec"),
        ({"codec": "bf16"}, "sections"),
        ({"kind": "end"}, "expected a 'kv' frame"),
        ({"crc32": "abc"}, "crc32"),
        ({"crc32": None}, "crc32"),
        ({"sections": {"k": [0, 1]}}, "sections"),
        ({"sections": None}, "sections"),
    ],
)
def test_tampered_header_is_a_protocol_error(change: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(tampered(change), dtype=torch.float32)


def test_payload_length_must_match_the_shape() -> None:
    frame = encode(kv(2), Codec.BF16, block_size=BLOCK)
    short = bytes(frame.payload[:-2])
    header = {**frame.header, "crc32": zlib.crc32(short)}
    with pytest.raises(ProtocolError, match="the frame carries"):
        decode(Frame(header, short), dtype=torch.float32)


def test_read_only_payload_decodes_without_warning(recwarn: pytest.WarningsRecorder) -> None:
    chunk = kv(1)
    frame = encode(chunk, Codec.BF16, block_size=BLOCK)
    back = decode(Frame(frame.header, bytes(frame.payload)), dtype=torch.float32)
    assert torch.equal(back.v, chunk.v.to(torch.bfloat16).float())
    assert not [w for w in recwarn if "not writable" in str(w.message)]


@pytest.mark.parametrize(
    ("k_shape", "block_size", "message"),
    [((2, 2, 6, 8), 4, "multiple"), ((2, 6, 8), 2, r"\[layers"), ((2, 2, 0, 8), 4, "multiple")],
)
def test_encode_rejects_bad_chunks(k_shape: tuple, block_size: int, message: str) -> None:
    k = torch.zeros(k_shape)
    with pytest.raises(ValueError, match=message):
        encode(KVChunk(0, k, k), Codec.FP32, block_size=block_size)


def test_is_lossy_table() -> None:
    assert not is_lossy(Codec.FP32, torch.float32)
    assert not is_lossy(Codec.FP32, torch.bfloat16)
    assert not is_lossy(Codec.BF16, torch.bfloat16)
    assert is_lossy(Codec.BF16, torch.float32)
    assert is_lossy(Codec.INT8, torch.float32) and is_lossy(Codec.INT8, torch.bfloat16)
    assert is_lossy(Codec("bf16"), torch.float16)


# -- wire ------------------------------------------------------------------------------------


KEY = b"wire-test-key-0123456789abcdef"


async def parse(data: bytes, key: bytes = KEY, **limits: int) -> Frame:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await read_frame(reader, Seal(key, DATA), **limits)


def raw_frame(
    header: bytes, payload: bytes = b"", *, magic: bytes = MAGIC, version: int = VERSION, key: bytes = KEY
) -> bytes:
    """A frame as the wire has it, tagged under ``key`` as the first frame of a connection."""
    head = PREFIX.pack(magic, version, len(header), len(payload)) + header
    mac = Seal(key, DATA).start(head)
    mac.update(payload)
    return head + payload + mac.digest()


def test_wire_round_trip_over_a_socket() -> None:
    frame = encode(kv(2), Codec.INT8, block_size=BLOCK)

    async def main() -> tuple[Frame, int]:
        got: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.set_result(await read_frame(reader, Seal(KEY, DATA)))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        written = await write_frame(writer, frame, Seal(KEY, DATA))
        received = await asyncio.wait_for(got, 5)
        writer.close()
        server.close()
        return received, written

    received, written = asyncio.run(main())
    assert received.header == frame.header and received.payload == frame.payload
    header_len = len(json.dumps(frame.header, separators=(",", ":")))
    assert written == PREFIX.size + header_len + len(frame.payload) + TAG
    assert torch.equal(
        decode(received, dtype=torch.float32).k, roundtrip(kv(2), Codec.INT8, torch.float32).k
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (raw_frame(b"{}", magic=b"HTTP"), "bad magic"),
        (raw_frame(b"{}", version=1), "version 1 carries no valid authentication"),
        (raw_frame(b"{}", key=b"another-key-0123456789abcdef"), "failed authentication"),
        (raw_frame(b"{}")[:-1] + b"\x00", "failed authentication"),
        (raw_frame(b"{" * 64), "header of 64 bytes exceeds"),
        (raw_frame(b"{not json"), "not valid UTF-8 JSON"),
        (raw_frame(b"\xff\xfe"), "not valid UTF-8 JSON"),
        (raw_frame(b"[1, 2]"), "must be a JSON object"),
        (PREFIX.pack(MAGIC, VERSION, 2, 1 << 40) + b"{}", "payload of 1099511627776 bytes"),
    ],
)
def test_bad_frames_are_protocol_errors(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        asyncio.run(parse(data, max_header=32))


@pytest.mark.parametrize("cut", [0, 3, PREFIX.size + 2, PREFIX.size + 11, PREFIX.size + 19 + TAG - 1])
def test_truncated_stream_is_transfer_closed(cut: int) -> None:
    data = raw_frame(b'{"kind":"x"}', b"payload")
    with pytest.raises(TransferClosed):
        asyncio.run(parse(data[:cut]))


def test_write_frame_rejects_a_non_json_header() -> None:
    async def main() -> None:
        await write_frame(None, Frame({"x": float("nan")}), Seal(KEY, DATA))  # type: ignore[arg-type]

    with pytest.raises(ProtocolError, match="JSON-safe"):
        asyncio.run(main())


def test_a_tag_binds_the_frame_to_its_direction_place_and_transfer() -> None:
    """A genuine frame read as another direction, another position on the connection, or
    another transfer fails authentication: frames cannot be reflected, reordered or replayed."""
    data = raw_frame(b'{"kind":"end"}')
    assert asyncio.run(parse(data)).header == {"kind": "end"}

    async def read_as(seal: Seal) -> Frame:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, seal)

    second, bound, reply = Seal(KEY, DATA), Seal(KEY, DATA), Seal(KEY, b"reply")
    second.count = 1
    bound.bind("another-transfer")
    for seal in (second, bound, reply):
        with pytest.raises(Unauthenticated):
            asyncio.run(read_as(seal))


def test_prefix_layout_is_17_little_endian_bytes() -> None:
    assert PREFIX.size == 17
    assert PREFIX.pack(MAGIC, 1, 2, 3) == MAGIC + b"\x01" + struct.pack("<I", 2) + struct.pack(
        "<Q", 3
    )


@pytest.mark.parametrize("codec", list(Codec))
def test_decoding_gives_the_asked_dtype_and_owns_k_and_v(codec: Codec) -> None:
    frame = encode(kv(2), codec, block_size=BLOCK)
    back = decode(frame, dtype=torch.bfloat16)
    assert back.k.dtype == back.v.dtype == torch.bfloat16
    same = decode(frame, dtype=torch.float32)
    expected = (same.k.clone(), same.v.clone())
    frame.payload[:] = bytes(len(frame.payload))  # type: ignore[index]
    assert torch.equal(same.k, expected[0]) and torch.equal(same.v, expected[1])


def test_int8_saturates_negative_values_too() -> None:
    chunk = kv(1)
    chunk.k[0, 0, 0, 0] = -1e7
    assert roundtrip(chunk, Codec.INT8, torch.float32).k[0, 0, 0, 0] == pytest.approx(-127 * 65504)


def test_encode_takes_one_token_blocks_and_refuses_a_zero_block_size_or_integer_kv() -> None:
    chunk = kv(1)
    assert decode(encode(chunk, Codec.FP32, block_size=1), dtype=torch.float32).k.shape == chunk.k.shape
    with pytest.raises(ValueError):
        encode(chunk, Codec.FP32, block_size=0)
    with pytest.raises(ValueError):
        encode(KVChunk(0, chunk.k, chunk.v.to(torch.int32)), Codec.FP32, block_size=BLOCK)


@pytest.mark.parametrize("crc", [1 << 32, (1 << 32) + 5, -1])
def test_a_crc_outside_32_bits_is_a_protocol_error(crc: int) -> None:
    frame = encode(kv(1), Codec.FP32, block_size=BLOCK)
    with pytest.raises(ProtocolError):
        decode(Frame({**frame.header, "crc32": crc}, frame.payload), dtype=torch.float32)


def test_int8_keeps_an_exactly_representable_scale_and_round_trips_its_multiples() -> None:
    # Every group's absmax is 127 * 0.5: the scale 0.5 is exact in fp16, so it is stored as is
    # (not bumped a ulp up) and values that are multiples of it come back bit for bit.
    g = torch.Generator().manual_seed(3)
    shape = (LAYERS, HEADS, 2 * BLOCK, DIM)
    k_codes = torch.randint(-126, 127, shape, generator=g, dtype=torch.int8)
    v_codes = torch.randint(-126, 127, shape, generator=g, dtype=torch.int8)
    k_codes[:, :, ::BLOCK] = 127  # each block's first token holds every channel's absmax
    v_codes[..., 0] = -127  # each token's first channel holds its absmax
    chunk = KVChunk(0, k_codes.float() * 0.5, v_codes.float() * 0.5)
    frame = encode(chunk, Codec.INT8, block_size=BLOCK)
    sections = frame.header["sections"]

    def section(name: str) -> bytes:
        offset, length = sections[name]
        return bytes(frame.payload[offset : offset + length])

    half = struct.pack("<e", 0.5)
    assert section("k_scale") == half * (LAYERS * HEADS * 2 * DIM)
    assert section("v_scale") == half * (LAYERS * HEADS * 2 * BLOCK)
    assert section("k") == k_codes.view(LAYERS, HEADS, 2, BLOCK, DIM).numpy().tobytes()
    assert section("v") == v_codes.numpy().tobytes()
    back = decode(frame, dtype=torch.float32)
    assert torch.equal(back.k, chunk.k) and torch.equal(back.v, chunk.v)


def force_crc32_zero(data: bytearray, at: int) -> None:
    """Rewrite ``data[at : at + 4]`` so that ``zlib.crc32(data) == 0``.

    CRC32 is affine over GF(2) in any 32 consecutive bits: solve for them by elimination.
    """

    def crc_with(x: int) -> int:
        data[at : at + 4] = x.to_bytes(4, "little")
        return zlib.crc32(data)

    base = crc_with(0)
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (change of the crc, bits flipped)
    for i in range(32):
        change, bits = crc_with(1 << i) ^ base, 1 << i
        while change:
            top = change.bit_length() - 1
            if top not in basis:
                basis[top] = (change, bits)
                break
            change, bits = change ^ basis[top][0], bits ^ basis[top][1]
    x, rest = 0, base
    while rest:
        change, bits = basis[rest.bit_length() - 1]
        rest, x = rest ^ change, x ^ bits
    assert crc_with(x) == 0


def test_a_payload_whose_crc32_is_zero_is_accepted() -> None:
    chunk = kv(1)
    frame = encode(chunk, Codec.FP32, block_size=BLOCK)
    payload = bytearray(frame.payload)
    force_crc32_zero(payload, len(payload) - 4)  # the last value of V
    assert zlib.crc32(payload) == 0
    back = decode(Frame({**frame.header, "crc32": 0}, payload), dtype=torch.float32)
    assert torch.equal(back.k, chunk.k)
    offset, length = frame.header["sections"]["v"]
    assert back.v.numpy().tobytes() == bytes(payload[offset : offset + length])
    assert torch.equal(back.v.flatten()[:-1], chunk.v.flatten()[:-1])


# ---- hidden states (the layer split) ---------------------------------------------------------


def with_hidden(blocks: int, depths: tuple[int, ...] = (1,), dtype: torch.dtype = torch.bfloat16) -> KVChunk:
    chunk = kv(blocks, dtype)
    g = torch.Generator().manual_seed(7)
    states = {d: torch.randn(blocks * BLOCK, 6, generator=g).to(dtype) * d for d in depths}
    return KVChunk(chunk.first_block, chunk.k, chunk.v, hidden=states)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_states_cross_raw_whatever_the_kv_codec(codec: Codec, dtype: torch.dtype) -> None:
    chunk = with_hidden(3, depths=(1,), dtype=dtype)
    frame = encode(chunk, codec, block_size=BLOCK)
    assert frame.header["hidden"] == {"depths": [1], "width": 6, "dtype": str(dtype).removeprefix("torch.")}
    plain = encode(kv(3, dtype), codec, block_size=BLOCK)
    assert len(frame.payload) == len(plain.payload) + 3 * BLOCK * 6 * dtype.itemsize
    back = decode(frame, dtype=dtype)
    assert sorted(back.hidden) == [1] and torch.equal(back.hidden[1], chunk.hidden[1])
    assert back.hidden[1].dtype == dtype
    assert torch.equal(back.k, decode(plain, dtype=dtype).k)  # the K/V are decoded as without them


def test_several_depths_keep_their_order_and_a_chunk_without_any_has_no_field() -> None:
    k = torch.randn(4, HEADS, 2 * BLOCK, DIM)  # 4 layers: depths 1..3
    states = {3: torch.randn(2 * BLOCK, 6), 1: torch.randn(2 * BLOCK, 6)}
    frame = encode(KVChunk(0, k, -k, hidden=states), Codec.FP32, block_size=BLOCK)
    assert frame.header["hidden"]["depths"] == [1, 3]
    back = decode(frame, dtype=torch.float32)
    assert sorted(back.hidden) == [1, 3] and all(torch.equal(back.hidden[d], states[d]) for d in states)
    assert "hidden" not in encode(kv(2), Codec.FP32, block_size=BLOCK).header
    assert decode(encode(kv(2), Codec.FP32, block_size=BLOCK), dtype=torch.float32).hidden == {}


@pytest.mark.parametrize(
    ("states", "message"),
    [
        ({1: torch.zeros(7, 6)}, "must be"),  # not the chunk's tokens
        ({1: torch.zeros(8, 6, dtype=torch.int32)}, "must be"),
        ({0: torch.zeros(8, 6)}, "layer >= 1"),
        ({1: torch.zeros(8, 6), 2: torch.zeros(8, 5)}, "same shape"),
    ],
)
def test_encode_refuses_hidden_states_that_do_not_fit_the_chunk(states: dict, message: str) -> None:
    chunk = kv(2)
    with pytest.raises(ValueError, match=message):
        encode(KVChunk(0, chunk.k, chunk.v, hidden=states), Codec.FP32, block_size=BLOCK)


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        ({"depths": [1], "width": 6}, "depths, width and dtype"),
        ("all", "depths, width and dtype"),
        ({"depths": [], "width": 6, "dtype": "float32"}, "hidden depths"),
        ({"depths": [0], "width": 6, "dtype": "float32"}, "hidden depths"),
        ({"depths": [LAYERS], "width": 6, "dtype": "float32"}, "hidden depths"),
        ({"depths": [1, 1], "width": 6, "dtype": "float32"}, "hidden depths"),
        ({"depths": [True], "width": 6, "dtype": "float32"}, "hidden depths"),
        ({"depths": [1], "width": 0, "dtype": "float32"}, "hidden width"),
        ({"depths": [1], "width": 6.0, "dtype": "float32"}, "hidden width"),
        ({"depths": [1], "width": 6, "dtype": "int8"}, "hidden width"),
        ({"depths": [1], "width": 7, "dtype": "float32"}, "the frame carries"),  # payload too short for it
        ({"depths": [1], "width": 6, "dtype": "bfloat16"}, "the frame carries"),
    ],
)
def test_a_hidden_field_that_does_not_describe_the_payload_is_a_protocol_error(hidden, message: str) -> None:
    frame = encode(with_hidden(2, dtype=torch.float32), Codec.FP32, block_size=BLOCK)
    header = {**frame.header, "hidden": hidden}
    with pytest.raises(ProtocolError, match=message):
        decode(Frame(header, frame.payload), dtype=torch.float32)


def test_hidden_states_decode_into_the_asked_dtype_and_own_their_memory() -> None:
    chunk = with_hidden(2, dtype=torch.bfloat16)
    frame = encode(chunk, Codec.BF16, block_size=BLOCK)
    payload = bytearray(frame.payload)
    back = decode(Frame(frame.header, payload), dtype=torch.float32)
    assert back.hidden[1].dtype == torch.float32 and torch.equal(back.hidden[1], chunk.hidden[1].float())
    same = decode(Frame(frame.header, payload), dtype=torch.bfloat16)  # no conversion: still a copy
    payload[-1] ^= 0xFF  # the buffer the frame arrived in is reused: the decoded states must not move
    assert torch.equal(back.hidden[1], chunk.hidden[1].float()) and torch.equal(same.hidden[1], chunk.hidden[1])


def test_a_hidden_state_one_value_wide_crosses() -> None:
    chunk = kv(1)
    state = {1: torch.arange(BLOCK, dtype=torch.float32)[:, None]}
    back = decode(encode(KVChunk(0, chunk.k, chunk.v, hidden=state), Codec.FP32, block_size=BLOCK),
                  dtype=torch.float32)
    assert torch.equal(back.hidden[1], state[1])
