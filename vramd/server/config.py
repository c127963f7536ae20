"""`vramd serve` configuration: flags, a TOML file with the same keys, and their checks.

A systemd instance passes `--config /etc/vramd/<instance>.toml`; flags given
on the command line override the file.  Unknown keys and bad values are a
UsageError naming the file and the key, never a traceback.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from vramd.errors import UsageError

EVICT_STATE = ("auto", "always", "never")
NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"      # a member's name, and each alias
MAX_ALIASES = 16
ORIGIN = r"[a-z][a-z0-9+.-]*://[^/\s?#*]+(:\d{1,5})?"   # what a browser sends in Origin
RESIDENCY = ("cache", "exclusive")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


@dataclass
class ServeConfig:
    model: str | None = None
    name: str | None = None
    arena: str | None = None
    allow_shared_arena: bool = False
    device: str | None = None
    ctx: int | None = None         # None: the file's context length, capped by what fits (footprint.auto_ctx)
    context_overflow: str = "error"   # a prompt or generation longer than ctx (vramd/engine/overflow.py)
    evict_state: str = "auto"
    pooling: str | None = None        # embeddings: none, mean, cls, last (None: the file's; vramd/engine/embed.py)
    reasoning_format: str = "auto"    # <think> blocks as reasoning_content (vramd/server/reasoning.py)
    idle_sleep: float = -1.0
    vram_budget: int | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    quantum: float = 0.25
    max_hold: float = 5.0
    residency: str = "cache"
    wake_timeout: float = 60.0
    parallel: int | None = None    # generation slots (vramd/server/slots.py); None: auto, up to 4 whose KV fits
    cache_ram: int = 256           # MiB of host memory for the prompt cache (vramd/server/hostcache.py); 0: none
    max_queue: int = 64            # generation requests that may wait for a slot; beyond: 503 + Retry-After
    n_cpu_moe: str | None = None   # "auto" or a number >= 0 (see vramd/model/placement.py)
    prefill_chunk: int | None = None   # tokens per prefill chunk (None: the architecture's; vramd/engine/scratch.py)
    mmproj: str | None = None      # a vision encoder (projector) GGUF
    mmproj_resident: bool = False  # keep it on the device instead of bringing it in per image
    pin: bool = False
    priority: int = 0
    # HTTP: a key every route but /health requires (`Authorization: Bearer KEY`),
    # given as is (--api-key, VRAMD_API_KEY, `api_key`) or read from a file.
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    max_request_bytes: int = 32 << 20      # request bodies (images travel as base64)
    request_timeout: float = 30.0          # seconds to send a whole request, or to take a reply
    # The log (vramd/server/logs.py) and /metrics without the API key (scrapers).
    log_level: str = "info"
    log_format: str = "text"
    metrics_public: bool = False
    # The API's surface (vramd/server/http.py, openai_api.py): more names for the model, CORS.
    aliases: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)   # "*" or origins (scheme://host[:port])

    def check(self, where: str = "flags") -> "ServeConfig":
        if not self.model:
            raise UsageError("no model: give MODEL.gguf or `model = \"...\"` in --config")
        if self.name is not None and not re.fullmatch(NAME, self.name):
            raise UsageError(f"{where}: name {self.name!r}: use letters, digits, '_', '.', '-' (at most 64)")
        for alias in self.aliases:
            if not re.fullmatch(NAME, alias):
                raise UsageError(f"{where}: alias {alias!r}: use letters, digits, '_', '.', '-' (at most 64)")
        if len(self.aliases) > MAX_ALIASES:
            raise UsageError(f"{where}: {len(self.aliases)} aliases: at most {MAX_ALIASES}")
        check_cors_origins(self.cors_origins, where)
        if self.ctx is not None and (self.ctx < 1 or self.ctx > 1 << 20):
            raise UsageError(f"{where}: ctx {self.ctx}: must be between 1 and {1 << 20}")
        from vramd.engine.overflow import POLICIES
        if self.context_overflow not in POLICIES:
            raise UsageError(f"{where}: context_overflow {self.context_overflow!r}: one of {', '.join(POLICIES)}")
        from vramd.server.reasoning import FORMATS as REASONING
        if self.reasoning_format not in REASONING:
            raise UsageError(f"{where}: reasoning_format {self.reasoning_format!r}: one of {', '.join(REASONING)}")
        from vramd.engine.embed import CHOICES as POOLING
        if self.pooling is not None and self.pooling not in POOLING:
            raise UsageError(f"{where}: pooling {self.pooling!r}: one of {', '.join(POOLING)}")
        if self.evict_state not in EVICT_STATE:
            raise UsageError(f"{where}: evict_state {self.evict_state!r}: one of {', '.join(EVICT_STATE)}")
        if not 0 < self.wake_timeout <= 86400:
            raise UsageError(f"{where}: wake_timeout {self.wake_timeout}: seconds, more than 0, at most 86400")
        if self.n_cpu_moe is not None:
            from vramd.model.placement import parse_n_cpu_moe
            parse_n_cpu_moe(self.n_cpu_moe)
        if self.prefill_chunk is not None:
            from vramd.engine.scratch import MAX_CHUNK
            if not 1 <= self.prefill_chunk <= MAX_CHUNK:
                raise UsageError(f"{where}: prefill_chunk {self.prefill_chunk}: tokens, between 1 and {MAX_CHUNK}")
        if self.residency not in RESIDENCY:
            raise UsageError(f"{where}: residency {self.residency!r}: one of {', '.join(RESIDENCY)}")
        if not -1000 <= self.priority <= 1000:
            raise UsageError(f"{where}: priority {self.priority}: must be between -1000 and 1000")
        if self.vram_budget is not None and self.vram_budget <= 0:
            raise UsageError(f"{where}: vram_budget must be positive")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"{where}: port {self.port}: must be 0..65535")
        from vramd.server.slots import check_parallel
        check_parallel(self.parallel, where)
        if not 0 <= self.cache_ram <= 1 << 24:
            raise UsageError(f"{where}: cache_ram {self.cache_ram}: MiB, between 0 and {1 << 24}")
        if not 0 <= self.max_queue <= 1 << 20:
            raise UsageError(f"{where}: max_queue {self.max_queue}: between 0 and {1 << 20}")
        if self.quantum < 0 or self.max_hold < self.quantum:
            raise UsageError(f"{where}: need 0 <= quantum <= max_hold")
        check_http_keys(self, where)
        return self


def check_cors_origins(origins: list[str], where: str) -> None:
    """--cors-origin's values (the daemon's and the gateway's): what a browser sends in Origin, or *."""
    for origin in origins:
        if origin != "*" and not re.fullmatch(ORIGIN, origin):
            raise UsageError(f"{where}: cors origin {origin!r}: give scheme://host[:port] "
                             "(no path, no trailing slash), or * for any origin")


