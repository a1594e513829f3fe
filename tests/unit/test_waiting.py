"""The one polling loop: returns the check's value, times out with the reason, lets errors through."""

from __future__ import annotations

import pytest

from serving.waiting import poll, wait_until


def test_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, "", "done"])
    assert wait_until(lambda: next(values), 5, 0.001, "never") == "done"


def test_times_out_with_the_reason() -> None:
    calls: list[int] = []

    def never() -> bool:
        calls.append(1)
        return False

    with pytest.raises(TimeoutError, match=r"the head did not come up after 0s"):
        wait_until(never, 0.05, 0.01, "the head did not come up")
    assert len(calls) >= 2  # checked more than once, and once more at the deadline
    assert poll(never, 0.01, 0.01) is False


def test_an_error_in_the_check_ends_the_wait() -> None:
    def broken() -> bool:
        raise RuntimeError("vLLM exited with code 1 during start")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(broken, 5, 0.01, "never")
