"""Vocabularies and chat templates of the synthetic GGUF models.

Owns `make_vocab` (and `Vocab`, `gpt2_byte_chars`, the token types), the chat
templates (`LLAMA2_TEMPLATE`, `MISTRAL_TEMPLATE`, `CHATML_TEMPLATE`,
`QWEN3_TEMPLATE`: Qwen3's own, with enable_thinking, as templates/qwen3.jinja;
`HARMONY_TEMPLATE`, a cut-down gpt-oss one, with `HARMONY_TOKENS`),
`write_vocab` (the tokenizer.* metadata of a spec) and
`LLAMA_CPP_TOKENIZATIONS` (llama.cpp's tokenizations of a few texts with these
vocabularies: goldens for the engine's tokenizer).

Vocabularies (built from CORPUS, a few hundred words of plain English, by a
small deterministic BPE trainer):
    spm   tokenizer.ggml.model "llama": <unk>=0 (UNKNOWN), <s>=1 and </s>=2
          (CONTROL), <0x00>..<0xFF> = 3..258 (BYTE), then the learned pieces
          (NORMAL, "▁" for a space) by descending score (score = -rank), then the
          corpus's single characters (lowest scores).  Every learned piece is
          the concatenation of two pieces that rank before it (or of single
          characters), so SentencePiece's score-driven merging reaches it;
          characters outside the corpus go through byte fallback.
          add_bos_token true, add_space_prefix true.
    bpe   tokenizer.ggml.model "gpt2", pre "gpt-2" (override with bpe_pre=): the
          256 byte tokens in GPT-2's byte-to-unicode alphabet, id = byte value,
          then one token per learned merge (tokenizer.ggml.merges "a b"), then
          <|endoftext|> (BOS), <|im_start|>, <|im_end|> (EOS) as CONTROL tokens.
          add_bos_token false.
  fim=True (either kind) adds three fill-in-the-middle tokens as CONTROL tokens at
  the end of the vocabulary (FIM_TOKENS: Qwen's <|fim_prefix|>/<|fim_suffix|>/
  <|fim_middle|> for bpe, CodeLlama's <PRE>/<SUF>/<MID> for spm), in place of
  the last learned pieces; a spec's `fim` says how the file names them:
  "keys" (tokenizer.ggml.fim_pre/suf/mid_token_id), "legacy" (the older
  prefix/suffix/middle_token_id), "text" (no key: llama.cpp finds them by their
  text), None (no FIM tokens at all).
    gemma4 tokenizer.ggml.model "gemma4" (Gemma 4's SentencePiece-style BPE, no
          tokenizer.ggml.pre, as its converter writes it): <pad>=0, <eos>=1, <bos>=2
          (CONTROL), <unk>=3 (UNKNOWN), <|turn> and <turn|> (CONTROL), "\n" and
          "\n\n" (NORMAL), <0x00>..<0xFF> (BYTE), the corpus's characters, then
          one token per learned merge of "▁"-prefixed words (tokenizer.ggml.merges);
          add_bos_token true, add_space_prefix false.
  tool_tokens=True (a spec's `tool_tokens`) makes Qwen's <tool_call> and </tool_call>
  the last two tokens, USER_DEFINED (text that is one token, as in Qwen's vocabulary).
  llama.cpp loads and tokenizes both (see LLAMA_CPP_TOKENIZATIONS), and the three
  chat templates render with jinja2 (checked by hand; jinja2 is not a dependency).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gguf

# token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
FIM_TOKENS = {"bpe": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), "spm": ("<PRE>", "<SUF>", "<MID>"),
              "gemma4": ()}
FIM_STYLES = ("keys", "legacy", "text")

CORPUS = """\
The river ran past the old mill, and the miller sat by the door to watch the water.
Every morning he counted the sacks of grain, and every evening he counted them again.
When the rain came in the spring, the wheel turned faster and the whole house sang.
His daughter kept the books; she wrote the numbers in a clean, careful hand: 12 sacks
on Monday, 30 on Tuesday, 7 on the day the bridge was closed. She liked the numbers
because they did not change when you looked away from them.
In the summer the travellers came down the road with carts and questions. Where is the
market? How far to the sea? Is the water good to drink? The miller answered them all,
and his daughter listened, and later she drew a map of the valley on the back of a
ledger: the road, the river, the forest to the north, the hills to the east, and the
small stone church where the road turned west towards the coast.
Years later the map was still on the wall. The paper was brown and the ink was faded,
but you could read every name. A visitor from the city asked if he could buy it. "It is
not for sale," she said, "but you may copy it, if you are careful with the corners."
He copied it that afternoon, slowly, line by line, while the wheel turned and the water
went on past the mill as it always had. Then he thanked her, paid for his bread, and
walked on towards the coast, where the road ends and the boats begin.
Some say the café by the harbour still keeps a copy of that map; others say it was a
different map, drawn by someone else, for a different valley. Nobody knows for certain,
and nobody minds very much. The river does not care who draws it; it only runs.
"""

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
    "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
    "{{ message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% endif %}{% endfor %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# A cut-down harmony template (gpt-oss's markers, tools as a developer line, an assistant's call as
# the real template renders it, the generation prompt "<|start|>assistant"); with HARMONY_TOKENS.
HARMONY_TEMPLATE = (
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{%- for t in tools %} functions.{{ t.function.name }}"
    "{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{%- for c in m.tool_calls -%}<|start|>assistant<|channel|>"
    "commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments }}<|call|>"
    "{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")

# Qwen3's own template (the "chat_template" of Qwen/Qwen3-0.6B's tokenizer_config.json,
# with its enable_thinking switch), kept as a data file of the writer package.
QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()


# --- vocabularies --------------------------------------------------------------------

@dataclass(frozen=True)
class Vocab:
    model: str                  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    scores: list[float] | None  # SentencePiece only
    merges: list[str] | None    # BPE only
    bos: int
    eos: int
    unk: int | None
    special: dict[str, int] = field(default_factory=dict)


# Control tokens a style's vocabulary ends with: llama.cpp's phi3 vocabulary loader looks up
# "<|endoftext|>" (a file without it fails to load, "_Map_base::at"); Phi-3's chat tokens.
PHI3_TOKENS = ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")
# OpenAI harmony's (gpt-oss's o200k_harmony) markers, CONTROL tokens; a spec with harmony=True has them.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


@functools.lru_cache(maxsize=None)
def make_vocab(kind: str, n_vocab: int, fim: bool = False, extra: tuple[str, ...] = (),
               tool_tokens: bool = False) -> Vocab:
    """A vocabulary of exactly n_vocab tokens learned from CORPUS (with fim, its
    last three are FIM_TOKENS[kind], then the `extra` control tokens, all in
    `special` by name).  Cached (training takes ~0.2 s and every file of a size
    has the same one): treat it as read-only."""
    if kind not in FIM_TOKENS:
        raise ValueError(f"vocab {kind!r}: expected 'spm' or 'bpe'")
    if tool_tokens:    # Qwen's <tool_call> and </tool_call>: USER_DEFINED, text that is one token
        v = make_vocab(kind, n_vocab - 2, fim, extra)
        return Vocab(v.model, v.tokens + list(TOOL_TOKENS), v.types + [USER_DEFINED] * 2,
                     None if v.scores is None else v.scores + [0.0] * 2, v.merges, v.bos, v.eos, v.unk,
                     dict(v.special) | {t: n_vocab - 2 + i for i, t in enumerate(TOOL_TOKENS)})
    names = (FIM_TOKENS[kind] if fim else ()) + tuple(extra)
    if not names:
        return {"spm": _spm_vocab, "bpe": _bpe_vocab, "gemma4": _gemma4_vocab}[kind](n_vocab)
    k = len(names)
    v = make_vocab(kind, n_vocab - k)
    special = dict(v.special) | {t: n_vocab - k + i for i, t in enumerate(names)}
    return Vocab(v.model, v.tokens + list(names), v.types + [CONTROL] * k,
                 None if v.scores is None else v.scores + [0.0] * k, v.merges, v.bos, v.eos, v.unk, special)


def _train_bpe(words: Counter, n_tokens: int, have: set[str]) -> list[tuple[str, str]]:
    """Merge the most frequent adjacent pair (ties: the lexicographically smallest)
    until n_tokens new token strings exist; words are tuples of symbols."""
    merges: list[tuple[str, str]] = []
    new = 0
    words = Counter({tuple(w): c for w, c in words.items()})
    while new < n_tokens:
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        if joined not in have:
            have.add(joined)
            new += 1
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def _spm_vocab(n_vocab: int) -> Vocab:
    words = Counter("\u2581" + w for w in CORPUS.split())
    chars = sorted({c for w in words for c in w})
    fixed = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    room = n_vocab - len(fixed) - len(chars)
    if room < 0:
        raise ValueError(f"an SPM vocabulary needs at least {len(fixed) + len(chars)} tokens")
    merges = _train_bpe(Counter({tuple(w): c for w, c in words.items()}), room, set(chars))
    pieces: list[str] = []
    for a, b in merges:
        if a + b not in pieces and a + b not in chars:
            pieces.append(a + b)
    pieces = pieces[:room]
    unused = [f"<unused{i}>" for i in range(room - len(pieces))]  # only if CORPUS ran out of merges
    tokens = fixed + pieces + chars + unused
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(chars)) \
        + [UNUSED] * len(unused)
    scores = [0.0] * len(fixed) + [-float(i) for i in range(len(pieces) + len(chars))] \
        + [-1e9] * len(unused)
    return Vocab("llama", tokens, types, scores, None, bos=1, eos=2, unk=0)


def _gemma4_vocab(n_vocab: int) -> Vocab:
    words = Counter("\u2581" + w for w in CORPUS.split())
    chars = sorted({c for w in words for c in w})
    fixed = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "\n", "\n\n"] + [f"<0x{b:02X}>" for b in range(256)]
    room = n_vocab - len(fixed) - len(chars)
    if room < 0:
        raise ValueError(f"a gemma4 vocabulary needs at least {len(fixed) + len(chars)} tokens")
    tokens = fixed + chars
    seen, merges = set(tokens), []
    for a, b in _train_bpe(Counter({tuple(w): c for w, c in words.items()}), room, set(chars)):
        if len(tokens) == n_vocab:
            break
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
        merges.append(f"{a} {b}")
    unused = [f"<unused{i}>" for i in range(n_vocab - len(tokens))]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL, NORMAL, NORMAL] + [BYTE] * 256 \
        + [NORMAL] * (len(tokens) - len(fixed)) + [UNUSED] * len(unused)
    return Vocab("gemma4", tokens + unused, types, [0.0] * n_vocab, merges, bos=2, eos=1, unk=3,
                 special={"<|turn>": 4, "<turn|>": 5})


def gpt2_byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte value."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# GPT-2's pre-tokenizer with Python's `re` (\p{L} -> [^\W\d_], \p{N} -> \d): used
# only to cut CORPUS into words for training; the file names the real one in
# tokenizer.ggml.pre.
_GPT2_SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


def _bpe_vocab(n_vocab: int) -> Vocab:
    byte_chars = gpt2_byte_chars()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    room = n_vocab - 256 - len(specials)
    if room < 0:
        raise ValueError(f"a BPE vocabulary needs at least {256 + len(specials)} tokens")
    words = Counter(tuple(byte_chars[b] for b in piece.encode())
                    for piece in _GPT2_SPLIT.findall(CORPUS))
    merges = _train_bpe(words, room, set(byte_chars))
    tokens = list(byte_chars)
    seen = set(tokens)
    kept_merges = []
    for a, b in merges:
        if a + b not in seen:
            if len(tokens) - 256 >= room:
                break
            seen.add(a + b)
            tokens.append(a + b)
        kept_merges.append(f"{a} {b}")
    unused = [f"<unused{i}>" for i in range(room - (len(tokens) - 256))]
    first_special = len(tokens) + len(unused)
    tokens += unused + specials
    types = [NORMAL] * (first_special - len(unused)) + [UNUSED] * len(unused) + [CONTROL] * 3
    ids = {s: first_special + i for i, s in enumerate(specials)}
    return Vocab("gpt2", tokens, types, None, kept_merges, bos=ids["<|endoftext|>"],
                 eos=ids["<|im_end|>"], unk=None, special=ids)


# What llama.cpp's tokenizer makes of a few texts with these vocabularies: goldens
# for the engine's tokenizer.  Recorded with llama-cpp-python 0.3.36 as
# Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=S)
# on write_llama(arch="llama") ("spm") and write_llama(arch="qwen2") ("bpe"),
# default n_vocab 512.  Entries: (text, S, ids).  SentencePiece adds a leading
# space ("\u2581") to the text first; characters outside CORPUS's alphabet become
# <0xXX> byte tokens; with S (parse special tokens) "<|im_start|>" is one token in
# the BPE vocabulary.  test_reference checks that the ids still spell the texts.
LLAMA_CPP_TOKENIZATIONS: dict[str, list[tuple[str, bool, list[int]]]] = {
    "spm": [
        ('The river ran past the old mill.', False,
         [307, 356, 282, 300, 437, 261, 271, 342, 331, 468]),
        (' Hello world', False, [511, 350, 491, 272, 500, 264, 283, 342]),
        ('café 日本 🙂', False,
         [299, 492, 510, 511, 233, 154, 168, 233, 159, 175, 511, 243, 162, 156, 133]),
        ('12 sacks\n\n  and 300 more', False,
         [511, 450, 439, 13, 13, 511, 275, 511, 451, 469, 274, 500, 278]),
        ("the miller's daughter", False, [261, 435, 42, 504, 426]),
        ('<|im_start|>user\nhi<|im_end|>', False,
         [511, 63, 127, 495, 498, 98, 504, 505, 289, 505, 127, 65, 506, 504, 262, 13, 494, 495, 63,
          127, 495, 498, 98, 491, 268, 127, 65]),
        ('<|im_start|>user\nhi<|im_end|>', True,
         [511, 63, 127, 495, 498, 98, 504, 505, 289, 505, 127, 65, 506, 504, 262, 13, 494, 495, 63,
          127, 495, 498, 98, 491, 268, 127, 65]),
    ],
    "bpe": [
        ('The river ran past the old mill.', False,
         [296, 352, 278, 297, 427, 258, 268, 340, 328, 46]),
        (' Hello world', False, [32, 443, 267, 111, 262, 280, 340]),
        ('café 日本 🙂', False,
         [99, 97, 506, 169, 32, 230, 151, 165, 230, 156, 172, 32, 240, 159, 153, 130]),
        ('12 sacks\n\n  and 300 more', False,
         [440, 429, 10, 10, 32, 279, 32, 441, 48, 271, 111, 274]),
        ("the miller's daughter", False, [116, 256, 424, 39, 115, 416]),
        ('<|im_start|>user\nhi<|im_end|>', False,
         [60, 124, 105, 109, 95, 115, 116, 475, 124, 62, 117, 115, 259, 10, 104, 105, 60, 124, 105,
          109, 95, 101, 265, 124, 62]),
        ('<|im_start|>user\nhi<|im_end|>', True, [510, 117, 115, 259, 10, 104, 105, 511]),
    ],
}


def write_vocab(writer: gguf.GGUFWriter, spec) -> None:
    """The tokenizer.* metadata (and chat template) of `spec`: its vocab, n_vocab,
    bpe_pre and chat_template fields."""
    fim = getattr(spec, "fim", None)
    if fim is not None and fim not in FIM_STYLES:
        raise ValueError(f"fim {fim!r}: expected one of {', '.join(FIM_STYLES)} or None")
    extra = (PHI3_TOKENS if getattr(spec, "arch", "") == "phi3" else
             HARMONY_TOKENS if getattr(spec, "harmony", False) else ())
    v = make_vocab(spec.vocab, spec.n_vocab, fim is not None, extra, getattr(spec, "tool_tokens", False))
    writer.add_tokenizer_model(v.model)
    if v.model == "gpt2":
        writer.add_tokenizer_pre(spec.bpe_pre)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.types)
    if v.scores is not None:
        writer.add_token_scores(v.scores)
    if v.merges is not None:
        writer.add_token_merges(v.merges)
    writer.add_bos_token_id(v.bos)
    writer.add_eos_token_id(v.eos)
    if v.unk is not None:
        writer.add_unk_token_id(v.unk)
    if v.model == "gpt2":
        writer.add_pad_token_id(v.bos)
    writer.add_add_bos_token(v.model in ("llama", "gemma4"))
    writer.add_add_eos_token(False)
    if v.model in ("llama", "gemma4"):
        writer.add_add_space_prefix(v.model == "llama")
    if fim in ("keys", "legacy"):
        pre, suf, mid = (v.special[t] for t in FIM_TOKENS[spec.vocab])
        names = ("fim_pre", "fim_suf", "fim_mid") if fim == "keys" else ("prefix", "suffix", "middle")
        for name, tid in zip(names, (pre, suf, mid)):
            writer.add_uint32(f"tokenizer.ggml.{name}_token_id", tid)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
