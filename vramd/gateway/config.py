"""`vramd gateway` configuration: flags, a TOML file with the same keys, and their checks.

    host = "127.0.0.1"              # the one HTTP address
    port = 11434                    # Ollama's port: Ollama-only clients find it without configuration
    api_key_file = "/etc/vramd/gateway.key"   # or api_key = "..." (a file other users cannot read)
    request_timeout = 30            # seconds a client may take to send a request (or to take a reply)
    upstream_timeout = 900          # seconds a daemon may stay silent (waiting for the GPU, prefill)
    cors_origins = ["http://localhost:8080"]   # browser pages that may call it (--cors-origin; "*": any)
    [aliases]                       # extra model names, each routed to a member (its name or file name)
    "gpt-4o-mini" = "chat"
    [member_key_files]              # the API key of a daemon started with one (read at start)
    chat = "/etc/vramd/chat.key"

A member with no key here is sent the client's own `Authorization` header,
so one key shared by the gateway and its daemons needs no per-member entry.
Member keys without a key of the gateway's own would let anyone who reaches
the gateway use them: that is refused unless `allow_open = true`
(`--allow-open`) says it is meant.
Flags override the file (`--alias` and `--member-key-file` add to its tables).
Every problem is a UsageError naming the file or flag and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vramd.errors import UsageError
from vramd.server.config import check_cors_origins, check_http_keys, check_value, read_api_key_file, read_toml

DEFAULT_PORT = 11434
MAX_NAME = 256


@dataclass
class GatewayConfig:
    arena: str | None = None
    allow_shared_arena: bool = False
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    member_key_files: dict[str, str] = field(default_factory=dict)
    member_keys: dict[str, str] = field(default_factory=dict, repr=False)   # read from member_key_files
    allow_open: bool = False   # member keys behind a gateway without a key: meant, not a slip
    cors_origins: list[str] = field(default_factory=list)   # "*" or origins (vramd/server/cors.py)
    request_timeout: float = 30.0
    upstream_timeout: float = 900.0
    max_request_bytes: int = 32 << 20
    log_level: str = "info"
    log_format: str = "text"

    def check(self, where: str) -> "GatewayConfig":
        if not 0 <= self.port <= 65535:
            raise UsageError(f"{where}: port {self.port}: must be 0..65535")
        if not 0 < self.upstream_timeout <= 86400:
            raise UsageError(f"{where}: upstream_timeout {self.upstream_timeout}: seconds, more than 0, "
                             "at most 86400")
        for alias, target in self.aliases.items():
            for what, s in (("alias", alias), ("the model of alias " + repr(alias), target)):
                if not isinstance(s, str) or not s or len(s) > MAX_NAME or not s.isprintable():
                    raise UsageError(f"{where}: {what} {s!r}: 1 to {MAX_NAME} printable characters")
            if target in self.aliases:
                raise UsageError(f"{where}: alias {alias!r} names alias {target!r}: name a member or its file")
        check_http_keys(self, where)   # request limits, logs, the API key: as the daemon's
        check_cors_origins(self.cors_origins, where)
        self.member_keys = {name: read_api_key_file(Path(path)) for name, path in self.member_key_files.items()}
        if self.member_keys and self.api_key is None and not self.allow_open:
            raise UsageError(f"{where}: member keys ({', '.join(sorted(self.member_keys))}) but no API key for the "
                             "gateway: anyone who reaches it would use them; configure --api-key/api_key_file "
                             "for the gateway, or pass --allow-open (allow_open = true) if that is meant")
        return self


_SCALARS = {"arena": "str", "allow_shared_arena": "bool", "host": "str", "port": "int", "api_key": "str",
            "api_key_file": "str", "request_timeout": "float", "upstream_timeout": "float",
            "max_request_bytes": "size", "log_level": "str", "log_format": "str", "allow_open": "bool",
            "cors_origins": "strs"}
_TABLES = ("aliases", "member_key_files")


def load_toml(path: Path) -> dict:
    out: dict = {}
    for key, value in read_toml(path).items():
        name = key.replace("-", "_")
        where = f"{path}: {key}"
        if name in _TABLES:
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise UsageError(f"{where}: expected a table of strings (name = \"...\")")
            out[name] = dict(value)
        elif name in _SCALARS:
            out[name] = check_value(_SCALARS[name], value, where)
        else:
            raise UsageError(f"{path}: unknown key {key!r} (known: {', '.join(sorted([*_SCALARS, *_TABLES]))})")
    return out


def pairs(values: tuple[str, ...], flag: str) -> dict[str, str]:
    """`--alias NAME=MODEL` (or `--member-key-file NAME=PATH`) given several times."""
    out = {}
    for v in values:
        name, sep, target = v.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise UsageError(f"{flag} {v!r}: expected NAME=VALUE")
        out[name.strip()] = target.strip()
    return out


def build(config_file: Path | None, flags: dict) -> GatewayConfig:
    """The file's values, then every flag given; the tables merge (flags win per name)."""
    values = load_toml(config_file) if config_file else {}
    for table in _TABLES:
        values[table] = {**values.get(table, {}), **(flags.pop(table, None) or {})}
    given = {k: v for k, v in flags.items() if v is not None}
    if "api_key" in given or "api_key_file" in given:
        values.pop("api_key", None)
        values.pop("api_key_file", None)
    values.update(given)
    return GatewayConfig(**values).check(str(config_file) if config_file else "flags")
