"""The "gpt-4o" pre-tokenizer (gpt-oss's o200k; vramd/engine/tokenizer.py) as llama.cpp runs it.

llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O) does not run o200k's
regex as written: its \\p{Lu}/\\p{Ll} runs become "a letter not a-z" / "a letter
not A-Z", so only ASCII case splits words (camelCase -> camel, Case; a
non-ASCII capital counts as both).  The splits below are that regex's, worked
out by hand; then a GPT-2 BPE file declaring pre "gpt-4o" is tokenized alike
by vramd and llama.cpp's server (/tokenize) -- which checks the vocabulary is
read alike (the small test vocabulary's merges rarely cross a split).
"""

import json

import pytest

from tests.engine.conformance.peer import LlamaServer
from tests.ggufgen.gptoss import write_gptoss
from vramd.engine.tokenizer import Tokenizer, _pre_tokenizer
from vramd.model.gguf_check import validate_gguf

SPLITS = [
    ("HelloWorld I'M don't 12345 héllo,\n\nwörld  ",
     ["Hello", "World", " I'M", " don't", " ", "123", "45", " héllo", ",\n\n", "wörld", "  "]),
    ("ABCdef camelCaseXML a/b//\n", ["ABCdef", " camel", "Case", "XML", " a", "/b", "//\n"]),
    ("Ünïcödé ÀB", ["Ünïcödé", " À", "B"]),
    ("x's y'LL", ["x's", " y'LL"]),
]
TEXTS = [t for t, _ in SPLITS] + ["the river ran past the mill; THE RIVER Ran", "  leading\tand\r\n trailing  \n",
                                  "4096 tokens, 1.5x faster?!"]


@pytest.mark.parametrize("text, pieces", SPLITS)
def test_gpt4o_splits(text, pieces):
    assert _pre_tokenizer("gpt4o")(text) == pieces


def test_gpt4o_file_tokenizes_as_llama_cpp(tmp_path):
    path = write_gptoss(tmp_path / "g4o.gguf", weight_type="F32", expert_type="F32", bpe_pre="gpt-4o", n_vocab=512)
    tok = Tokenizer.from_metadata(validate_gguf(path).metadata)
    with LlamaServer(path, ctx=64) as peer:
        for text in TEXTS:
            status, body = peer._request("POST", "/tokenize", {"content": text, "add_special": False})
            assert status == 200
            assert tok.encode(text, add_special=False) == json.loads(body)["tokens"], text


def test_harmony_end_closes_a_message_not_the_answer():
    """llama.cpp (llama-vocab.cpp): a vocabulary with <|return|> and <|call|> is harmony's,
    whose <|end|> ends the analysis message; generation goes on to the final channel."""
    from tests.engine.test_tokenizer import bpe_metadata
    harmony = Tokenizer.from_metadata(bpe_metadata([], specials=("<|start|>", "<|end|>", "<|return|>", "<|call|>")))
    end, ret, call = (harmony.token_id(t) for t in ("<|end|>", "<|return|>", "<|call|>"))
    assert harmony.is_eog(ret) and harmony.is_eog(call) and not harmony.is_eog(end)
    assert harmony.is_control(end)
    phi = Tokenizer.from_metadata(bpe_metadata([], specials=("<|end|>",)))   # Phi-3's <|end|> ends the turn
    assert phi.is_eog(phi.token_id("<|end|>"))
