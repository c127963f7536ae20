"""Fill-in-the-middle prompts: the vocabulary's FIM tokens and the infill prompt built from them.

Owns `FimTokens` (`find(metadata, tokenizer)`: the prefix, suffix and middle
tokens, or which are missing) and `FimTokens.prompt(prefix, suffix)`, the
token ids a `/v1/completions` request with `suffix` continues.

Where the tokens come from, as llama.cpp's src/llama-vocab.cpp finds them:
  1. tokenizer.ggml.fim_pre_token_id / fim_suf_token_id / fim_mid_token_id;
  2. the older tokenizer.ggml.prefix_token_id / suffix_token_id /
     middle_token_id, read after them (so where a file has both, these win,
     as in llama.cpp); an id outside the vocabulary is ignored;
  3. for each one still missing, a token whose text is one of the spellings
     llama.cpp looks for (TEXTS below: Qwen's <|fim_prefix|>, Granite's,
     DeepSeek's, CodeLlama's <PRE> / ▁<PRE>, GLM-4.5's, ...), the first in
     that list the vocabulary has.

The prompt is llama.cpp's /infill (tools/server format_prompt_infill) in PSM
order for a request with no extra context: [BOS if the vocabulary adds one]
FIM_PRE prefix FIM_SUF suffix FIM_MID, the texts tokenized without specials
(add_special and parse_special off, as llama.cpp's tokenize_mixed there), the
model then writes the middle.  The OpenAI `prompt` is the prefix (llama.cpp's
input_prefix; its separate `prompt`, appended to the prefix, is empty).  Not
done: llama.cpp's repository-level header (FIM_REP "myproject\\n" FIM_SEP
"filename\\n", its placeholder names, for vocabularies with those tokens) and
its cut of long prefixes and suffixes to a batch: a FIM prompt longer than
the context is a 400, never cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramd.errors import UsageError

KEYS = {"pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
        "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
        "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id")}
TEXTS = {"pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                 "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
         "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                 "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
         "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                 "\u2581<MID>", "<|code_middle|>", "<|middle|>")}
NAMES = {"pre": "prefix (FIM_PRE)", "suf": "suffix (FIM_SUF)", "mid": "middle (FIM_MID)"}


@dataclass(frozen=True)
class FimTokens:
    pre: int | None
    suf: int | None
    mid: int | None

    @classmethod
    def find(cls, metadata, tokenizer) -> "FimTokens":
        if tokenizer is None:
            return cls(None, None, None)
        n = len(tokenizer.tokens)
        found: dict[str, int | None] = {}
        for role, keys in KEYS.items():
            tid = None
            for key in keys:   # the deprecated key last: it wins where both are set
                v = metadata.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                    tid = v
            if tid is None:
                tid = next((t for t in map(tokenizer.token_id, TEXTS[role]) if t is not None), None)
            found[role] = tid
        return cls(**found)

    def missing(self) -> list[str]:
        return [NAMES[role] for role in ("pre", "suf", "mid") if getattr(self, role) is None]

    def prompt(self, tokenizer, prefix: str | list[int], suffix: str) -> list[int]:
        """The infill prompt's ids (a UsageError naming the tokens the vocabulary lacks)."""
        missing = self.missing()
        if tokenizer is None or missing:
            what = "has no vocabulary" if tokenizer is None else \
                f"has no fill-in-the-middle token for the {', '.join(missing)}"
            raise UsageError(f"'suffix' needs fill-in-the-middle tokens and this model {what} "
                             f"(looked for {', '.join(KEYS['pre'][:1] + KEYS['suf'][:1] + KEYS['mid'][:1])} "
                             "and the token texts llama.cpp knows)")
        pre = list(prefix) if isinstance(prefix, list) else \
            tokenizer.encode(prefix, add_special=False, parse_special=False)
        ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
        return ids + [self.pre] + pre + [self.suf] + \
            tokenizer.encode(suffix, add_special=False, parse_special=False) + [self.mid]

    def fit(self, tokenizer, prefix: str | list[int], suffix: str, ctx: int) -> list[int]:
        """prompt() for a context of ctx tokens: a text that cannot fit is refused before it is
        tokenized (a token covers at most the vocabulary's longest piece), a prompt that does not
        leave a token of room is refused after; neither is ever cut."""
        longest = max((len(t) for t in tokenizer.tokens), default=1) if tokenizer is not None else 1
        for text, what in ((prefix, "prompt"), (suffix, "suffix")):
            if isinstance(text, str) and len(text) > ctx * longest:
                raise UsageError(f"the '{what}' has {len(text)} characters: more than the context of {ctx} "
                                 "tokens (--ctx) can hold")
        ids = self.prompt(tokenizer, prefix, suffix)
        if len(ids) >= ctx:
            raise UsageError(f"the fill-in-the-middle prompt has {len(ids)} tokens; the context holds {ctx} "
                             "(--ctx): a prompt with a 'suffix' is never cut")
        return ids