def check_http_keys(cfg, where: str) -> None:
    """The keys of an HTTP server that `vramd serve` and `vramd gateway` share: request limits, logs,
    the API key (read from api_key_file into api_key)."""
    if not 1024 <= cfg.max_request_bytes <= 1 << 30:
        raise UsageError(f"{where}: max_request_bytes {cfg.max_request_bytes}: between 1KiB and 1GiB")
    if not 0 < cfg.request_timeout <= 3600:
        raise UsageError(f"{where}: request_timeout {cfg.request_timeout}: seconds, more than 0, at most 3600")
    from vramd.server.logs import FORMATS, LEVELS
    if cfg.log_level not in LEVELS:
        raise UsageError(f"{where}: log_level {cfg.log_level!r}: one of {', '.join(LEVELS)}")
    if cfg.log_format not in FORMATS:
        raise UsageError(f"{where}: log_format {cfg.log_format!r}: one of {', '.join(FORMATS)}")
    if cfg.api_key is not None and cfg.api_key_file is not None:
        raise UsageError(f"{where}: give an API key or an API key file, not both")
    if cfg.api_key_file is not None:
        cfg.api_key = read_api_key_file(Path(cfg.api_key_file))
    if cfg.api_key is not None:
        check_api_key(cfg.api_key, f"{where}: api_key")


