"""Constrained sampling: a grammar's token mask applied to the logits, step by step.

Owns: the llguidance tokenizer of a model's vocabulary (`ll_tokenizer`,
built once per Tokenizer and cached: it walks the whole vocabulary), turning
a JSON schema or a Lark grammar into an llguidance grammar (`json_schema`,
`lark`, `json_in_lark`), checking a grammar against the vocabulary before a
request is queued (`check`: what llguidance cannot enforce, such as
`uniqueItems` or `if`/`then`, is a UsageError, a 400, naming the keywords
as llguidance reports them; nothing is silently ignored), and `Constraint`,
one request's matcher: `masked(logits)` gives the logits with every token
the grammar does not allow at this step set to -inf, `advance(token)` moves
the matcher on, `done` says the grammar is complete.

Does not own: where the mask is applied (the generation loop in
vramd/engine/runner.py, before the sampler's top-k/top-p/min-p/temperature,
so a greedy request takes the best allowed token), what grammar a request
gets (vramd/server/structured.py and tools.py).

Why llguidance: it is the grammar engine llama.cpp and vLLM use; it computes
a mask over a 150k vocabulary in tens of microseconds by walking a token
trie, far below a decode step.  Unconstrained requests never reach this
module: no matcher, no mask, no copy of the logits.

The mask of the next step is computed on a worker thread while the GPU runs
that step (`prefetch`, called by the generation loop right after `advance`):
llguidance's mask fill and numpy's unpacking release the GIL, so on a GPU the
host's share of a constrained token is only the select of the allowed logits.
Measured on the H200 host, 8B shapes (128,256 tokens), before this: the mask
0.23 ms a step, +5.7 % per token at Q4_K (4.4 ms a token), +4.9 % at F16.

Whitespace between JSON tokens is bounded the way llama.cpp's
json-schema-to-grammar bounds it (a space, or one or two newlines and at
most 20 spaces or tabs of indentation): without a bound a model can emit
whitespace for ever and still be "valid".
"""

from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from vramd.errors import UsageError, VramdError

# llama.cpp's `space` rule of json-schema-to-grammar: `| " " | "\n"{1,2} [ \t]{0,20}`.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
# Control tokens are marked for llguidance with a leading 0xFF byte (as its llama.cpp
# binding does): grammar text never matches them, `<[id]>` in Lark names them.
SPECIAL_MARK = b"\xff"

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _mask_worker() -> ThreadPoolExecutor:
    """One thread for every request's next mask: the engine runs one generation at a time."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vramd-mask")
        return _worker


def _llg():
    import llguidance
    import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    return llguidance


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer: token bytes, EOS, BOS,
    special ids, and a call that tokenizes bytes."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.is_control(i)]
        special = set(self.special_token_ids)
        self.tokens = [SPECIAL_MARK + tokenizer.tokens[i].encode("utf-8", "surrogatepass") if i in special
                       else tokenizer.token_to_piece(i) for i in range(tokenizer.n_vocab)]

    def __call__(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return self._tokenizer.encode(text, add_special=False, parse_special=False, space_prefix=False)


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of `tokenizer`'s vocabulary, built on first use and kept
    as long as the Tokenizer lives.  Every end-of-generation token counts as EOS: the
    grammar allows them where it may end."""
    lt = _cache.get(tokenizer)
    if lt is None:
        llg = _llg()
        lt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)),
                             eos_token=sorted(tokenizer.eog_ids) or None)
        _cache[tokenizer] = lt
    return lt


def _with_options(schema: dict) -> dict:
    # x-guidance carries the compile options inside the schema (%json in Lark reads it too).
    return {**schema, "x-guidance": dict(JSON_OPTIONS)}


def json_schema(schema: dict | bool) -> str:
    """The llguidance grammar of a JSON schema (true: any JSON value)."""
    if schema is True:
        schema = {}
    return _llg().LLMatcher.grammar_from_json_schema(_with_options(schema))


