#!/usr/bin/env python3
"""Write the fuzz corpus: small valid seeds and one malformed file per case.

    python tests/fuzz/make_corpus.py [DIR]        (default: tests/fuzz/corpus)

The files are committed (tests/fuzz/corpus/); this script is how they were
made, so a case can be re-made or added.  Same gguf package, same bytes.
The bugs the fuzzer found are made here too (bug-*.gguf, BUG_CASES: each
made again by hand on the smallest seed that shows it, rather than kept as
the fuzzer's unreadable input).  tests/fuzz/test_corpus.py says what vramd
must answer for each file, and tests/fuzz/README.md lists them by case.

Seeds (valid: every stage of tests/fuzz/loadpath.py accepts them):
  seed-llama-spm.gguf      llama, SentencePiece vocabulary, chat template, F32/F16
  seed-qwen2-bpe.gguf      qwen2, GPT-2 BPE vocabulary with merges, tied output
  seed-gemma3.gguf         gemma3: sliding window, soft-capping, key/value lengths
  seed-qwen3moe.gguf       qwen3moe: expert tensors ([n_embd, n_ff, n_expert])
  seed-mmproj-mlp.gguf     LLaVA-style projector (clip, mlp)
  seed-mmproj-gemma3.gguf  Gemma 3 projector (clip, gemma3)
The malformed files are edits of seed-llama-spm.gguf (models) or of the
projector seeds (mmproj-*), made with tests/model/ggufgen.py's GGUFImage.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.engine.models_vision import write_mmproj  # noqa: E402
from tests.model.ggufgen import GGUFImage, enc_kv, enc_string, enc_tensor_info, patch  # noqa: E402

U64_MAX = (1 << 64) - 1
E, FF, HEADS, LAYERS = 8, 8, 2, 1

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA2 = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' "
          "+ message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
          "{% endfor %}")


# --- seeds ---------------------------------------------------------------------------

def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(name.encode()))


def _spm_vocab(w: gguf.GGUFWriter, extra: list[str] = ()) -> None:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in (0x0A, 0x20, 0x41)]
    types = [2, 3, 3, 6, 6, 6]
    for p in ["\u2581", "a", "b", "\u2581a", "\u2581b", "ab", "\u2581ab", *extra]:
        pieces.append(p)
        types.append(3 if p.startswith("<") else 1)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([-float(i) for i in range(len(pieces))])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def _bpe_vocab(w: gguf.GGUFWriter) -> None:
    pieces = ["a", "b", "c", "\u0120", "\u0120a", "ab", "\u0120ab", "abc", "<|im_start|>", "<|im_end|>",
              "<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(pieces)
    w.add_token_types([1] * 8 + [3, 3, 3])
    w.add_token_merges(["\u0120 a", "a b", "\u0120a b", "ab c"])
    w.add_bos_token_id(10)
    w.add_eos_token_id(9)
    w.add_add_bos_token(False)


def _llama_tensors(w: gguf.GGUFWriter, n_vocab: int, tied: bool = False, head_dim: int = E // HEADS,
                   n_head_kv: int = HEADS, ffn: bool = True) -> None:
    def add(name: str, shape: tuple[int, ...], f16: bool) -> None:
        x = _rng(name).standard_normal(shape).astype(np.float16 if f16 else np.float32)
        w.add_tensor(name, x)

    add("token_embd.weight", (n_vocab, E), True)
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (E,), False)
        add(p + "attn_q.weight", (HEADS * head_dim, E), True)
        add(p + "attn_k.weight", (n_head_kv * head_dim, E), True)
        add(p + "attn_v.weight", (n_head_kv * head_dim, E), True)
        add(p + "attn_output.weight", (E, HEADS * head_dim), True)
        add(p + "ffn_norm.weight", (E,), False)
        if ffn:
            add(p + "ffn_gate.weight", (FF, E), True)
            add(p + "ffn_up.weight", (FF, E), True)
            add(p + "ffn_down.weight", (E, FF), True)
    add("output_norm.weight", (E,), False)
    if not tied:
        add("output.weight", (n_vocab, E), True)


def _hparams(w: gguf.GGUFWriter, n_head_kv: int = HEADS) -> None:
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def seed_llama_spm(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("fuzz-seed-llama")
    _hparams(w)
    _spm_vocab(w)
    w.add_chat_template(LLAMA2)
    _llama_tensors(w, n_vocab=13)
    _finish(w)


def seed_qwen2_bpe(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "qwen2")
    _hparams(w)
    _bpe_vocab(w)
    w.add_chat_template(CHATML)
    _llama_tensors(w, n_vocab=11, tied=True)
    _finish(w)


def seed_gemma3(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "gemma3")
    _hparams(w, n_head_kv=1)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_sliding_window(4)
    w.add_final_logit_softcapping(30.0)
    _spm_vocab(w, ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"])
    _llama_tensors(w, n_vocab=17, tied=True, n_head_kv=1)
    _finish(w)


def seed_qwen3moe(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    _hparams(w, n_head_kv=1)
    w.add_expert_count(2)
    w.add_expert_used_count(1)
    w.add_expert_feed_forward_length(FF)
    _bpe_vocab(w)
    _llama_tensors(w, n_vocab=11, n_head_kv=1, ffn=False)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "ffn_gate_inp.weight", _rng(p + "r").standard_normal((2, E)).astype(np.float32))
        for kind, shape in (("gate", (2, FF, E)), ("up", (2, FF, E)), ("down", (2, E, FF))):
            name = f"{p}ffn_{kind}_exps.weight"
            w.add_tensor(name, _rng(name).standard_normal(shape).astype(np.float16))
        for norm in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"{p}{norm}.weight", np.ones(E // HEADS, np.float32))
    _finish(w)


def seed_mmproj(path: Path, projector: str) -> None:
    # n_ff != n_embd: llama.cpp's legacy ffn_up/ffn_down rule cannot tell them apart otherwise.
    write_mmproj(path, projector, image_size=4, patch_size=2, n_embd=4, n_head=2,
                 n_layer=2 if projector == "mlp" else 1, n_ff=8, n_embd_text=E, weight_type="F32")


SEEDS = {
    "seed-llama-spm.gguf": seed_llama_spm,
    "seed-qwen2-bpe.gguf": seed_qwen2_bpe,
    "seed-gemma3.gguf": seed_gemma3,
    "seed-qwen3moe.gguf": seed_qwen3moe,
    "seed-mmproj-mlp.gguf": lambda p: seed_mmproj(p, "mlp"),
    "seed-mmproj-gemma3.gguf": lambda p: seed_mmproj(p, "gemma3"),
}


# --- malformed files -------------------------------------------------------------------

TOKENS, SCORES, TTYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"
NORMS = ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")
Q_W, K_W = "blk.0.attn_q.weight", "blk.0.attn_k.weight"


def _value_at(key: str) -> int:
    """Offset, in a key's raw entry, of the bytes after its type tag."""
    return 8 + len(key.encode()) + 4


