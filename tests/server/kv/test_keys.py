import hashlib
import os
import struct
import subprocess
import sys

import pytest

from server.kv.keys import ROOT_KEY, Layout, Namespace, NamespaceKind, chain_key

FAM = "a" * 64
MOD = "b" * 64
TOKENS = list(range(100, 164))


def keys(layout: Layout, tokens=TOKENS, block_size=16):
    return layout.block_keys(tokens, block_size=block_size)


def test_keys_are_stable_across_processes():
    # Python's hash() is salted per process; the digest must not be.
    code = (
        "from server.kv.keys import Layout, Namespace;"
        f"print(Layout(Namespace.family('{FAM}')).block_keys(list(range(100,164)), block_size=16)[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {keys(Layout(Namespace.family(FAM)))[-1].hex()}


def test_chain_keys_differ_across_namespaces_and_salts():
    variants = {
        "family": Layout(Namespace.family(FAM)),
        "other family": Layout(Namespace.family("c" * 64)),
        "other salt": Layout(Namespace.family(FAM, salt="tenant-2")),
        "lossy": Layout(Namespace.family(FAM).lossy("int8")),
    }
    first_keys = {name: keys(lay)[0] for name, lay in variants.items()}
    assert len(set(first_keys.values())) == len(variants), first_keys


def test_module_namespace_separates_modules_and_invocation_points():
    fam = Namespace.family(FAM)
    a = keys(Layout(fam, Namespace.module(MOD, invocation_point=40)))
    b = keys(Layout(fam, Namespace.module("d" * 64, invocation_point=40)))
    c = keys(Layout(fam, Namespace.module(MOD, invocation_point=36)))
    base = keys(Layout(fam))
    # blocks 0 and 1 end at or before the IP (32 <= 40): family-computed, shared by all
    assert a[:2] == b[:2] == c[:2] == base[:2]
    # block 2 holds positions 32..47, which straddle the IP: the module's
    assert len({a[2], b[2], c[2], base[2]}) == 4


@pytest.mark.parametrize("ip, family_blocks", [(0, 0), (15, 0), (16, 1), (17, 1), (31, 1), (32, 2), (64, 4)])
def test_invocation_point_block_boundary(ip, family_blocks):
    lay = Layout(Namespace.family(FAM), Namespace.module(MOD, invocation_point=ip))
    kinds = [lay.namespace_of(i, block_size=16).kind for i in range(4)]
    assert kinds.count(NamespaceKind.FAMILY) == family_blocks
    assert kinds[:family_blocks] == [NamespaceKind.FAMILY] * family_blocks


def test_chaining_makes_a_block_key_depend_on_everything_before_it():
    lay = Layout(Namespace.family(FAM))
    changed = TOKENS.copy()
    changed[3] += 1
    assert all(x != y for x, y in zip(keys(lay), keys(lay, changed), strict=True))
    assert keys(lay)[0] == chain_key(ROOT_KEY, Namespace.family(FAM), TOKENS[:16])


def test_only_full_blocks_have_keys():
    assert len(keys(Layout(Namespace.family(FAM)), TOKENS[:47])) == 2


def test_field_boundaries_cannot_alias():
    # ("ab", "c") and ("a", "bc") must not encode alike
    assert Namespace.family("ab", salt="c").digest != Namespace.family("a", salt="bc").digest


@pytest.mark.parametrize(
    "make",
    [
        lambda: Namespace.family(""),
        lambda: Namespace(NamespaceKind.MODULE, MOD),
        lambda: Namespace.module(MOD, invocation_point=-1),
        lambda: Namespace(NamespaceKind.FAMILY, FAM, invocation_point=3),
        lambda: Namespace.family(FAM).lossy(""),
        lambda: Layout(Namespace.module(MOD, invocation_point=1)),
        lambda: Layout(Namespace.family(FAM), Namespace.family(FAM)),
        lambda: Layout(Namespace.family(FAM, salt="x"), Namespace.module(MOD, invocation_point=1)),
    ],
)
def test_bad_namespaces_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_the_key_encoding_is_the_documented_one():
    # Keys outlive a process (the disk tier, other members of a cluster), so their bytes are
    # the contract: re-derived here from the module docstring, independently of the code.
    def ns_digest(*fields: bytes) -> bytes:
        parts = (b"agentshare/namespace/v1", *fields)
        return hashlib.sha256(b"".join(struct.pack("<I", len(f)) + f for f in parts)).digest()

    fam = Namespace.family(FAM, salt="t")
    assert fam.digest == ns_digest(b"family", FAM.encode(), b"t", b"", b"")
    mod = Namespace.module(MOD, invocation_point=40, salt="t")
    assert mod.digest == ns_digest(b"module", MOD.encode(), b"t", b"40", b"")
    assert mod.lossy("int8").digest == ns_digest(b"module", MOD.encode(), b"t", b"40", b"int8")
    block = TOKENS[:16]
    want = hashlib.sha256(b"agentshare/block/v1" + ROOT_KEY + fam.digest + struct.pack("<16I", *block)).digest()
    assert chain_key(ROOT_KEY, fam, block) == want
    assert Layout(fam).block_keys(block, block_size=16) == [want]


def test_lossy_keeps_every_field_of_its_namespace_and_adds_the_codec():
    mod = Namespace.module(MOD, invocation_point=40, salt="t")
    lossy = mod.lossy("int8")
    assert (lossy.kind, lossy.owner, lossy.salt, lossy.invocation_point, lossy.codec) == (
        NamespaceKind.MODULE, MOD, "t", 40, "int8")
    assert mod.is_exact and not lossy.is_exact


def test_a_split_namespace_is_its_own_and_does_not_depend_on_the_ip():
    fam = Namespace.family("f" * 64, salt="t")
    split = Namespace.split("m" * 64, recompute_layers=8, salt="t")
    assert split.digest not in {fam.digest, Namespace.module("m" * 64, invocation_point=0, salt="t").digest,
                                Namespace.split("m" * 64, recompute_layers=9, salt="t").digest,
                                Namespace.split("m" * 64, recompute_layers=8, salt="u").digest}
    tokens = list(range(64))
    keys = {ip: Layout(fam, Namespace.module("m" * 64, invocation_point=ip, salt="t"), split).block_keys(
        tokens, block_size=16) for ip in (40, 56)}
    assert keys[40][:2] == keys[56][:2]  # blocks before either IP: the same split blocks at any later turn
    assert keys[40][2] != keys[56][2]
    with pytest.raises(ValueError, match="recomputes at least one layer"):
        Namespace.split("m" * 64, recompute_layers=0)
    with pytest.raises(ValueError, match="split namespace of the module's tenant"):
        Layout(fam, Namespace.module("m" * 64, invocation_point=40, salt="t"),
               Namespace.split("m" * 64, recompute_layers=8, salt="u"))


def test_split_namespaces_default_to_the_default_tenant_and_need_a_module_side():
    assert Namespace.split("m" * 64, recompute_layers=1) == Namespace(NamespaceKind.SPLIT, "m" * 64 + "/recompute-1", "")
    fam = Namespace.family("f" * 64)
    split = Namespace.split("m" * 64, recompute_layers=1)
    with pytest.raises(ValueError, match="split namespace of the module's tenant"):
        Layout(fam, None, split)  # a prefix namespace without a module side
    with pytest.raises(ValueError, match="split namespace of the module's tenant"):
        Layout(fam, Namespace.module("m" * 64, invocation_point=4), Namespace.module("m" * 64, invocation_point=4))
