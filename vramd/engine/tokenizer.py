"""Tokenizer built from a GGUF file's vocabulary, behaving as llama.cpp's does.

Owns: turning text into token ids and back for the two vocabulary kinds the
llama family uses: SentencePiece style (`tokenizer.ggml.model = "llama"`:
pieces merged by score, `▁` for spaces, `<0xNN>` byte fallback) and GPT-2
byte-level BPE (`"gpt2"`: merges by rank after a pre-tokenizer regex), and
Gemma 4's BPE (`"gemma4"`: merges by rank over characters, `▁` for spaces,
split only at newline runs, `<0xNN>` byte fallback, BOS always added); the
special tokens (BOS/EOS/EOT/EOM/PAD/UNK, end-of-generation set) and literal
special tokens in text; a streaming decoder that only ever hands out complete
UTF-8.

Does not own: reading the file (vramd.model.gguf_check hands us `.metadata`),
chat templates (vramd.engine.chat), sampling (vramd.engine.sampler).

Fidelity to llama.cpp (src/llama-vocab.cpp), point by point:
- SPM: the same algorithm (symbols = UTF-8 characters; repeatedly merge the
  adjacent pair whose concatenation is a vocabulary piece with the highest
  score, ties to the leftmost pair; characters left unmatched become byte
  tokens).  llama.cpp's "resegment" step can only ever fire for single
  characters (every merged symbol is a vocabulary piece), so it reduces to a
  lookup or byte fallback here.
- Special tokens in text: split out longest first, each one everywhere it
  occurs, before the model tokenizer runs (`tokenizer_st_partition`);
  user-defined tokens always, control/unknown ones only with
  `parse_special=True`.  Not done: the LSTRIP/RSTRIP attributes llama.cpp sets
  by model name for phi-3 and jina only.
- BPE: the same merge loop over byte-level characters, ranks from
  `tokenizer.ggml.merges` (the first of duplicate pairs wins), `ignore_merges`
  for llama3.  Pre-tokenizers: gpt2 (also for "default" / missing: llama.cpp
  uses a different, multi-regex default there), llama3 and qwen2; their regexes
  run on Python `re` with \\p{L} / \\p{N} / \\s written out as explicit
  character classes built from `unicodedata` (Unicode categories L*, N*, and
  the Unicode White_Space set, as llama.cpp's tables), so no `regex` package is
  needed.  Unicode version: Python's `unicodedata`, which may trail llama.cpp's
  tables for characters assigned recently.  Other pre-tokenizers are refused.
- Decoding: the same piece per token (`token_to_piece`).  `decode()` strips
  the space prefix of the first text token after an initial BOS when the
  vocabulary adds one (llama.cpp keeps it there, which breaks the round trip);
  it never applies llama.cpp's BPE `clean_spaces` pass, which its server's
  streamed text does not apply either: streamed and whole text agree here.
- End of generation: EOS, EOT, EOM ids from the metadata plus the tokens
  llama.cpp recognises by text (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, ...),
  which are made control tokens as llama.cpp does.
- Where llama.cpp warns and carries on with a broken vocabulary (duplicate
  pieces abort it; an out-of-range special id falls back to a default), this
  module refuses with a one-line `ModelError`.
"""

from __future__ import annotations

import codecs
import heapq
import re
import sys
import unicodedata
from enum import IntEnum
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from vramd.errors import ModelError

SPACE_MARK = "\u2581"            # '▁', SentencePiece's escaped space


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (gguf's TokenType)."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens llama.cpp treats as end of turn / end of generation by their text
# (llama_vocab::impl::load).  The first EOT match (in id order here; llama.cpp
# walks a hash map) becomes the EOT id when the metadata names none.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
              "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
              "<|end_of_text|>", "<end_of_utterance>", "<turn|>")   # <turn|>: Gemma 4's end of turn

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")

# Pre-tokenizer names (tokenizer.ggml.pre) -> the regex family used.
_PRE_FAMILIES = {
    None: "gpt2", "": "gpt2", "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2",
    "phi-2": "gpt2", "roberta-bpe": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2",
    "gpt-4o": "gpt4o",      # gpt-oss (o200k)
}
# llama.cpp sets ignore_merges for these (a word that is itself a piece is not merged).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3"}
# ... and add_bos = true before the metadata can override it.
_ADD_BOS_BY_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3"}


