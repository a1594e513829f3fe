"""The integration stack, started once for the tests/integration package and stopped when the
package is done (so tests/e2e can start stacks of their own on the same 2-core machine)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import GENERATED, Stack, _keys, _write_config, running_stack


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    """The integration stack (tests/integration/stack.yaml), up for the tests/integration package."""
    keys = _keys()
    reuse = os.environ.get("SERVING_REUSE_STACK") == "1"
    config = GENERATED if reuse else _write_config(keys)
    env = {f"ITEST_KEY_{n.upper()}": k for n, k in keys.items()}
    with running_stack(config, env, reuse) as s:
        yield Stack(s.url, s.config, keys)


@pytest.fixture(scope="package")
def base_url(stack: Stack) -> str:
    return stack.url
