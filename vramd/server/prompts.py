"""A request's prompt made before it rings: validated, rendered and tokenized off the loop.

Owns `prepare()`: everything about a generation request that can be judged
without the device, on the HTTP thread, before the request is queued for
the loop (and so before a cold daemon rings its peer or uploads a byte):
the sampling settings (through the engine's own `SamplingParams`, so the
checks are the engine's), the chat template's rendering (its refusals), the
tokens (out-of-vocabulary ids, a prompt longer than the context), and for
images what needs no encoder (an image without `--mmproj`, a template
that drops one), and for tools and response_format the grammar, checked
against the vocabulary (vramd/server/tools.py).  A bad request is a UsageError, a 400, that has cost the
GPU nothing.

Tokenizing is bounded by size first: a piece of the vocabulary covers at
most its own length in characters, so a text longer than ctx x the longest
piece cannot fit in the context whatever its tokens; it is refused without
tokenizing it (a 31 MB prompt took 86 s on the loop thread before).
"""

from __future__ import annotations

from dataclasses import replace

from vramd.engine.chat import MEDIA_MARKER
from vramd.engine.prompt import check_token_ids
from vramd.engine.sampler import SamplingParams
from vramd.errors import UsageError
from vramd.server import tools
from vramd.server.openai_api import GenerationRequest


def longest_piece(tokenizer) -> int:
    return max((len(t) for t in tokenizer.tokens), default=1) if tokenizer is not None else 1


def check_length(text: str, ctx: int, piece_chars: int, what: str) -> None:
    """Refuse, without tokenizing, a text that cannot fit in `ctx` tokens."""
    if len(text) > ctx * max(piece_chars, 1):
        raise UsageError(f"the {what} has {len(text)} characters: more than the context of {ctx} tokens "
                         f"(--ctx) can hold with this vocabulary (at most {piece_chars} characters a token): "
                         "shorten it, or start the daemon with --context-overflow truncate-oldest")


def prepare(engine, req: GenerationRequest,
            has_encoder: bool) -> tuple[SamplingParams, list[int] | None, dict | None]:
    """Validate `req`: its SamplingParams (the engine's own checks: seed range, NaN, stop
    strings) and its token ids (None for an image prompt: its ids and embeddings need the
    encoder, on the loop), as the context takes them under --context-overflow, with what was
    dropped (None: nothing).  Raises UsageError (400) for anything the loop would refuse."""
    sampling = req.sampling()
    # Tools and response_format first: they change the messages and the template's variables.
    grammar, special = tools.plan(engine.tokenizer, engine.template, req)
    if grammar is not None or special:
        sampling = replace(sampling, grammar=grammar, special_text=special)
    n_vocab = engine.spec.n_vocab
    outside = [t for t, _ in sampling.logit_bias if t >= n_vocab]
    if outside:
        raise UsageError(f"logit_bias: token id {outside[0]} is outside the vocabulary (0..{n_vocab - 1})")
    ids, dropped = _ids(engine, req, has_encoder)
    return sampling, ids, dropped


def _ids(engine, req: GenerationRequest, has_encoder: bool) -> tuple[list[int] | None, dict | None]:
    ctx, piece_chars = engine.ctx, longest_piece(engine.tokenizer)
    prompt = req.prompt_input()
    cuts = engine.overflow != "error"   # a longer prompt is cut, not refused
    if req.suffix is not None:   # fill-in-the-middle (vramd/engine/fim.py): built from the FIM tokens, never cut
        if isinstance(req.prompt, list):
            check_token_ids(req.prompt, engine.spec.n_vocab, "prompt: ")
        return engine.fim.fit(engine.tokenizer, req.prompt, req.suffix, ctx), None
    if req.kind == "chat" and engine.template is not None:
        for i, m in enumerate(req.messages):
            check_length(m["content"] or "", ctx, piece_chars, f"content of messages[{i}]")
        text = engine.template.render(req.messages, add_generation_prompt=True,
                                      **req.template_kwargs)   # its refusals: 400
        if not cuts or req.images:
            check_length(text, ctx, piece_chars, "rendered chat prompt")
        if req.images:
            if not has_encoder:
                raise UsageError("this model has no vision encoder: start it with --mmproj to send images")
            if len(text.split(MEDIA_MARKER)) != len(req.images) + 1:
                raise UsageError("the chat template dropped or repeated an image")
            return None, None
    elif req.images:   # a chat without a template
        raise UsageError("this model has no vision encoder: start it with --mmproj to send images"
                         if not has_encoder else "this model has no chat template or tokenizer for an image prompt")
    elif isinstance(req.prompt, str):
        if cuts:
            # Only the newest ctx x piece_chars characters can be among the tokens kept: the
            # rest is dropped before tokenizing (bounded, as the refusal is).
            prompt = replace(prompt, prompt=req.prompt[-ctx * max(piece_chars, 1):])
        else:
            check_length(req.prompt, ctx, piece_chars, "prompt")
    return engine.fit(prompt, req.max_tokens)