def _patch_kv(im: GGUFImage, key: str, at: int, fmt: str, value) -> None:
    i = im.kv_index(key)
    im.kvs[i] = (key, patch(im.kvs[i][1], at, fmt, value))


def _tensor(im: GGUFImage, tensor_name: str, **changes) -> None:
    t = im.tensor(tensor_name)
    for k, v in changes.items():
        setattr(t, k, v)


def _nested(depth: int) -> bytes:
    body = struct.pack("<IQ", V.ARRAY, 1) * depth + struct.pack("<IQ", V.UINT8, 0)
    return enc_string("test.nested") + struct.pack("<I", V.ARRAY) + body


def _array_of_strings_2_63() -> bytes:
    # The gguf-py reader loops `for idx in range(alen[0])` reading past the end: a hang.
    return enc_string("test.strings") + struct.pack("<IIQ", V.ARRAY, V.STRING, 1 << 63) + enc_string("x")


# (file name, seed it edits, edit)
MODEL_CASES = [
    # counts
    ("cve-2024-21836-huge-tensor-count.gguf", lambda im: setattr(im, "tensor_count", 1 << 63)),
    ("cve-2024-21836-tensor-count-beyond-file.gguf", lambda im: setattr(im, "tensor_count", 60000)),
    ("cve-2024-23605-huge-kv-count.gguf", lambda im: setattr(im, "kv_count", U64_MAX)),
    ("cve-2024-23605-kv-count-beyond-file.gguf", lambda im: setattr(im, "kv_count", 50000)),
    # strings
    ("cve-2024-23496-string-length.gguf",
     lambda im: _patch_kv(im, "general.name", _value_at("general.name"), "<Q", 1 << 63)),
    ("cve-2024-23496-key-length.gguf", lambda im: _patch_kv(im, "general.architecture", 0, "<Q", U64_MAX)),
    ("cve-2024-23496-string-beyond-file.gguf",
     lambda im: _patch_kv(im, "general.name", _value_at("general.name"), "<Q", 1 << 20)),
    ("cve-2024-23496-tensor-name-length.gguf",
     lambda im: _tensor(im, Q_W, raw=struct.pack("<Q", 1 << 40) + b"x")),
    # arrays
    ("cve-2024-21825-array-count.gguf", lambda im: _patch_kv(im, SCORES, _value_at(SCORES) + 4, "<Q", 1 << 63)),
    ("cve-2024-21825-array-count-beyond-file.gguf",
     lambda im: _patch_kv(im, SCORES, _value_at(SCORES) + 4, "<Q", 1 << 24)),
    ("gguf-py-hang-string-array-length-2^63.gguf", lambda im: im.set_kv_raw("test.strings", _array_of_strings_2_63())),
    ("gguf-py-recursion-nested-arrays.gguf", lambda im: im.set_kv_raw("test.nested", _nested(2000))),
    ("nested-arrays-3-deep.gguf", lambda im: im.set_kv_raw("test.nested", _nested(3))),
    # dimensions
    ("cve-2024-21802-n-dims-huge.gguf",
     lambda im: _tensor(im, Q_W, raw=enc_tensor_info(Q_W, [E, E], Q.F16, 0, n_dims=0xFFFFFFFF))),
    ("cve-2024-21802-n-dims-5.gguf",
     lambda im: _tensor(im, Q_W, raw=enc_tensor_info(Q_W, [E, E, 1, 1, 1], Q.F16, 0))),
    ("dims-zero.gguf", lambda im: _tensor(im, Q_W, dims=[E, 0])),
    ("dims-negative.gguf", lambda im: _tensor(im, Q_W, dims=[E, U64_MAX])),
    ("dims-product-overflow.gguf", lambda im: _tensor(im, Q_W, dims=[1 << 32, 1 << 32])),
    ("cve-2026-33298-byte-size-overflow.gguf", lambda im: _tensor(im, "output_norm.weight", dims=[1 << 62])),
    ("cve-2025-53630-cumulative-size-overflow.gguf",
     lambda im: [_tensor(im, n, dims=[1 << 60]) for n in NORMS]),
    # one tensor of 2^63 - 32 bytes: its own size fits int64, padded to the alignment it does not
    ("cve-2026-27940-padded-size-overflow.gguf",
     lambda im: _tensor(im, "output_norm.weight", raw_type=Q.I8, dims=[(1 << 63) - 32 + 1])),
    # alignment
    ("alignment-zero.gguf", lambda im: im.set_kv("general.alignment", V.UINT32, 0)),
    ("alignment-not-power-of-two.gguf", lambda im: im.set_kv("general.alignment", V.UINT32, 48)),
    ("alignment-wrap-2^31.gguf", lambda im: im.set_kv("general.alignment", V.UINT32, 1 << 31)),
    ("alignment-wrong-type-uint64.gguf", lambda im: im.set_kv("general.alignment", V.UINT64, 32)),
    ("alignment-wrong-type-string.gguf", lambda im: im.set_kv("general.alignment", V.STRING, "32")),
    # tensor types
    ("tensor-type-negative.gguf", lambda im: _tensor(im, Q_W, raw_type=0xFFFFFFFF)),
    ("tensor-type-out-of-range.gguf", lambda im: _tensor(im, Q_W, raw_type=9999)),
    ("tensor-type-removed-q4_2.gguf", lambda im: _tensor(im, Q_W, raw_type=4)),
    # duplicates
    ("duplicate-key.gguf", lambda im: im.kvs.append(im.kvs[im.kv_index("general.name")])),
    ("duplicate-tensor-name.gguf", lambda im: _tensor(im, K_W, name=Q_W)),
    # offsets
    ("offset-out-of-bounds.gguf", lambda im: _tensor(im, "output.weight", offset=1 << 20)),
    ("offset-wraps-64-bits.gguf", lambda im: _tensor(im, "output.weight", offset=U64_MAX - 31)),
    ("offset-misaligned.gguf", lambda im: _tensor(im, Q_W, offset=im.tensor(Q_W).offset + 2)),
    ("offset-overlapping.gguf", lambda im: _tensor(im, K_W, offset=im.tensor(Q_W).offset + 32)),
    ("data-truncated.gguf", lambda im: setattr(im, "data", im.data[:-64])),
    # tokenizer
    ("cve-2025-49847-token-piece-length.gguf",
     lambda im: im.set_kv(TOKENS, V.ARRAY, ["<unk>", "<s>", "</s>"] + ["a" * 4000] + [f"t{i}" for i in range(9)],
                          V.STRING)),
    ("vocab-tokens-not-strings.gguf", lambda im: im.set_kv(TOKENS, V.ARRAY, list(range(13)), V.INT32)),
    ("vocab-scores-wrong-type.gguf", lambda im: _patch_kv(im, SCORES, _value_at(SCORES), "<I", V.INT32)),
    ("vocab-token-type-wrong-type.gguf", lambda im: im.set_kv(TTYPES, V.ARRAY, [1.0] * 13, V.FLOAT32)),
    ("vocab-scores-short.gguf", lambda im: im.set_kv(SCORES, V.ARRAY, [0.0] * 12, V.FLOAT32)),
    ("vocab-token-type-unknown.gguf", lambda im: im.set_kv(TTYPES, V.ARRAY, [1] * 12 + [99], V.INT32)),
    ("vocab-bos-id-not-integer.gguf", lambda im: im.set_kv("tokenizer.ggml.bos_token_id", V.STRING, "1")),
    ("vocab-duplicate-piece.gguf",
     lambda im: im.set_kv(TOKENS, V.ARRAY, ["<unk>", "<s>", "</s>", "<0x0A>", "<0x20>", "<0x41>", "\u2581",
                                            "a", "a", "\u2581a", "\u2581b", "ab", "\u2581ab"], V.STRING)),
    # header and metadata
    ("bad-magic.gguf", lambda im: setattr(im, "magic", b"GGML")),
    ("version-big-endian.gguf", lambda im: setattr(im, "version", 3 << 24)),
    ("key-not-utf8.gguf", lambda im: im.kvs.append(("x", enc_kv(b"bad\xff", V.UINT8, 1)))),
    ("value-type-unknown.gguf",
     lambda im: _patch_kv(im, "general.name", 8 + len(b"general.name"), "<I", 0xFFFFFFFF)),
    ("missing-architecture.gguf", lambda im: im.drop_kv("general.architecture")),
    ("block-count-huge.gguf", lambda im: im.set_kv("llama.block_count", V.UINT64, U64_MAX)),
    ("version-1.gguf", lambda im: setattr(im, "version", 1)),
    ("key-empty.gguf", lambda im: im.kvs.insert(0, ("", enc_kv("", V.UINT8, 1)))),
    ("bool-not-0-or-1.gguf",
     lambda im: im.kvs.append(("test.flag", enc_string("test.flag") + struct.pack("<IB", V.BOOL, 2)))),
    ("token-not-utf8.gguf", lambda im: im.set_kv(TOKENS, V.ARRAY, [b"<unk>", b"\xfe"] + [b"t%d" % i for i in range(11)],
                                                 V.STRING)),
    ("architecture-not-string.gguf", lambda im: im.set_kv("general.architecture", V.UINT32, 1)),
    ("required-key-float.gguf", lambda im: im.set_kv("llama.embedding_length", V.FLOAT32, 8.0)),
    ("vocab-scores-without-tokens.gguf", lambda im: im.drop_kv(TOKENS)),
    ("tensor-name-empty.gguf", lambda im: _tensor(im, Q_W, name="")),
    ("tensor-row-not-block-multiple.gguf", lambda im: _tensor(im, Q_W, raw_type=Q.Q8_0)),
    # valid: a special token id outside the vocabulary is dropped with a warning, as llama.cpp does
    ("special-token-outside-vocab.gguf", lambda im: im.set_kv("tokenizer.ggml.eos_token_id", V.UINT32, 1000)),
    # valid: arrays of arrays, two levels deep
    ("nested-arrays-2-deep.gguf", lambda im: im.set_kv_raw("test.nested", _nested(1))),
]

