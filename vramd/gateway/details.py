"""What Ollama's /api/tags, /api/ps and /api/show say about a model, beyond the member record.

The record names the file but not its path; the daemon's /vramd/status says
the path and its context length, and the file's GGUF header (read with the
strict reader, vramd/model/gguf_check.py) its architecture, quantization,
parameter count and chat template.  Both are asked once per member process
(by pid) and kept.  Best effort: a daemon whose key the gateway does not have
(and the client did not send), or a file the gateway may not read, leaves
those fields empty; nothing else depends on them.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import json
import logging
import threading

from vramd.errors import VramdError
from vramd.gateway.proxy import address
from vramd.gateway.table import Target

log = logging.getLogger("vramd.gateway")
STATUS_TIMEOUT = 5.0


class Details:
    def __init__(self, member_keys: dict[str, str]):
        self.member_keys = member_keys
        self._cache: dict[int, dict] = {}
        self._lock = threading.Lock()

    def of(self, t: Target, client_auth: str | None) -> dict:
        with self._lock:
            if t.pid in self._cache:
                return self._cache[t.pid]
        info = self._read(t, client_auth)
        if info.get("path"):   # a failed look is tried again next time (the key may come with the client)
            with self._lock:
                self._cache = {p: v for p, v in self._cache.items() if p != t.pid} | {t.pid: info}
        return info

    def _status(self, t: Target, client_auth: str | None) -> dict | None:
        key = self.member_keys.get(t.name)
        headers = {"Authorization": f"Bearer {key}"} if key else {"Authorization": client_auth} if client_auth else {}
        try:
            conn = http.client.HTTPConnection(*address(t.endpoint), timeout=STATUS_TIMEOUT)
        except VramdError:
            return None
        try:
            conn.request("GET", "/vramd/status", headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return json.loads(data) if resp.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None
        finally:
            conn.close()

    def _read(self, t: Target, client_auth: str | None) -> dict:
        status = self._status(t, client_auth)
        if not status:
            return {}
        info = {"path": status.get("model"), "ctx": status.get("ctx")}
        try:
            from vramd.model.gguf_check import validate_gguf
            mf = validate_gguf(info["path"])
        except (VramdError, OSError, TypeError) as e:
            log.debug("gateway: %s: no details from the model file: %s", t.name, e)
            return info
        md = mf.metadata
        arch = mf.architecture
        types = collections.Counter(x.type.name for x in mf.tensors if len(x.shape) > 1)
        n_params = sum(x.n_elements for x in mf.tensors)
        info.update({
            "architecture": arch, "size": mf.file_size, "parameters": n_params,
            "parameter_size": _human_count(n_params),
            "quantization": types.most_common(1)[0][0] if types else "",
            "template": md.get("tokenizer.chat_template", ""),
            "context_length": info["ctx"] or md.get(f"{arch}.context_length"),
            "digest": hashlib.sha256(repr(mf.identity).encode()).hexdigest(),
            "model_info": {k: v for k, v in md.items() if not isinstance(v, list) and not k.startswith("tokenizer.")},
        })
        info["model_info"].update({"general.architecture": arch, "general.parameter_count": n_params})
        return info


def _human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
