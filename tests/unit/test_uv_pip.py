"""scripts/uv_pip.py: the package sources pip is set up with reach uv unchanged."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "uv_pip.py"

# `pip config list` on a machine with a wheel folder in the environment and a pip.conf
LISTED = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
user.index-url='https://USER:TOKEN@mirror.example/simple'
"""


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("uv_pip", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_sources_become_a_uv_config_with_pips_best_match_across_indexes() -> None:
    uv_pip = _script()
    sources = uv_pip.pip_sources(LISTED)
    assert sources == {
        "find-links": ["/opt/wheels"],  # listed twice, given once
        "constraint": ["/etc/xdg/pip/constraints.txt"],
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],
        "index-url": ["https://USER:TOKEN@mirror.example/simple"],
    }
    pip = tomllib.loads(uv_pip.uv_config(sources))["pip"]
    assert pip == {
        "index-strategy": "unsafe-best-match",
        "index-url": "https://USER:TOKEN@mirror.example/simple",
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],
        "find-links": ["/opt/wheels"],
    }


def test_no_pip_configuration_leaves_uv_on_its_defaults() -> None:
    uv_pip = _script()
    assert uv_pip.pip_sources("") == {}
    assert tomllib.loads(uv_pip.uv_config({})) == {"pip": {"index-strategy": "unsafe-best-match"}}