# Bytes cut or replaced outright.
RAW_CASES = [
    ("empty-file.gguf", lambda raw: b""),
    ("truncated-header.gguf", lambda raw: raw[:700]),
    ("not-gguf-text.gguf", lambda raw: b"this is not a model\n" * 4),
]

MMPROJ_CASES = [
    ("mmproj-not-clip.gguf", "mlp", lambda im: im.set_kv("general.architecture", V.STRING, "llava")),
    ("mmproj-no-vision-encoder.gguf", "mlp", lambda im: im.set_kv("clip.has_vision_encoder", V.BOOL, False)),
    ("mmproj-unsupported-projector.gguf", "mlp", lambda im: im.set_kv("clip.projector_type", V.STRING, "ldp")),
    ("mmproj-image-size-huge.gguf", "mlp", lambda im: im.set_kv("clip.vision.image_size", V.UINT32, 0xFFFFFFFF)),
    ("mmproj-patch-count-overflow.gguf", "mlp",
     lambda im: [im.set_kv("clip.vision.image_size", V.UINT32, 4096),
                 im.set_kv("clip.vision.patch_size", V.UINT32, 1)]),
    ("mmproj-image-size-not-patch-multiple.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.patch_size", V.UINT32, 3)),
    ("mmproj-head-count-not-dividing.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.attention.head_count", V.UINT32, 3)),
    ("mmproj-embedding-length-string.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.embedding_length", V.STRING, "4")),
    ("mmproj-eps-nan.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.attention.layer_norm_epsilon", V.FLOAT32, float("nan"))),
    ("mmproj-image-mean-two-values.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.image_mean", V.ARRAY, [0.5, 0.5], V.FLOAT32)),
    ("mmproj-image-std-zero.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.image_std", V.ARRAY, [0.5, 0.0, 0.5], V.FLOAT32)),
    ("mmproj-gelu-and-silu.gguf", "mlp",
     lambda im: [im.set_kv("clip.use_gelu", V.BOOL, True), im.set_kv("clip.use_silu", V.BOOL, True)]),
    ("mmproj-feature-layer-out-of-range.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.feature_layer", V.ARRAY, [1 << 30], V.INT32)),
    ("mmproj-scale-factor-not-dividing.gguf", "gemma3",
     lambda im: im.set_kv("clip.vision.projector.scale_factor", V.UINT32, 3)),
    ("mmproj-missing-tensor.gguf", "mlp",
     lambda im: _tensor(im, "mm.2.weight", name="mm.3.weight")),
    ("mmproj-position-embd-wrong-shape.gguf", "mlp",
     lambda im: _tensor(im, "v.position_embd.weight", dims=[4, 4])),
    ("mmproj-projector-type-missing.gguf", "mlp", lambda im: im.drop_kv("clip.projector_type")),
    ("mmproj-block-count-1-mlp.gguf", "mlp", lambda im: im.set_kv("clip.vision.block_count", V.UINT32, 1)),
    ("mmproj-feature-layers-stacked.gguf", "mlp",
     lambda im: im.set_kv("clip.vision.feature_layer", V.ARRAY, [1, 2], V.INT32)),
    ("mmproj-bias-without-weight.gguf", "mlp", lambda im: _tensor(im, "v.pre_ln.weight", name="v.pre_ln.gain")),
    ("mmproj-ffn-naming-differs.gguf", "mlp",
     lambda im: [im.set_kv("clip.vision.feature_layer", V.ARRAY, [2], V.INT32),
                 _tensor(im, "v.blk.1.ffn_up.weight", name="v.blk.1.ffn_tmp.weight"),
                 _tensor(im, "v.blk.1.ffn_down.weight", name="v.blk.1.ffn_up.weight"),
                 _tensor(im, "v.blk.1.ffn_tmp.weight", name="v.blk.1.ffn_down.weight")]),
    ("mmproj-mm0-wrong-shape.gguf", "mlp", lambda im: _tensor(im, "mm.0.weight", dims=[8, 4])),
    ("mmproj-input-projection-wrong-shape.gguf", "gemma3",
     lambda im: _tensor(im, "mm.input_projection.weight", dims=[4, 8])),
    ("mmproj-array-count-2^63.gguf", "mlp",
     lambda im: _patch_kv(im, "clip.vision.image_mean", _value_at("clip.vision.image_mean") + 4, "<Q", 1 << 63)),
]


