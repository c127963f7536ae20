"""`vramd gateway`: one HTTP endpoint in front of every daemon of an arena.

A thin router: it reads the arena's member records (who serves which model,
at which endpoint, in which state), forwards each OpenAI request to the
daemon its `model` names and streams the reply back as it comes, and speaks
a subset of Ollama's API mapped onto the daemons.  It holds no GPU memory,
is not a participant (never takes the token, never rings: a daemon wakes
itself when a request reaches it; Ollama's keep_alive 0 and load requests
are asked of the member over its control socket) and keeps no state a
restart would lose.

    config.py   flags and the TOML file, checked
    table.py    the routing table: members, aliases, states, dead members
    proxy.py    one request forwarded to a member, its reply streamed through
    pool.py     kept-alive connections to the members, reused only when known good
    server.py   the routes (OpenAI's /v1/*, /health), the HTTP server, the process
    ollama.py   Ollama's /api/* request and option mapping onto OpenAI bodies
    ollama_routes.py  the /api/* routes and their replies
    ollama_stream.py  a daemon's SSE stream as Ollama's NDJSON stream
    residency.py  Ollama's keep_alive and load/unload requests, over members' control sockets
"""