def json_in_lark(schema: dict) -> str:
    """A JSON schema as a Lark item (`%json {...}`), to embed in a larger grammar."""
    return "%json " + json.dumps(_with_options(schema), ensure_ascii=False)


def lark(source: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(source)


def special_token(tokenizer, text: str) -> str | None:
    """`<[id]>` for a control token spelled `text` (Lark's reference to it), else None."""
    tid = tokenizer.token_id(text)
    return f"<[{tid}]>" if tid is not None and tokenizer.is_control(tid) else None


def check(grammar: str, tokenizer, what: str) -> None:
    """Refuse (UsageError, HTTP 400) a grammar llguidance cannot enforce exactly, with its
    own words: unimplemented schema keywords, bad regexes, a grammar too large."""
    llg = _llg()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer))
    if is_error:
        raise UsageError(f"{what}: {_one_line(messages[0] if messages else 'invalid grammar')}")
    # llguidance reports as warnings what it would only approximate: refuse those too.
    if messages:
        raise UsageError(f"{what}: cannot be enforced exactly: {_one_line('; '.join(messages))}")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class Constraint:
    """One request's grammar matcher over the model's vocabulary."""

    def __init__(self, tokenizer, grammar: str):
        llg = _llg()
        self._llg = llg
        self.n_vocab = tokenizer.n_vocab
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise UsageError(f"grammar: {_one_line(self.matcher.get_error())}")
        self._bits = llg.numpy.allocate_token_bitmask(1, self.n_vocab)
        self._next: Future | None = None   # the next step's allowed tokens, being computed
        # the matcher's state read on this thread after each token: while the worker fills a mask the
        # matcher is borrowed there, and reading it here raised "Already mutably borrowed" (llguidance)
        self._stopped, self._accepting = self.matcher.is_stopped(), self.matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """A boolean vector over the vocabulary: the tokens the grammar allows next."""
        self._llg.numpy.fill_next_token_bitmask(self.matcher, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def _allowed_ids(self) -> tuple[np.ndarray, np.ndarray | None]:
        """allowed(), and the allowed ids themselves when they are few (a JSON grammar's usual
        case): the logits are then gathered by index, not selected over the whole vocabulary."""
        allowed = self.allowed()
        ids = np.flatnonzero(allowed)
        return allowed, (ids if len(ids) * 8 < len(allowed) else None)

    def prefetch(self) -> None:
        """Start computing the next mask on the worker thread (the matcher is not touched
        here again until `masked` has taken the result)."""
        if self._next is None and not self._stopped:
            self._next = _mask_worker().submit(self._allowed_ids)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with the disallowed tokens at -inf (ids past the vocabulary,
        padding rows of the output matrix, too)."""
        if self._next is not None:
            (allowed, ids), self._next = self._next.result(), None
        else:
            allowed, ids = self._allowed_ids()
        n = logits.shape[0]
        out = np.full(n, -np.inf, dtype=logits.dtype)
        # 262,144 tokens, 2,000 allowed: 0.04 ms gathered by index, 0.10 ms by np.copyto's
        # select (0.3 ms np.where); with most tokens allowed the select is the faster.
        if ids is not None:
            ids = ids[ids < n]
            out[ids] = logits[ids]
            return out
        if n != self.n_vocab:
            allowed = np.concatenate([allowed, np.zeros(max(n - self.n_vocab, 0), bool)])[:n]
        np.copyto(out, logits, where=allowed)
        return out

    def advance(self, token: int) -> None:
        if self._next is not None:        # a mask of the state before this token: no longer of use
            self._next.result()
            self._next = None
        if not self.matcher.consume_token(token):
            raise VramdError(f"grammar: token {token} was refused after the mask allowed it: "
                             f"{_one_line(self.matcher.get_error())}")
        self._stopped, self._accepting = self.matcher.is_stopped(), self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only an end of generation)."""
        return self._stopped

    @property
    def accepting(self) -> bool:
        return self._accepting