# What the fuzzer found (tests/fuzz/README.md): each bug made again by hand, on the smallest seed
# that shows it.  Before the fix each raised the exception named, a traceback out of `vramd serve`.
BUG_CASES = [
    # IndexError: the engine config read token_embd.weight's shape[1]
    ("bug-token-embd-one-dimension.gguf", "seed-llama-spm.gguf",
     lambda im: _tensor(im, "token_embd.weight", dims=[E * 13])),
    # TypeError: 1.0 / factor
    ("bug-rope-scaling-factor-string.gguf", "seed-llama-spm.gguf",
     lambda im: im.set_kv("llama.rope.scaling.factor", V.STRING, "2")),
    # ValueError: float('llama3')
    ("bug-rope-freq-base-string.gguf", "seed-llama-spm.gguf",
     lambda im: im.set_kv("llama.rope.freq_base", V.STRING, "llama3")),
    # TypeError: float() of a list (the MoE config)
    ("bug-moe-rope-freq-base-array.gguf", "seed-qwen3moe.gguf",
     lambda im: im.set_kv("qwen3moe.rope.freq_base", V.ARRAY, [1.0, 2.0], V.FLOAT32)),
    # float buffer sizes: the MoE config took any positive number for a count
    ("bug-moe-head-count-float.gguf", "seed-qwen3moe.gguf",
     lambda im: im.set_kv("qwen3moe.attention.head_count", V.FLOAT32, 2.0)),
    # TypeError: max(int, str) in the MoE scratch layout
    ("bug-moe-shared-ff-length-string.gguf", "seed-qwen3moe.gguf",
     lambda im: im.set_kv("qwen3moe.expert_shared_feed_forward_length", V.STRING, "8")),
    # KV cache of 2^78 bytes handed to the residency core (key_length was unbounded)
    ("bug-key-length-huge-kv-cache.gguf", "seed-llama-spm.gguf",
     lambda im: [im.set_kv("llama.attention.key_length", V.UINT64, 1 << 60),
                 im.set_kv("llama.attention.value_length", V.UINT64, 1 << 60)]),
    # scratch of 2^71 bytes (feed_forward_length was unbounded)
    ("bug-feed-forward-length-huge-scratch.gguf", "seed-llama-spm.gguf",
     lambda im: im.set_kv("llama.feed_forward_length", V.UINT64, 1 << 60)),
    # ValueError: `vramd plan` took max() of the tensor names of a file that holds none
    ("bug-no-tensors.gguf", "seed-llama-spm.gguf",
     lambda im: [setattr(im, "tensors", []), setattr(im, "data", b"")]),
    # RecursionError out of the chat template's compilation
    ("bug-chat-template-nested-too-deep.gguf", "seed-llama-spm.gguf",
     lambda im: im.set_kv("tokenizer.chat_template", V.STRING, "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}")),
]


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in SEEDS.items():
        make(out / name)
        written.append(out / name)
    model = out / "seed-llama-spm.gguf"
    for name, edit in MODEL_CASES:
        im = GGUFImage.from_file(model)
        edit(im)
        written.append(im.write(out / name))
    for name, projector, edit in MMPROJ_CASES:
        im = GGUFImage.from_file(out / f"seed-mmproj-{projector}.gguf")
        edit(im)
        written.append(im.write(out / name))
    raw = model.read_bytes()
    for name, edit in RAW_CASES:
        (out / name).write_bytes(edit(raw))
        written.append(out / name)
    for name, seed, edit in BUG_CASES:
        im = GGUFImage.from_file(out / seed)
        edit(im)
        written.append(im.write(out / name))
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "corpus"
    for p in write_all(target):
        print(f"{p.stat().st_size:8d}  {p.name}")
