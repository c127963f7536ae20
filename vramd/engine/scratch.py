"""The compute scratch a model needs: activation buffers for a chunk of tokens, from its spec.

Owns: `scratch_layout(spec, batch)` ([(name, bytes)] for the residency
`scratch` region: what `vramd serve` allocates and `vramd plan` reports, the
same function for both), `chunk_tokens` (the tokens of a prefill chunk:
`--prefill-chunk` or the spec's default, cut to what one binding holds),
`buffer_cap` (what one binding holds: the device's maxStorageBufferRange
where the scratch is sized for a device, lavapipe's 128 MiB where none is
known) and `logit_rows`.  Light on purpose (no GPU imports), so `vramd plan` sizes a
model without a device.

The scratch region is sized for one chunk and, like every scratch region,
freed when the model goes cold and rebuilt at the next warm-up (vramd/gpu/
residency.py): a larger chunk costs device memory only while warm.
"""

from __future__ import annotations

from vramd.engine import linear
from vramd.errors import UsageError

LOGITS_BYTES = 64 << 20   # the logits buffer: chunks wanting every row's logits are cut to fit it (half lavapipe's range)


BUFFER_BYTES = 128 << 20   # one activation buffer at most where the device is not known (vramd plan):
                           # lavapipe's maxStorageBufferRange, the smallest of the devices known
MAX_CHUNK = 16384          # --prefill-chunk at most


def buffer_cap(limits: dict | None = None) -> int:
    """The most bytes one activation buffer may hold on a device (`Residency.limits`):
    an op binds a whole chunk's rows of it, so one storage binding (maxStorageBufferRange,
    down to the storage alignment, so that it stays one piece: Tensor.views) of one
    allocation.  No device (None, or limits without the range): BUFFER_BYTES."""
    if not limits or "max_storage_range" not in limits:
        return BUFFER_BYTES
    align = max(1, int(limits.get("storage_alignment", 1)))
    cap = int(limits["max_storage_range"]) // align * align
    return min(cap, int(limits.get("max_allocation", cap)))


def chunk_tokens(spec, chunk: int | None = None, cap: int = BUFFER_BYTES) -> int:
    """Tokens per prefill chunk: `chunk` (--prefill-chunk) or the spec's
    default (`spec.batch`), cut so that no activation buffer of the chunk
    (the logits aside: logit_rows cuts those) passes `cap` bytes (buffer_cap
    of the device the scratch is for)."""
    want = int(chunk) if chunk is not None else spec.batch
    if not 1 <= want <= MAX_CHUNK:
        raise UsageError(f"prefill chunk {want}: between 1 and {MAX_CHUNK} tokens")
    one = {n: b for n, b in scratch_layout(spec, 1, cut=False)}
    two = {n: b for n, b in scratch_layout(spec, 2, cut=False)}
    per_token = max(two[n] - one[n] for n in one if n != "logits")
    return max(1, min(want, int(cap) // per_token))


def logit_rows(spec, batch: int) -> int:
    """Token rows of logits the scratch holds (a 262144-token vocabulary makes
    1 MiB per row: a full 256-token chunk's logits would not fit one storage
    binding on lavapipe)."""
    return max(1, min(batch, LOGITS_BYTES // (4 * spec.n_vocab)))


def scratch_layout(spec, batch: int | None = None, *, cut: bool = True,
                   cap: int = BUFFER_BYTES) -> list[tuple[str, int]]:
    """Activation buffers (f32 unless said) for a chunk of `batch` tokens
    (default: the spec's), cut by chunk_tokens (to `cap`) unless cut=False."""
    b = batch or spec.batch
    if cut:
        b = chunk_tokens(spec, b, cap)
    layout = [("x", 4 * b * spec.n_embd), ("h", 4 * b * spec.n_embd), ("q", 4 * b * spec.max_q_width),
              ("k", 4 * b * spec.max_kv_width), ("v", 4 * b * spec.max_kv_width), ("att", 4 * b * spec.max_q_width)]
    if spec.n_ff:   # the widest layer's (gemma4 E-models' double-wide FFNs)
        layout += [("gate", 4 * b * spec.n_ff), ("up", 4 * b * spec.n_ff)]
    if spec.moe:
        layout += _moe_layout(spec, b)
    if spec.attn_gate:   # qwen35's attention: the [query | gate] projection, the gate
        layout += [("qg", 8 * b * spec.q_width), ("agate", 4 * b * spec.q_width)]
    if spec.ple:         # per-layer embeddings (vramd/engine/ple.py): token-major inputs, table rows,
        lp = spec.n_layer * spec.ple   # the gate, a layer's gathered slab, the gather's row numbers
        layout += [("ple_all", 4 * b * lp), ("ple_tok", 4 * b * lp), ("ple_g", 4 * b * spec.ple),
                   ("ple_in", 4 * b * spec.ple), ("ple_idx", 4 * b * spec.n_layer)]
    if spec.deltanet:    # its DeltaNet layers (vramd/engine/deltanet.py)
        d = spec.deltanet
        layout += [("mixed", 4 * b * d.conv_dim), ("conv", 4 * b * d.conv_dim), ("z", 4 * b * d.value_dim),
                   ("alpha", 4 * b * d.hv), ("beta", 4 * b * d.hv), ("dno", 4 * b * d.value_dim)]
    # pos: the rows' positions, then their sequence ids (one binding for the kernels that read both)
    return layout + [("logits", 4 * logit_rows(spec, b) * spec.n_vocab), ("ids", 4 * b), ("pos", 8 * b)]


def _moe_layout(spec, b: int) -> list[tuple[str, int]]:
    """The MoE layers' buffers (vramd/engine/moe.py)."""
    moe, e = spec.moe, spec.n_embd
    f = max(moe.n_ff_exp, moe.n_ff_shexp or 0)
    slots = b * moe.n_used    # (token, chosen expert) pairs of a chunk
    return [("router", 4 * b * moe.n_expert), ("g1", 4 * f), ("u1", 4 * f), ("tmp", 4 * e), ("cpu", 4 * b * e),
            ("shexp", 4 * b * e), ("part", 4 * slots * moe.n_ff_exp), ("shgate", 4 * b),
            # GPU-routed layers: the routing (expert ids, weights), each slot's gate, up and down
            # outputs, the shared expert's gate and up (qwen2moe)
            ("route_ids", 4 * slots), ("route_w", 4 * slots), ("eg", 4 * slots * moe.n_ff_exp),
            ("eu", 4 * slots * moe.n_ff_exp), ("ed", 4 * slots * e), ("sg", 4 * b * max(moe.n_ff_shexp, 1)),
            ("su", 4 * b * max(moe.n_ff_shexp, 1)),
            # prefill's grouped expert matmuls: the slots sorted by expert and their tiles (moe_group)
            ("route_groups", 4 * linear.group_words(slots, moe.n_expert, linear.MATMUL_TOKENS))] + (
        # gemma4 (vramd/engine/moe_beside.py): the router's input, the experts' sum before its norm
        [("hr", 4 * b * e), ("mo", 4 * b * e)] if moe.dense_beside else [])
