"""What every part of the stack config shares: the strict base model (unknown fields and wrong
types rejected), the name patterns, and error messages that name the file and the field."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "DEFAULT_LORA_RANK",
    "IMAGE_RE",
    "NAME_RE",
    "VERSION_RE",
    "ConfigError",
    "Strict",
    "check_key_hashes",
    "check_model_name",
    "read_yaml",
    "validation_message",
]

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


def check_model_name(v: str, what: str = "name") -> str:
    """Model, alias, tenant and stack names: they become Serve app names, metric labels, K8s-safe
    ids and parts of file paths."""
    if not NAME_RE.match(v):
        raise ValueError(f"{what} must be 1-40 chars of lower-case letters, digits and '-'")
    return v


# registry/repository, then :tag and/or @sha256:digest (at least one)
IMAGE_RE = re.compile(
    r"^(?P<repo>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
VERSION_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,30}$")
# The rank the training job gives an adapter without --lora-rank (training.lora.LoraOptions.rank:
# serving imports nothing of training; a unit test holds the two equal)
DEFAULT_LORA_RANK = 8


class ConfigError(ValueError):
    """A stack config file is missing, not YAML, or fails validation (message names file and field)."""


class Strict(BaseModel):
    # validate_default: a float field's default 600 becomes 600.0 like a parsed "600" does, so a
    # config and its re-validated copy (promotions) give byte-identical Serve configs; otherwise
    # Serve sees changed app args and restarts the gateway instead of reconfiguring it in place
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _where(loc: tuple[int | str, ...], data: object) -> str:
    """Turn a pydantic location into ``models[adder].engine.dtype`` using model names."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int) and isinstance(node, list):
            entry = node[item] if item < len(node) else None
            label = entry.get("name") or entry.get("version") if isinstance(entry, dict) else None
            parts[-1] += f"[{label or item}]"
            node = entry
        else:
            parts.append(str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return ".".join(parts) or "(top level)"


def validation_message(source: str, what: str, exc: ValidationError, data: object) -> str:
    """One line per failing field, each located as ``models[adder].engine.dtype`` (list items by
    their ``name``/``version`` where they have one); shared by every YAML file the project reads."""
    lines = [f"{source}: invalid {what}:"]
    lines += [f"  {_where(err['loc'], data)}: {err['msg']}" for err in exc.errors()]
    return "\n".join(lines)


def read_yaml(path: Path, error: type[Exception], missing: str) -> object:
    """The parsed YAML of ``path``; a missing, unreadable or non-UTF-8 file or bad YAML raise
    ``error`` naming the file."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a YAML file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}): not a YAML file") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None


# what `serving keys new` and `serving keys hash` print: sha256$<hex salt>$<hex digest of salt + key>
KEY_HASH_RE = re.compile(r"^sha256\$[0-9a-f]{8,}\$[0-9a-f]{64}$")
KEY_HASH_FORM = "sha256$<salt: 8 or more lower-case hex digits>$<64 lower-case hex digits>"


def check_key_hashes(v: list[str]) -> list[str]:
    """API key hashes as `serving keys new` and `serving keys hash` print them."""
    for i, h in enumerate(v):
        if not KEY_HASH_RE.match(h):
            # the entry itself is not repeated: it may be a key pasted by mistake
            raise ValueError(
                f"entry {i} is no key hash: key hashes look like {KEY_HASH_FORM}; make one with "
                "`serving keys hash --from-env VAR` (an existing key) or `serving keys new`"
            )
    return v