MAX_API_KEY = 1024


def check_api_key(key: str, what: str) -> None:
    """Printable ASCII, no spaces: what fits an `Authorization: Bearer` header as is."""
    if not key:
        raise UsageError(f"{what}: the API key is empty")
    if len(key) > MAX_API_KEY or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise UsageError(f"{what}: the API key must be 1 to {MAX_API_KEY} printable ASCII characters, no spaces")


def read_api_key_file(path: Path) -> str:
    """The key in `path` (surrounding whitespace dropped): a small regular file other users cannot read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"{path}: cannot open the API key file: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: the API key file is not a regular file")
        if st.st_mode & 0o007:
            raise UsageError(f"{path}: the API key file is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                             "chmod o-rwx it")
        if st.st_size > MAX_API_KEY + 64:
            raise UsageError(f"{path}: the API key file is {st.st_size} bytes; a key is at most {MAX_API_KEY}")
        data = os.read(fd, MAX_API_KEY + 65)
    finally:
        os.close(fd)
    try:
        key = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: the API key must be printable ASCII") from None
    check_api_key(key, str(path))
    return key


def parse_size(value, what: str) -> int:
    """`12GiB`, `500M`, `1073741824` -> bytes."""
    if isinstance(value, bool):
        raise UsageError(f"{what}: {value!r} is not a size")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise UsageError(f"{what}: {value!r} is not a size (examples: 8GiB, 500MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_TYPES = {f.name: f.type for f in fields(ServeConfig)}


def read_toml(path: Path) -> dict:
    """A config file's top-level table (the gateway's file too: vramd/gateway/config.py); a key in it
    only as secret as the file, so a file with `api_key` that other users can read is refused."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror}") from None
    if "api_key" in raw or "api-key" in raw:
        mode = os.stat(path).st_mode
        if mode & 0o007:
            raise UsageError(f"{path}: holds api_key but other users can read it (mode {stat.S_IMODE(mode):04o}); "
                             "chmod o-rwx it, or use api_key_file")
    return raw


def load_toml(path: Path) -> dict:
    """Read a config file; keys use the flag names with `_` or `-`."""
    out = {}
    for key, value in read_toml(path).items():
        name = key.replace("-", "_")
        if name not in _TYPES:
            raise UsageError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(_TYPES))})")
        out[name] = coerce(name, value, f"{path}: {key}")
    return out


def coerce(name: str, value, what: str):
    if name == "n_cpu_moe":
        from vramd.model.placement import parse_n_cpu_moe
        return str(parse_n_cpu_moe(value if isinstance(value, str) else float(value)))
    kind = _TYPES[name]
    return check_value("size" if name in ("vram_budget", "max_request_bytes") else "bool" if "bool" in kind
                       else "int" if kind.startswith("int") else "float" if kind.startswith("float")
                       else "strs" if kind.startswith("list") else "str", value, what)


def check_value(kind: str, value, what: str):
    """A config file's value as `kind` wants it ("size", "bool", "int", "float", "str", or "strs":
    a list of strings, one string taken as a list of one), or a UsageError naming `what`."""
    if kind == "size":
        return parse_size(value, what)
    if kind == "strs":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{what}: expected a list of strings, got {value!r}")
        return list(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"{what}: expected true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{what}: expected an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{what}: expected a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise UsageError(f"{what}: expected a string, got {value!r}")
    return value


def build(config_file: Path | None, flags: dict) -> ServeConfig:
    """The file's values, then every flag the user actually gave."""
    values = load_toml(config_file) if config_file else {}
    given = {k: v for k, v in flags.items() if v is not None}
    # A key source on the command line replaces the file's, of either kind.
    if "api_key" in given or "api_key_file" in given:
        values.pop("api_key", None)
        values.pop("api_key_file", None)
    values.update(given)
    where = str(config_file) if config_file else "flags"
    return ServeConfig(**values).check(where)