class Tokenizer:
    """A vocabulary and the rules to use it.  Build with `from_metadata`."""

    def __init__(self, *, kind: str, tokens: list[str], types: list[int], scores: list[float],
                 merges: Sequence[str] | None, pre: str | None,
                 special: Mapping[str, int | None], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool):
        self.kind = kind                      # "spm" or "bpe"
        # Gemma 4's BPE (tokenizer.ggml.model "gemma4"; llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4):
        # spaces escaped to "▁", split only into runs of newlines and of everything else,
        # merges over the characters themselves (no GPT-2 byte alphabet), <0xNN> byte
        # tokens for a character the merges leave without a token.
        self.sentencepiece_bpe = pre == "gemma4" and kind == "bpe"
        self.tokens = tokens
        self.types = types
        self.scores = scores
        self.pre = pre
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.n_vocab = len(tokens)
        self.bos_id = special.get("bos")
        self.eos_id = special.get("eos")
        self.eot_id = special.get("eot")
        self.eom_id = special.get("eom")
        self.pad_id = special.get("pad")
        self.unk_id = special.get("unk")

        self._token_to_id: dict[str, int] = {}
        for i, text in enumerate(tokens):
            previous = self._token_to_id.setdefault(text, i)
            if previous != i:
                raise ModelError(f"vocabulary: token piece {text!r} appears twice "
                                 f"(ids {previous} and {i})")

        self._byte_of: dict[int, int] = {}    # BYTE token id -> byte value (SPM, Gemma 4's BPE)
        if kind == "spm" or self.sentencepiece_bpe:
            for i, t in enumerate(types):
                if t == TokenType.BYTE:
                    match = _BYTE_PIECE.match(tokens[i])
                    if match is None:
                        raise ModelError(f"vocabulary: byte token {i} is {tokens[i]!r}, "
                                         "not of the form <0xNN>")
                    self._byte_of[i] = int(match.group(1), 16)

        self._ranks: dict[tuple[str, str], int] = {}
        if kind == "bpe":
            for rank, merge in enumerate(merges or ()):
                cut = merge.find(" ", 1)      # llama.cpp: the first space after position 0
                if cut < 0:
                    continue                  # llama.cpp keeps ("", ""), which never matches
                self._ranks.setdefault((merge[:cut], merge[cut + 1:]), rank)
            family = "gemma4" if self.sentencepiece_bpe else _PRE_FAMILIES.get(pre)
            if family is None:
                raise ModelError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre; "
                                 f"vramd knows {', '.join(sorted(k for k in _PRE_FAMILIES if k))})")
            self._pre_split = _pre_tokenizer(family)
            self._ignore_merges = pre in _IGNORE_MERGES

        self._find_end_of_generation()
        # Special tokens that llama.cpp splits out of raw text, longest first
        # (ties: lower id first; llama.cpp's sort leaves ties unspecified).
        specials = [i for i, t in enumerate(self.types)
                    if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)]
        specials.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8", "surrogatepass")), i))
        # The first 4 characters of each: one substring test per distinct
        # prefix rules out whole families (Gemma's 6,000 "<unused...>").
        self._specials = [(self.tokens[i], i, self.types[i] == TokenType.USER_DEFINED,
                           self.tokens[i][:4]) for i in specials]

        for what, tid in (("BOS", self.bos_id), ("EOS", self.eos_id)):
            wanted = self.add_bos if what == "BOS" else self.add_eos
            if wanted and tid is None:
                raise ModelError(f"vocabulary asks to add {what} but has no {what} token")

    # --- construction --------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """The tokenizer described by a GGUF file's `tokenizer.ggml.*` keys."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError("the model has no vocabulary (tokenizer.ggml.model is missing)")
        if model == "llama":
            kind = "spm"
        elif model in ("gpt2", "gemma4"):
            kind = "bpe"
        else:
            raise ModelError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model; "
                             "vramd supports 'llama' (SentencePiece), 'gpt2' (BPE) and 'gemma4')")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ModelError("vocabulary: tokenizer.ggml.tokens is missing or empty")
        n = len(tokens)
        if not all(isinstance(t, str) for t in tokens):
            raise ModelError("vocabulary: tokenizer.ggml.tokens holds something else than strings")
        # llama.cpp renames empty pieces rather than letting them match nothing.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        scores = _per_token(metadata, "tokenizer.ggml.scores", n, float, 0.0)
        types = _per_token(metadata, "tokenizer.ggml.token_type", n, int, int(TokenType.NORMAL))
        types = [t if t in _KNOWN_TYPES else int(TokenType.UNDEFINED) for t in types]

        merges = None
        pre = metadata.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise ModelError("vocabulary: tokenizer.ggml.pre is not a string")
        if model == "gemma4":
            pre = "gemma4"   # llama.cpp sets it whatever the file says
        if kind == "bpe":
            merges = metadata.get("tokenizer.ggml.merges")
            if not isinstance(merges, (list, tuple)) or not all(isinstance(m, str) for m in merges):
                raise ModelError(f"vocabulary: a {model} tokenizer needs tokenizer.ggml.merges (strings)")

        # Defaults as llama.cpp's, then the metadata.
        if kind == "spm":
            special = {"bos": 1, "eos": 2, "unk": 0}
            add_bos, add_eos, add_space_prefix = True, False, True
        else:
            special = {"bos": 11, "eos": 11}
            add_bos, add_eos, add_space_prefix = pre in _ADD_BOS_BY_PRE or pre == "gemma4", False, False
        special = {k: (v if v < n else None) for k, v in special.items()}
        for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                          ("eot", "eot_token_id"), ("eom", "eom_token_id"),
                          ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
                raise ModelError(f"vocabulary: tokenizer.ggml.{key} = {value!r} is not a token id "
                                 f"(the vocabulary has {n} tokens)")
            special[name] = value
        add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token", add_bos) or model == "gemma4"   # llama.cpp forces it
        add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", add_eos)
        add_space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix)
        return cls(kind=kind, tokens=tokens, types=types, scores=scores, merges=merges, pre=pre,
                   special=special, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix)

    def _find_end_of_generation(self) -> None:
        eog: set[int] = set()
        for i, text in enumerate(self.tokens):
            if self.eot_id is None and text in _EOT_TEXTS:
                self.eot_id = i
            if self.eom_id is None and text == "<|eom_id|>":
                self.eom_id = i
            if text in _EOG_TEXTS:
                eog.add(i)
        for tid in (self.eot_id, self.eom_id):
            if tid is not None:
                eog.add(tid)
        for tid in eog:
            # llama.cpp: "control-looking token ... its type will be overridden".
            self.types[tid] = int(TokenType.CONTROL)
        # llama.cpp's workaround for harmony (gpt-oss's o200k_harmony): with <|return|> and <|call|>
        # in the vocabulary, <|end|> closes a message (the analysis channel), not the answer.
        ends = {i for i, text in enumerate(self.tokens) if text == "<|end|>"}
        if ends and {"<|return|>", "<|call|>"} <= set(self.tokens[i] for i in eog):
            eog -= ends
        if self.eos_id is not None:
            eog.add(self.eos_id)
        self.eog_ids = frozenset(eog)

    # --- queries -------------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        """True for a token that ends generation (EOS, EOT, EOM and their kin)."""
        return token in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """The id of the piece spelled exactly `text`, or None."""
        return self._token_to_id.get(text)

    def is_control(self, token: int) -> bool:
        return self.types[token] in (TokenType.CONTROL, TokenType.UNKNOWN)

    # --- encoding ------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               space_prefix: bool = True) -> list[int]:
        """Token ids of `text`.  `add_special` adds BOS/EOS as the vocabulary
        asks; `parse_special` turns literal control tokens (`<start_of_turn>`)
        into their ids instead of spelling them out; `space_prefix=False` keeps
        SentencePiece's leading space off (the ids then spell exactly `text`,
        as a grammar engine needs of a piece of generated text)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        fragments = self._partition(text, parse_special) if text else []
        prev_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
            elif self.kind == "spm":
                if self.add_space_prefix and prev_special and space_prefix:
                    fragment = " " + fragment
                self._spm_tokenize(fragment.replace(" ", SPACE_MARK), out)
                prev_special = False
            else:
                self._bpe_tokenize(fragment, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special tokens out of `text` as llama.cpp's tokenizer_st_partition:
        each special token in turn, longest first, at every occurrence in the
        fragments of text that are left."""
        fragments: list[str | int] = [text]
        seen: dict[str, bool] = {}
        for piece, tid, user_defined, prefix in self._specials:
            if not (parse_special or user_defined):
                continue
            present = seen.get(prefix)
            if present is None:
                present = seen[prefix] = prefix in text
            if not present or piece not in text:
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(piece)):
                    if k:
                        split.append(tid)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on one fragment (spaces already escaped)."""
        symbols = list(text)                  # one UTF-8 character each
        n = len(symbols)
        if n == 0:
            return
        vocab, scores = self._token_to_id, self.scores
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            tid = vocab.get(symbols[left] + symbols[right])
            if tid is not None:
                # Highest score first, then the leftmost pair (llm_bigram_spm::comparator).
                heapq.heappush(heap, (-scores[tid], left, right,
                                      len(symbols[left]) + len(symbols[right])))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = symbols[left], symbols[right]
            # Stale entry: one side was merged away or grew since it was queued.
            if not a or not b or len(a) + len(b) != size:
                continue
            symbols[left] = a + b
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])

        i = 0
        while i != -1:
            piece = symbols[i]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for byte in piece.encode("utf-8", "surrogatepass"):
                    out.append(self._byte_token(byte))
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        """llama_vocab::byte_to_token for SPM: `<0xNN>`, else the byte as a one-character piece."""
        tid = self._token_to_id.get(f"<0x{byte:02X}>")
        if tid is None and byte < 0x80:
            tid = self._token_to_id.get(chr(byte))
        if tid is None:
            tid = self.unk_id
        if tid is None:
            raise ModelError(f"vocabulary has no token for byte 0x{byte:02X} and no unknown token")
        return tid

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_bpe_session::tokenize on one fragment."""
        vocab, ranks = self._token_to_id, self._ranks
        table = _BYTES_TO_UNICODE
        spbpe = self.sentencepiece_bpe
        if spbpe:
            text = text.replace(" ", SPACE_MARK)
        for word in self._pre_split(text):
            if spbpe:
                mapped = word
                if word[0] == "\n" and word in vocab:   # a run of newlines that is a token stays whole
                    out.append(vocab[word])
                    continue
            else:
                mapped = "".join([table[b] for b in word.encode("utf-8", "surrogatepass")])
            if self._ignore_merges:
                tid = vocab.get(mapped)
                if tid is not None:
                    out.append(tid)
                    continue
            symbols = list(mapped)
            n = len(symbols)
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prv = list(range(-1, n - 1))
            heap: list[tuple[int, int, int, str]] = []

            def add(left: int, right: int) -> None:
                if left < 0 or right < 0:
                    return
                rank = ranks.get((symbols[left], symbols[right]))
                if rank is not None:
                    # Lowest rank first, then the leftmost pair (llm_bigram_bpe::comparator).
                    heapq.heappush(heap, (rank, left, right, symbols[left] + symbols[right]))

            for i in range(1, n):
                add(i - 1, i)
            while heap:
                _, left, right, joined = heapq.heappop(heap)
                a, b = symbols[left], symbols[right]
                if not a or not b or a + b != joined:
                    continue                  # outdated
                symbols[left] = joined
                symbols[right] = ""
                nxt[left] = nxt[right]
                if nxt[right] >= 0:
                    prv[nxt[right]] = left
                add(prv[left], left)
                add(left, nxt[left])
            i = 0
            while i != -1:
                piece = symbols[i]
                tid = vocab.get(piece)
                if tid is not None:
                    out.append(tid)
                elif spbpe:   # Gemma 4: the piece's UTF-8 bytes as <0xNN> tokens
                    out.extend(self._byte_token(b) for b in piece.encode("utf-8", "surrogatepass"))
                else:
                    # A merge that produced no piece (an inconsistent vocabulary):
                    # one token per byte where the byte has one, as llama.cpp.
                    out.extend(vocab[c] for c in piece if c in vocab)
                i = nxt[i]

    # --- decoding ------------------------------------------------------------

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token stands for (llama_vocab::token_to_piece).  Control
        and unknown tokens give b"" unless `special`."""
        if not 0 <= token < self.n_vocab:
            raise ModelError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        t = self.types[token]
        text = self.tokens[token]
        if t in (TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8", "surrogatepass") if special else b""
        if t == TokenType.USER_DEFINED:
            return text.encode("utf-8", "surrogatepass")
        if t == TokenType.NORMAL:
            if self.kind == "spm" or self.sentencepiece_bpe:
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogatepass")
            return _byte_level_decode(text)
        if t == TokenType.BYTE and (self.kind == "spm" or self.sentencepiece_bpe):
            return bytes((self._byte_of[token],))
        return b""                            # unused, undefined: suppressed as llama.cpp does

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        ids = list(ids)
        parts = []
        strip = self.add_space_prefix
        for k, tid in enumerate(ids):
            piece = self.token_to_piece(tid, special)
            if k == 0 and tid == self.bos_id:
                parts.append(piece)           # b"" unless special
                continue
            if strip and piece.startswith(b" "):
                piece = piece[1:]
            strip = False
            parts.append(piece)
        return b"".join(parts).decode("utf-8", "replace")

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)


class StreamDecoder:
    """Decodes generated ids one at a time.  `feed(id)` returns the text that
    became complete: a multi-byte character split over several tokens (byte
    fallback pieces, BPE byte pieces) comes out whole once its last byte is
    in; a byte sequence that can never be valid UTF-8 comes out as U+FFFD.
    `flush()` ends the stream (an unfinished character becomes U+FFFD).
    No space prefix is stripped: generated text continues the prompt."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._utf8.decode(self._tokenizer.token_to_piece(token, self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> int:
        """Bytes held back: the start of a character whose end has not come yet."""
        return len(self._utf8.getstate()[0])


