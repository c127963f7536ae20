"""The numpy references: what the engine (and llama.cpp, tests/engine/test_conformance.py)
is checked against, one library independent of vramd's engine.

    common.py   dequantization, RMSNorm, RoPE, SiLU, the K/V cache, the metadata
                reader and the shared attention hyper-parameters, tensor taking
    llama.py    llama / mistral / qwen2 / qwen3 (ReferenceModel), and the
                specification the others refer to (layouts, RoPE, precision)
    gemma3.py   gemma3 (Gemma3Reference)
    moe.py      qwen3moe / qwen2moe / mixtral (ReferenceMoE), routing margins
    qwen35.py   qwen35 (Qwen35Reference): Gated DeltaNet (recurrent and chunked forms) + gated attention
    vision.py   mmproj vision encoders (ReferenceVision)
    embed.py    embeddings: the final-normed rows pooled and normalised
Nothing here imports vramd.engine.
"""
