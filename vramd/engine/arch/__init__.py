"""The registry of architectures: the one place that knows which exist.

    spec = spec_for(mf)        # an ArchSpec, or a ModelError naming the file and what is wrong

The daemon, `vramd plan`, the benches and the tests all ask here.  Adding an
architecture is one builder in a module of this package (a function from
`Hparams` to an `ArchSpec`) and one line in BUILDERS; docs/architecture.md
"Adding an architecture" says what else (its test model writer, its
conformance case).  Nothing here imports the GPU: gguf_check and `vramd plan`
use it before a device is opened.
"""

from __future__ import annotations

from vramd.engine.arch import gemma3, gemma4, gemma4_moe, gptoss, llama, moe, qwen35
from vramd.engine.arch.hparams import REQUIRED_KEYS, Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec, MoESpec
from vramd.errors import ModelError

# general.architecture -> (dense builder, builder when the file has experts)
BUILDERS = {
    "llama": (llama.llama, moe.mixtral),
    "qwen2": (llama.qwen2, None),
    "qwen3": (llama.qwen3, None),
    "gemma3": (gemma3.gemma3, None),
    "gemma2": (gemma3.gemma2, None),
    "gemma4": (gemma4.gemma4, gemma4_moe.gemma4_moe),
    "phi3": (llama.phi3, None),
    "mistral3": (llama.mistral3, None),
    "qwen3moe": (None, moe.qwen3moe),
    "qwen2moe": (None, moe.qwen2moe),
    "qwen35": (qwen35.qwen35, None),
    "qwen35moe": (None, qwen35.qwen35moe),
    "gpt-oss": (None, gptoss.gptoss),
}
ARCHITECTURES = tuple(BUILDERS)
# Architectures whose files are recognised but not run yet: what the engine lacks for them
# (a refusal naming it, before any device is opened).
PENDING: dict[str, str] = {}

__all__ = ["ARCHITECTURES", "ArchSpec", "LayerSpec", "MoESpec", "REQUIRED_KEYS", "spec_for", "supported"]


def supported(arch: str) -> bool:
    return arch in BUILDERS


def spec_for(mf) -> ArchSpec:
    """The spec of a validated model file (gguf_check.ModelFile)."""
    arch = mf.architecture
    if arch in PENDING:
        raise ModelError(f"{mf.path}: architecture {arch!r} is not supported yet: the engine lacks "
                         f"{PENDING[arch]}")
    if arch not in BUILDERS:
        raise ModelError(f"{mf.path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    hp = Hparams(mf)
    dense, routed = BUILDERS[arch]
    build = routed if moe.is_moe(hp) else dense
    if build is None:
        if routed is None:
            raise ModelError(f"{mf.path}: {arch}.expert_count is set: {arch} with experts is not supported")
        raise ModelError(f"{mf.path}: missing {arch}.expert_count ({arch} is a mixture-of-experts architecture)")
    return build(hp)