# --- helpers ---------------------------------------------------------------------

_KNOWN_TYPES = frozenset(int(t) for t in TokenType)


def _per_token(metadata: Mapping[str, Any], key: str, n: int, kind: type, default: Any) -> list:
    values = metadata.get(key)
    if values is None:
        return [default] * n
    try:
        count = len(values)
    except TypeError:
        raise ModelError(f"vocabulary: {key} is not an array") from None
    if count != n:
        raise ModelError(f"vocabulary: {key} has {count} entries for {n} tokens")
    try:
        return [kind(v) for v in values]
    except (TypeError, ValueError):
        raise ModelError(f"vocabulary: {key} holds a value that is not a {kind.__name__}") from None


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, int)):
        raise ModelError(f"vocabulary: {key} = {value!r} is not a boolean")
    return bool(value)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level table: printable bytes stand for themselves, the
    others are shifted to U+0100 and up (so a space is 'Ġ', a newline 'Ċ')."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTES_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTES = {c: b for b, c in enumerate(_BYTES_TO_UNICODE)}


def _byte_level_decode(text: str) -> bytes:
    """A byte-level BPE piece back to bytes.  A character outside the table
    (not produced by byte-level encoding) stands for itself (llama.cpp writes
    an "[UNK_BYTE_...]" marker instead)."""
    out = bytearray()
    for c in text:
        b = _UNICODE_TO_BYTES.get(c)
        if b is None:
            out += c.encode("utf-8", "surrogatepass")
        else:
            out.append(b)
    return bytes(out)


