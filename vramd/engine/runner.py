"""Generation: prompt -> tokens -> forward passes -> sampled, streamed pieces.

Owns: `Prompt` (what is to be continued: completion text or token ids, or
chat messages with their images), `Engine` (one model: tokenizer, chat
template, forward pass, the one slot whose tokens' K/V sit in the cache)
and its `generate` loop, which takes sampling parameters (SamplingParams),
not API requests: nothing here knows the wire format.  The KV
cache lives in a residency `state` region, so it survives cold/warm
cycles; a request whose prompt shares a prefix with the tokens already in
the cache does not recompute that prefix (prefix reuse), across switches
too.  Runs on the daemon's loop thread only.  `embed` is the embedding
path (vramd/engine/embed.py): the same layers, the final-normed rows
instead of logits, pooled on the host; `fim` the vocabulary's
fill-in-the-middle tokens (vramd/engine/fim.py).
"""

from __future__ import annotations

import zlib
from typing import Callable

from vramd.engine.arch import spec_for
from vramd.engine.batch import TokenBatch
from vramd.engine.chat import MEDIA_MARKER, ChatTemplate, encode_prompt
from vramd.engine.embed import embedding, pooling_of, rows_needed
from vramd.engine.fim import FimTokens
from vramd.engine.generation import Generation
from vramd.engine.model import TransformerModel
from vramd.engine.overflow import POLICIES, cut_tokens, cut_turns, room_for, shifted, too_long
from vramd.engine.prompt import Prompt, check_token_ids
from vramd.engine.sampler import Piece, SamplingParams
from vramd.engine.tokenizer import Tokenizer
from vramd.errors import ModelError, UsageError

__all__ = ["Engine", "Prompt"]


