"""Synthetic GGUF files for the tests: one writer package.

Shared pieces
    common.py   the random streams (one per tensor) and the logit scale
    quant.py    weight types, general.file_type, add_tensor, the K-quant quantizer
    vocab.py    the SentencePiece and GPT-2 BPE vocabularies learned from one corpus,
                the chat templates (templates/qwen3.jinja: Qwen3's own), write_vocab
One module per model family
    llama.py    llama / mistral-style / qwen2 / qwen3 (write_llama)
    gemma3.py   gemma3 (write_gemma3)
    moe.py      qwen3moe / qwen2moe / mixtral (write_moe)
    qwen35.py   qwen35: Gated DeltaNet + gated attention (write_qwen35)
    vision.py   mmproj vision projectors (write_mmproj)
    check.py    tiny models of any type mix and byte-level surgery on valid files,
                for the GGUF checker's tests (write_model, GGUFImage)
Same arguments, same bytes, for every writer.  vramd/bench/models.py and
vision_models.py write the benches' models (vramd cannot import tests).
"""
