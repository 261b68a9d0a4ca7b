"""A replica's state and the router's draining change through their own methods: the
registry's probe and a failed request on a real replica (a StubBackend test double
behind the real router), and the drain a SIGTERM starts."""

from __future__ import annotations

import httpx
import pytest

from tests.support.waiting import wait_for


def test_a_replica_reports_whether_its_readiness_changed(router):
    model = router.state.registry.models["stub"]
    [replica] = model.replicas.values()
    assert replica.ready and replica.info is not None and replica.generator is replica.client
    assert router.call(_set_ready(replica, True)) is False
    assert router.call(_set_ready(replica, False)) is True and not replica.ready
    assert router.call(_set_ready(replica, False)) is False
    assert router.call(_set_ready(replica, True)) is True and replica.ready


async def _set_ready(replica, ready: bool) -> bool:
    return replica.set_ready(ready)


def test_set_info_keeps_the_generator_unless_the_info_names_another(router):
    [replica] = router.state.registry.models["stub"].replicas.values()
    info, generator = replica.info, replica.generator
    replica.set_info(info)
    assert replica.info is info and replica.generator is generator
    other = object()
    replica.set_info(info, other)
    assert replica.generator is other
    replica.set_info(info, generator)


def test_a_failed_request_takes_the_replica_out_until_the_probe_brings_it_back(router):
    registry = router.state.registry
    model = registry.models["stub"]
    [replica] = model.replicas.values()

    async def fail() -> tuple[bool, list]:
        registry.report_failure(replica, "UNAVAILABLE: connection refused")
        return replica.ready, list(model.ready_replicas)  # before the woken probe runs

    assert router.call(fail()) == (False, [])
    assert replica.last_error == "UNAVAILABLE: connection refused"
    assert wait_for(lambda: replica.ready, timeout=10), "the probe did not bring the replica back"
    assert model.ready_replicas == [replica]


def test_draining_starts_once_and_turns_readyz_away(router):
    state = router.state
    assert not state.draining
    assert httpx.get(router.url + "/readyz").status_code == 200
    assert state.start_draining() is True
    assert state.start_draining() is False
    assert state.draining
    r = httpx.get(router.url + "/readyz")
    assert r.status_code == 503 and r.json()["error_type"] == "unhealthy"
    with pytest.raises(AttributeError):
        state.draining = False  # only start_draining changes it