class Engine:
    def __init__(self, loaded, residency, ctx: int, encoder=None, text=None, overflow: str = "error",
                 pooling: str | None = None, chunk: int | None = None):
        """text: (tokenizer, template) made by text_front() before the load
        (the daemon does, so that a bad vocabulary costs no GPU time); made
        here when not given.  overflow: the --context-overflow policy
        (vramd/engine/overflow.py).  pooling: --pooling (None: the file's).
        chunk: --prefill-chunk, the tokens per prefill chunk the scratch was
        laid out for (None: the spec's default; vramd/engine/scratch.py)."""
        mf = loaded.file
        self.ctx = ctx
        if overflow not in POLICIES:
            raise UsageError(f"context overflow {overflow!r}: one of {', '.join(POLICIES)}")
        self.overflow = overflow
        self.shift_stats = {"shifts": 0, "dropped_tokens": 0}   # of the last generate (policy shift)
        self.encoder = encoder            # a VisionEncoder (--mmproj), or None
        self.tokenizer, self.template = text if text is not None else self.text_front(mf)
        self.spec = spec_for(mf)
        self.pooling = pooling_of(mf, pooling)
        self.fim = FimTokens.find(mf.metadata, self.tokenizer)
        self.model = TransformerModel(loaded, residency, ctx, loaded.scratch, chunk, spec=self.spec)
        # Per sequence (slot) of the cache: the tokens whose K/V it holds (positions 0..), and the
        # tokens its recurrent state's checkpoint holds (qwen35); `cached`/`checkpoint` are
        # sequence 0's, the one-slot path's.  last_used: the step a slot last served (LRU).
        n = self.model.n_seq
        self.seq_cached: list[list[int]] = [[] for _ in range(n)]
        self.seq_checkpoint: list[list[int] | None] = [None] * n
        self.last_used = [0] * n
        self.stats = {"prompt_tokens": 0, "reused_tokens": 0, "generated_tokens": 0}

    @property
    def n_seq(self) -> int:
        return self.model.n_seq

    @property
    def cached(self) -> list[int]:
        return self.seq_cached[0]

    @cached.setter
    def cached(self, tokens: list[int]) -> None:
        self.seq_cached[0] = tokens

    @property
    def checkpoint(self) -> list[int] | None:
        return self.seq_checkpoint[0]

    @checkpoint.setter
    def checkpoint(self, tokens: list[int] | None) -> None:
        self.seq_checkpoint[0] = tokens

    def forget(self) -> None:
        """No prefix reuse for the next request: the K/V cache and a recurrent state's
        checkpoint count as holding nothing (a benchmark's runs each prefill alike)."""
        n = self.n_seq
        self.seq_cached, self.seq_checkpoint, self.last_used = [[] for _ in range(n)], [None] * n, [0] * n

    @staticmethod
    def text_front(mf) -> tuple[Tokenizer | None, ChatTemplate | None]:
        """The model's tokenizer and chat template (None, None without a
        vocabulary); a bad one is a ModelError naming the file."""
        md = mf.metadata
        try:
            tokenizer = Tokenizer.from_metadata(md) if "tokenizer.ggml.model" in md else None
            return tokenizer, (ChatTemplate.from_metadata(md, tokenizer) if tokenizer else None)
        except ModelError as e:
            raise ModelError(f"{mf.path}: {e}") from None

    # -- prompts -------------------------------------------------------------

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise UsageError("this model has no tokenizer in its file: send the prompt as token ids")
        return self.tokenizer

    def _render(self, req: Prompt) -> str:
        return self.template.render(req.messages, add_generation_prompt=True, **req.template_kwargs)

    def prompt(self, req: Prompt) -> tuple[list[int], dict]:
        """The prompt's token ids and, for images, the input embeddings at their positions.

        An image's slots carry negative ids derived from its bytes, so prefix
        reuse tells two images apart and reuses the same one."""
        if not req.images:
            return self.prompt_ids(req), {}
        if self.encoder is None:
            raise UsageError("this model has no vision encoder: start it with --mmproj to send images")
        if self.template is None:
            raise UsageError("this model has no chat template or tokenizer for an image prompt")
        from vramd.model.image import preprocess_image
        pieces = self._render(req).split(MEDIA_MARKER)
        if len(pieces) != len(req.images) + 1:
            raise UsageError("the chat template dropped or repeated an image")
        ids = encode_prompt(self.tokenizer, pieces[0])
        embeds: dict[int, object] = {}
        # Vocabularies with image delimiters (Gemma 3's) get them around the
        # image's embeddings, as llama.cpp's multimodal prompt does.
        begin, end = self.tokenizer.token_id("<start_of_image>"), self.tokenizer.token_id("<end_of_image>")
        for n, (data, text) in enumerate(zip(req.images, pieces[1:])):
            pixels = preprocess_image(data, self.encoder.cfg, label=f"image {n}")
            self.encoder.residency.reset_peak()
            rows = self.encoder.encode(pixels)
            # What this process held on the device at most while encoding: the
            # figure a --vram-budget must cover (status shows the last one).
            self.stats["image_peak_bytes"] = self.encoder.residency.stats()["device_peak"]
            tag = zlib.crc32(data) % (1 << 24)
            if begin is not None and end is not None:
                ids.append(begin)
            for k, row in enumerate(rows):
                embeds[len(ids)] = row
                ids.append(-(2 + tag * 4096 + k))
            if begin is not None and end is not None:
                ids.append(end)
            ids += self.tokenizer.encode(text, add_special=False, parse_special=True)
        if len(ids) >= self.ctx:   # no policy cuts an image prompt: its slots are not turns
            raise too_long(len(ids), self.ctx, "prompt with its images")
        return ids, embeds

    def prompt_ids(self, req: Prompt, max_tokens: int | None = None) -> list[int]:
        return self.fit(req, max_tokens)[0]

    def fit(self, req: Prompt, max_tokens: int | None = None) -> tuple[list[int], dict | None]:
        """The prompt's ids as the context takes them under the overflow policy, and what
        was dropped to make them fit (None: nothing)."""
        ids = self._ids(req)
        # shift makes room while it generates: it cuts only a prompt the context cannot hold,
        # leaving the minimum room; truncate-oldest leaves room for max_tokens.
        room = room_for(self.ctx, None if self.overflow == "shift" else max_tokens)
        fits = len(ids) < self.ctx if self.overflow == "shift" else len(ids) + room <= self.ctx
        if self.overflow == "error" or fits:
            if len(ids) >= self.ctx:
                raise too_long(len(ids), self.ctx)
            return ids, None
        if req.kind == "chat" and self.template is not None:
            def encode(messages):
                return encode_prompt(self.tokenizer, self.template.render(
                    messages, add_generation_prompt=True, **req.template_kwargs))
            ids, dropped = cut_turns(list(req.messages), encode, self.ctx, room)
        else:
            bos = self.tokenizer.bos_id if self.tokenizer is not None and self.tokenizer.add_bos else None
            ids, dropped = cut_tokens(ids, self.ctx, room, bos)
        return ids, dropped and {"policy": self.overflow, **dropped}

    def _ids(self, req: Prompt) -> list[int]:
        if req.kind == "chat":
            text = self._render(req) if self.template else None
            if text is None:
                self._need_tokenizer()
            ids = encode_prompt(self.tokenizer, text)
        elif isinstance(req.prompt, str):
            ids = self._need_tokenizer().encode(req.prompt, add_special=True, parse_special=False)
        else:
            ids = list(req.prompt)
            check_token_ids(ids, self.spec.n_vocab)
        if not ids:
            raise UsageError("the prompt is empty")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def piece_text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.token_to_piece(token).decode("utf-8", errors="replace")

    # -- the loop --------------------------------------------------------------

    def _prefill(self, ids: list[int], embeds: dict | None = None):
        """Run what the cache does not already hold; return the last token's logits."""
        keep = 0
        limit = min(len(self.cached), len(ids) - 1)  # recompute at least one token for its logits
        while keep < limit and self.cached[keep] == ids[keep]:
            keep += 1
        if self.model.kv.recurrent:
            return self._prefill_recurrent(ids, keep, embeds)
        self.cached = self.cached[:keep]
        if embeds:
            rest = {i - keep: v for i, v in embeds.items() if i >= keep}
            logits = self.model.forward(ids[keep:], keep, embeds=rest)
        else:
            logits = self.model.forward(ids[keep:], keep)
        self.cached = list(ids)
        self.stats["prompt_tokens"] += len(ids)
        self.stats["reused_tokens"] += keep
        return logits, keep

    def _prefill_recurrent(self, ids: list[int], keep: int, embeds: dict | None):
        """_prefill with a recurrent state (qwen35), which cannot be cut back to a shared prefix:
        it continues only from where it is (keep == len(cached)) or from the checkpoint, the state
        after the last prefilled prompt but its last token (self.checkpoint: those tokens), when
        that is a prefix of ids; else everything is computed again from position 0.  The
        checkpoint is then taken after ids[:-1] (the same prompt again, or one that continues a
        prompt rather than its reply, resumes there).  docs/architecture.md, "Prefix reuse"."""
        ck = self.checkpoint
        if keep < len(self.cached) or self.model.rec_pos != len(self.cached):   # (a failed batch: -1)
            keep = len(ck) if ck is not None and len(ck) < len(ids) and ids[:len(ck)] == ck else 0
            if keep:
                self.model.restore_checkpoint(keep)
        self.cached = []   # what the state holds is being replaced from here on
        if ck is not None and keep < len(ck):
            # the batch rewrites the attention layers' K/V rows the checkpoint's state goes with:
            # it is gone from here on, even if the batch fails before the new one is taken
            self.checkpoint = None
        embeds = embeds or {}
        body = ids[keep:-1]
        if body:   # no logits wanted: the batch's out rows are none
            batch = TokenBatch.of(body, keep, embeds={i - keep: v for i, v in embeds.items() if keep <= i < len(ids) - 1})
            batch.out = ()
            self.model.forward(batch)
        self.model.save_checkpoint()
        self.checkpoint = list(ids[:-1])
        last = {0: embeds[len(ids) - 1]} if len(ids) - 1 in embeds else None
        logits = self.model.forward(ids[-1:], len(ids) - 1, embeds=last)
        self.cached = list(ids)
        self.stats["prompt_tokens"] += len(ids)
        self.stats["reused_tokens"] += keep
        return logits, keep

    def generate(self, ids: list[int], params: SamplingParams, emit: Callable[[Piece], bool],
                 embeds: dict | None = None) -> str:
        """Generate after `ids` with `params`; `emit` gets each piece and returns False to cancel.

        Returns the finish reason: "stop" (end of generation, a stop
        string, or params.grammar complete), "length" (max_tokens or the context is full), or
        "cancelled" (the client went away).  The per-token work is the Generation's
        (vramd/engine/generation.py), the same that generate_batch steps for several slots.
        """
        gen = Generation(self, ids, params, emit)
        logits, _ = self._prefill(ids, embeds)
        shift = self.overflow == "shift" and not embeds
        self.shift_stats = {"shifts": 0, "dropped_tokens": 0}
        gen.start(None if shift else self.ctx - len(self.cached))
        while (token := gen.take(logits)) is not None:
            if len(self.cached) >= self.ctx:
                if not shift:
                    return gen.end("length")
                logits = self._shift(self.cached + [token])
                continue
            logits = self.model.forward([token], len(self.cached))
            self.cached.append(token)
        return gen.end()

    def embed(self, ids: list[int]) -> "np.ndarray":
        """The L2-normalised embedding [n_embd] of `ids` (positions 0..) under self.pooling.

        Its K/V go where a prefill's would: afterwards the cache holds `ids` (a
        generation whose prompt starts with them reuses them) and nothing of the
        prefix it held before beyond what the two share."""
        if not ids:
            raise UsageError("an embedding input is empty")
        if len(ids) > self.ctx:   # no overflow policy cuts an input: its vector would be of another text
            raise UsageError(f"an embedding input of {len(ids)} tokens: the context holds {self.ctx} (--ctx)")
        self.cached, self.checkpoint = [], None   # rows 0.. are overwritten from here on, whatever happens
        rows = self.model.hidden(ids, rows_needed(self.pooling, len(ids)))
        self.cached = list(ids)
        self.stats["prompt_tokens"] += len(ids)
        return embedding(rows, self.pooling)

    def _shift(self, tokens: list[int]):
        """The context is full: keep the BOS and the newer half of the rest, prefilled again at
        their new positions (overflow.py says why not rotating the cache); the last token's logits."""
        bos = self.tokenizer.bos_id if self.tokenizer is not None else None
        n_keep = 1 if bos is not None and tokens and tokens[0] == bos else 0
        kept = shifted(tokens, n_keep)
        self.shift_stats["shifts"] += 1
        self.shift_stats["dropped_tokens"] += len(tokens) - len(kept)
        logits, _ = self._prefill(kept)
        return logits

    def close(self) -> None:
        self.model.close()
