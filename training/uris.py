"""URIs as the training job records and prints them: without what may be a credential.

A data or base URI can carry a secret: ``https://user:password@host/...``, a presigned S3 URL
(``?X-Amz-Credential=...&X-Amz-Signature=...``), an Azure SAS (``?sig=...``). The manifest, the
run's ``job.json`` and every error message get :func:`redact_uri`'s form instead, which drops the
``user:password@`` of each URI and replaces its query string with ``?<redacted>``; the recorded
sha256 still identifies the data. Local paths (no ``scheme://``) are left as they are.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["REDACTED", "redact_uri"]

REDACTED: Final = "<redacted>"
# scheme://, then an authority up to the first / ? or #, then the rest up to whitespace or a quote
_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#\s'\"]*)(?P<rest>[^\s'\"]*)")


def _redact(match: re.Match[str]) -> str:
    host = match["authority"].rpartition("@")[2]
    path, hash_, fragment = match["rest"].partition("#")
    path, question, _ = path.partition("?")
    return f"{match['scheme']}{host}{path}{question and '?' + REDACTED}{hash_}{fragment}"


def redact_uri(text: str) -> str:
    """``text`` with every ``scheme://`` URI in it stripped of its user info and query string.

    Works on a bare URI, an fsspec chain (``simplecache::https://...``) and free text such as an
    exception's message, which may quote the URL it failed on.
    """
    return _URI.sub(_redact, text)
