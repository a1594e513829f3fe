"""An in-memory stand-in for Ray's GCS key-value store (the ``serving.contract.KV`` protocol),
for unit tests of the endpoint table and the quota actor's checkpoints."""

from __future__ import annotations


class MemoryKV:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def scan(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self.data.items() if k.startswith(prefix)}
