"""Which Ray the training job uses: it never starts one without token authentication and
loopback-only addresses, which Ray reads when it is first imported."""

from __future__ import annotations

from typing import Any

import pytest

from training.ray_runtime import PrivateRayRefused, init_ray


def test_no_private_ray_in_a_process_that_imported_ray_already(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray  # imported before the job could set up its environment

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(PrivateRayRefused, match="pass ray_address .* python -m training.train"):
        init_ray(1, None)
    assert started == []


def test_a_given_address_or_an_initialised_ray_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert init_ray(1, None) is None and started == []  # the caller's Ray, left running
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert init_ray(1, "10.0.0.5:6379") is ray.shutdown
    assert started == [{"address": "10.0.0.5:6379", "log_to_driver": True}]
