"""URIs as the training job records and prints them: without what may be a credential.

A data or base URI can carry a secret: ``https://user:password@host/...``, a presigned S3 URL
(``?X-Amz-Credential=...&X-Amz-Signature=...``), an Azure SAS (``?sig=...``). The manifest, the
run's ``job.json`` and every error message get :func:`redact_uri`'s form instead, which drops the
``user:password@`` of each URI and replaces its query string with ``?<redacted>``; the recorded
sha256 still identifies the data. Local paths (no ``scheme://``) are left as they are. The helper
is the checkpoint store's (:func:`serving.registry.redact_uri`), which ``serving import`` uses too.
"""

from __future__ import annotations

from serving.registry import REDACTED, redact_uri

__all__ = ["REDACTED", "redact_uri"]
