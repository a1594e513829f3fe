"""Admission: who is calling (:mod:`.auth`, API keys stored hashed) and whether they may
(:mod:`.quota`, requests and tokens per window shared by every gateway replica; :mod:`.reserve`,
the tokens a request reserves)."""
