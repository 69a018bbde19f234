"""schemathesis hooks for tests/test_openapi_checks.py (loaded through SCHEMATHESIS_HOOKS):
generated bodies ask for at most a few tokens, so the run takes seconds, not minutes."""

from typing import Any

import schemathesis

MOST_TOKENS = 4
MOST_SAMPLES = 2
CLAMPED = {"max_tokens": MOST_TOKENS, "min_tokens": MOST_TOKENS, "n": MOST_SAMPLES}


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    """Lowers a valid count (a positive integer) only, so a body that breaks the schema still
    breaks it and one that fits still fits."""
    if isinstance(body, dict):
        for field, most in CLAMPED.items():
            value = body.get(field)
            if type(value) is int and value > most:
                body[field] = most
    return body