# Unicode White_Space, the set llama.cpp's is_whitespace flag stands for.
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@lru_cache(maxsize=1)
def _unicode_classes() -> tuple[str, str]:
    """Regex class bodies for \\p{L} and \\p{N}: ranges of every code point
    whose general category starts with L (resp. N).  Built once (~0.3 s)."""
    letters: list[tuple[int, int]] = []
    numbers: list[tuple[int, int]] = []
    category = unicodedata.category
    for cp in range(sys.maxunicode + 1):
        major = category(chr(cp))[0]
        target = letters if major == "L" else numbers if major == "N" else None
        if target is None:
            continue
        if target and target[-1][1] == cp - 1:
            target[-1] = (target[-1][0], cp)
        else:
            target.append((cp, cp))

    def body(ranges: list[tuple[int, int]]) -> str:
        return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                       for a, b in ranges)
    return body(letters), body(numbers)


@lru_cache(maxsize=None)
def _pre_tokenizer(family: str):
    """The `findall` of the pre-tokenizer regex of `family`, as llama.cpp
    writes it (llm_tokenizer_bpe), with \\p{L}, \\p{N}, \\s spelled out."""
    if family == "gemma4":
        return re.compile("[^\n]+|[\n]+").findall
    L, N = _unicode_classes()
    S = _WHITESPACE
    contraction = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    if family == "gpt4o":
        # llama.cpp's form of o200k's regex (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O): \p{Lu}-ish
        # runs are "a letter not a-z", \p{Ll}-ish "a letter not A-Z" (only ASCII case is told apart):
        # [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|...)?
        # |[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|...)?
        # |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
        upper, lower = f"(?:(?=[{L}])[^a-z])", f"(?:(?=[{L}])[^A-Z])"
        pattern = (f"[^\r\n{L}{N}]?{upper}*{lower}+{contraction}|[^\r\n{L}{N}]?{upper}+{lower}*{contraction}"
                   f"|[{N}]{{1,3}}| ?[^{S}{L}{N}]+[\r\n/]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
        return re.compile(pattern).findall
    if family == "gpt2":
        # 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
        pattern = (f"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+"
                   f"|[{S}]+(?![^{S}])|[{S}]+")
    else:
        digits = "{1,3}" if family == "llama3" else ""
        # (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+
        # |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+   (qwen2: \p{N} alone)
        pattern = (f"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                   f"|[^\\r\\n{L}{N}]?[{L}]+|[{N}]{digits}| ?[^{S}{L}{N}]+[\\r\\n]*"
                   f"|[{S}]*[\\r\\n]+|[{S}]+(?![^{S}])|[{S}]+")
    return re.compile(pattern).findall
