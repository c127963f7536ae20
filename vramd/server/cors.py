"""CORS: which browser pages may read the API's replies (--cors-origin), and the headers that say so.

Owns `cors_headers()`, the headers vramd/server/http.py adds to every reply
(its end_headers) for a request whose `Origin` is allowed: the origin itself
(with `Vary: Origin`), or `*` when `--cors-origin '*'` was given; and for a
preflight (OPTIONS with Access-Control-Request-Method) what may be sent.
Without --cors-origin nothing is added, so a page on another origin cannot
read any reply (the browser withholds it).  CORS is no access control: the
API key still guards every route but /health.
"""

from __future__ import annotations

METHODS = "GET, HEAD, POST, OPTIONS"
EXPOSED = "Retry-After, X-Vramd-Context-Dropped"   # what a page's script may read besides the simple ones
MAX_AGE = "600"                                    # seconds a browser may keep a preflight's answer


def cors_headers(origins: frozenset, headers, command: str) -> dict:
    """The CORS headers for a request with these headers (an email.message-like mapping)."""
    origin = headers.get("Origin")
    if not origin:
        return {}
    if "*" in origins:
        allow = "*"
    elif origin in origins:
        allow = origin
    else:
        return {}
    out = {"Access-Control-Allow-Origin": allow, "Access-Control-Expose-Headers": EXPOSED}
    if allow != "*":
        out["Vary"] = "Origin"
    if command == "OPTIONS" and headers.get("Access-Control-Request-Method"):
        out["Access-Control-Allow-Methods"] = METHODS
        # What the page asks to send (Authorization, Content-Type, the SDKs' X-Stainless-*): a
        # bearer key is no cookie, so echoing the list opens nothing the key does not guard.
        out["Access-Control-Allow-Headers"] = headers.get("Access-Control-Request-Headers") or \
            "Authorization, Content-Type"
        out["Access-Control-Max-Age"] = MAX_AGE
    return out
