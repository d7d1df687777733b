"""The placement registry: a policy defined here, registered by name, is what place(), the
simulator and the router's config use; unknown names fail saying which names exist."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server.policy import (
    ChoiceReason,
    ClusterSnapshot,
    OffloadPolicy,
    PrefillDecision,
    PrefillReason,
    RequestSnapshot,
    Role,
    RouteDecision,
    UnknownPolicy,
    Where,
    WorkerChoice,
    WorkerSnapshot,
    decide_route,
    place,
    placement,
)

CALLS: list[tuple[RequestSnapshot, OffloadPolicy]] = []


def last_worker(request: RequestSnapshot, cluster: ClusterSnapshot, policy: OffloadPolicy) -> RouteDecision:
    """A toy policy: the highest-id decode worker, always a local prefill."""
    CALLS.append((request, policy))
    worker = max(cluster.decode, key=lambda w: w.id)
    return RouteDecision(
        WorkerChoice(worker, ChoiceReason.LOWEST_ID),
        PrefillDecision(Where.LOCAL, PrefillReason.BELOW_THRESHOLD, worker.incremental(request.prompt_tokens)),
    )


@pytest.fixture
def toy() -> Iterator[str]:
    CALLS.clear()
    placement.register("last-worker", last_worker)
    try:
        yield "last-worker"
    finally:
        placement.unregister("last-worker")


def cluster(n: int = 3) -> ClusterSnapshot:
    return ClusterSnapshot("fam", 100, decode=[WorkerSnapshot(i, Role.DECODE, "fam") for i in range(n)])


def test_the_default_policy_is_offloads_decide_route() -> None:
    assert placement.names() == ("offload",) and placement.DEFAULT == "offload"
    assert placement.get("offload") is decide_route
    req, c, knobs = RequestSnapshot(1, "coder", "fam", 5000), cluster(), OffloadPolicy(threshold_tokens=10)
    assert place(req, c, knobs) == place(req, c, knobs, name="offload") == decide_route(req, c, knobs)


def test_a_registered_policy_is_chosen_by_name_and_its_decision_returned(toy: str) -> None:
    req, knobs = RequestSnapshot(7, "coder", "fam", 300), OffloadPolicy(threshold_tokens=1)
    decision = place(req, cluster(), knobs, name=toy)
    assert decision.decode.worker_id == 2 and decision.prefill.where is Where.LOCAL
    assert CALLS == [(req, knobs)]  # it got the request and the caller's knobs
    assert place(req, cluster()).decode.worker_id == 0  # the default is unchanged
    assert placement.names() == ("offload", "last-worker")


def test_the_simulator_runs_the_policy_its_config_names(toy: str) -> None:
    from server.sim import ClusterConfig, SimRequest, Simulator

    requests = [SimRequest(i, i * 0.01, input_tokens=64, output_tokens=1, blocks=(i,)) for i in range(3)]
    default = Simulator(ClusterConfig(decode_workers=3, block_tokens=64)).run(requests)
    chosen = Simulator(ClusterConfig(decode_workers=3, block_tokens=64, placement_policy=toy)).run(requests)
    assert len(CALLS) == 3
    assert {r.decode_worker for r in chosen.records} == {2}
    assert {r.decode_worker for r in default.records} != {2}


def test_router_config_takes_a_registered_name(toy: str) -> None:
    from server.cluster.router import RouterConfig

    assert RouterConfig(placement_policy=toy).placement_policy == "last-worker"
    assert RouterConfig().placement_policy == "offload"


def test_unknown_policy_names_fail_listing_the_registered_ones() -> None:
    message = (r"unknown placement policy 'round-robin'; registered policies: offload "
               r"\(add one with server.policy.placement.register\)")
    req = RequestSnapshot(1, "coder", "fam", 300)
    with pytest.raises(UnknownPolicy, match=message):
        place(req, cluster(), name="round-robin")
    with pytest.raises(ValueError, match=message):  # UnknownPolicy is a ValueError
        placement.get("round-robin")

    from server.cluster.router import RouterConfig
    from server.sim import ClusterConfig, Simulator

    with pytest.raises(UnknownPolicy, match=message):
        RouterConfig(placement_policy="round-robin")
    with pytest.raises(UnknownPolicy, match=message):
        Simulator(ClusterConfig(placement_policy="round-robin"))


def test_the_cli_refuses_an_unknown_policy_listing_the_registered_ones() -> None:
    from typer.testing import CliRunner

    from server.cli import app

    result = CliRunner().invoke(app, ["router", "--worker", "http://127.0.0.1:1", "--placement-policy", "rr"])
    assert result.exit_code == 2
    assert "unknown placement policy 'rr'" in result.output and "offload" in result.output


def test_registering_checks_the_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        placement.register("offload", last_worker)
    with pytest.raises(ValueError, match="lowercase letters, digits"):
        placement.register("Last Worker", last_worker)
    assert placement.names() == ("offload",)
