"""Passwords never reach a log line, stdout or an error message: one masking rule for all."""

from __future__ import annotations

import re

_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)\S+@")
# Greedy to the last `@` of the word: a password holding an unencoded `@` is masked whole.


def mask_secrets(text: str) -> str:
    """`mqtts://agg:s3cret@host` -> `mqtts://agg:***@host`."""
    return _CREDENTIALS.sub(r"\1***@", text)
