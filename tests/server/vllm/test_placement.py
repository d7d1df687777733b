"""Which place serves a request when an agent runs on several (here and on nodes): the
placement policy's decode choice over the places' stores and loads (no vLLM needed)."""

from __future__ import annotations

from server.backend import AgentCard
from server.vllm.backend import Route, _Claim, _Load, choose_place
from server.vllm.store import prefix_blocks

FAMILY = "f" * 64
CARD = AgentCard("coder", "lora", FAMILY, True)
HERE, NODE_A, NODE_B = (Route(name, "coder", CARD) for name in ("lora-0", "node-0/lora-0", "node-1/lora-0"))
BLOCKS = prefix_blocks(list(range(600)), family=FAMILY, salt="", block_size=128)  # 4 full blocks and a tail


def _choose(held: dict[str, int], loads: dict[str, _Load] | None = None, places=(HERE, NODE_A, NODE_B),
            card: AgentCard = CARD):
    """``held``: how many leading blocks each place's store holds."""
    loads = loads or {r.instance: _Load() for r in places}
    keys = {r.instance: {b.key for b in BLOCKS[: held.get(r.instance, 0)]} for r in places}
    places = [Route(r.instance, r.model, card) for r in places]
    route, why = choose_place(places, 700, BLOCKS, family=FAMILY, loads=loads,
                              holds=lambda r, key: key in keys[r.instance])
    return route.instance, why


def test_one_place_is_the_only_candidate() -> None:
    assert _choose({}, places=(NODE_A,)) == ("node-0/lora-0", "only_candidate")


def test_the_place_holding_the_longest_part_of_the_prefix_wins() -> None:
    assert _choose({"lora-0": 1, "node-0/lora-0": 3, "node-1/lora-0": 2}) == ("node-0/lora-0", "longest_prefix")
    # the whole prefix, tail included, beats its full blocks alone
    assert _choose({"node-0/lora-0": 4, "node-1/lora-0": 5})[0] == "node-1/lora-0"


def test_a_gap_ends_what_a_place_holds() -> None:
    """Blocks after a missing one do not count: the load would stop at the gap."""
    keys = {"lora-0": {BLOCKS[0].key, BLOCKS[2].key, BLOCKS[3].key}, "node-0/lora-0": {BLOCKS[0].key, BLOCKS[1].key}}
    route, why = choose_place([HERE, NODE_A], 700, BLOCKS, family=FAMILY,
                              loads={"lora-0": _Load(), "node-0/lora-0": _Load()},
                              holds=lambda r, key: key in keys[r.instance])
    assert (route.instance, why) == ("node-0/lora-0", "longest_prefix")


def test_ties_go_to_the_first_place_listed_here_before_nodes() -> None:
    assert _choose({})[0] == "lora-0"
    assert _choose({"lora-0": 5, "node-0/lora-0": 5})[0] == "lora-0"


def test_a_much_busier_place_loses_its_affinity() -> None:
    busy = {"lora-0": _Load(running=4, pending=40_000), "node-0/lora-0": _Load(), "node-1/lora-0": _Load(pending=100)}
    assert _choose({"lora-0": 5}, busy) == ("node-0/lora-0", "least_loaded")


def test_claims_count_a_request_until_its_prompt_is_computed_then_until_it_ends() -> None:
    load = _Load()
    claim = _Claim(load, 500)
    claim.add(128)  # a private fallback computes the prefix too
    assert (load.running, load.pending) == (1, 628)
    claim.computed()
    claim.computed()  # once only
    assert (load.running, load.pending) == (1, 0)
    claim.release()
    assert (load.running, load.pending) == (0, 0)


def test_a_module_that_shares_no_prefill_still_goes_by_load() -> None:
    private = AgentCard("coder", "lora", None, False)
    busy = {"lora-0": _Load(pending=20_000), "node-0/lora-0": _Load(), "node-1/lora-0": _Load(pending=20_000)}
    assert _choose({}, busy, card=private)[0] == "node-0/lora-0"
