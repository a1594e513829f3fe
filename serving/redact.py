"""Credentials out of URIs: a URI of a base, a dataset or an imported model can carry one
(``user:password@`` in its authority, or a query string: an S3 presigned URL's
``X-Amz-Signature``, an Azure SAS's ``sig``). Manifests, logs and error messages hold
:func:`redact_uri`'s form of it instead.
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
    """``text`` with every ``scheme://`` URI in it stripped of its user info, and its query string
    replaced by ``?<redacted>``. Works on a bare URI, an fsspec chain
    (``simplecache::https://...``) and free text such as an exception's message, which may quote
    the URL it failed on; a local path (no ``scheme://``) is left as it is."""
    return _URI.sub(_redact, text)
