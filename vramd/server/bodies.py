"""A request body as a JSON object: the one parser of the daemon's endpoints and of the gateway's.

Its own module, not openai_api.py's, so that the gateway (a thin router)
imports no engine, numpy or jinja to read a body.  Every problem is a
UsageError (400) that says what is wrong with the body.
"""

from __future__ import annotations

import json

from vramd.errors import UsageError


def json_object(raw: bytes) -> dict:
    """The body's JSON object (an empty body: {})."""
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"request body is not JSON: {e}") from None
    except RecursionError:
        raise UsageError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise UsageError("request body must be a JSON object")
    return body
