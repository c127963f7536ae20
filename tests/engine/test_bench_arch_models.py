"""vramd/bench/arch_models.py: the 2026 models' zero-weight bench files (issue 17).

The full-size files are written (sparse: no data on disk) and validated by
the loader's own checks, their architectures built by the registry with the
real models' geometry, and their sizes compared with the published
figures; a scaled-down gpt-oss and qwen35moe file (F16: the prebuilt
llama-server's CPU backend crashes on quantized files here) loads in
llama.cpp and answers a prompt of token ids.  vramd's bench on the
scaled-down files runs in `vramd bench decode` (docs/benchmarks.md), not
here: a lavapipe pipeline compile of these widths takes minutes.
"""
import os

import numpy as np
import pytest
from click.testing import CliRunner

from vramd.bench.arch_models import PRESETS, shape_for, write_arch_model
from vramd.engine.arch import spec_for
from vramd.engine.tokenizer import Tokenizer
from vramd.errors import UsageError
from vramd.model.gguf_check import validate_gguf

# preset -> published total parameters (billions); for gpt-oss also the size of
# bartowski's openai_gpt-oss-20b-MXFP4.gguf (12.1 GB on its model card).
PARAMS = {"qwen35-27b": 27.0, "qwen35moe-35b-a3b": 35.0, "gptoss-20b": 20.9}


@pytest.mark.parametrize("name,wtype", [("qwen35-27b", "Q4_K"), ("qwen35moe-35b-a3b", "Q8_0"),
                                        ("gptoss-20b", "MXFP4")])
def test_full_size_files_are_the_real_models(tmp_path, name, wtype):
    path = write_arch_model(tmp_path / "m.gguf", shape_for(name), wtype)
    assert os.stat(path).st_blocks * 512 < 64 << 20   # the data is a hole
    mf = validate_gguf(str(path))
    spec = spec_for(mf)
    shape = PRESETS[name]
    params = sum(t.n_elements for t in mf.tensors) / 1e9
    # within 4 %: the published totals count Qwen3.5's vision tower and MTP layer, which a text file lacks
    assert abs(params - PARAMS[name]) / PARAMS[name] < 0.04, params
    assert spec.n_layer == shape.n_layer and spec.n_vocab == shape.n_vocab and spec.n_embd == shape.n_embd
    if name.startswith("qwen35"):
        assert sum(not layer.recurrent for layer in spec.layers) == shape.n_layer // 4
        assert (spec.deltanet.hk, spec.deltanet.hv, spec.deltanet.s) == (shape.hk, shape.hv, shape.s)
    else:
        assert [layer.window for layer in spec.layers[:2]] == [128, 0]   # even layers slide
        assert abs(os.path.getsize(path) / 1e9 - 12.1) < 0.1
    if shape.n_expert:
        assert (spec.moe.n_expert, spec.moe.n_used) == (shape.n_expert, shape.n_used)
    types = {t.name: t.type.name for t in mf.tensors}
    if wtype == "MXFP4":
        assert types["blk.0.ffn_up_exps.weight"] == "MXFP4" and types["blk.0.attn_q.weight"] == "Q8_0"
    if wtype == "Q4_K":
        assert types["output.weight"] == "Q6_K" and types["blk.0.attn_qkv.weight"] == "Q4_K"
    tok = Tokenizer.from_metadata(mf.metadata)
    assert len(tok.tokens) == shape.n_vocab and tok.decode(tok.encode("the model")) == "the model"


def test_scaling_options_and_refusals(tmp_path):
    s = shape_for("qwen35moe-35b-a3b", layers=4, vocab=1024, experts=8)
    assert (s.n_layer, s.n_vocab, s.n_expert, s.n_embd) == (4, 1024, 8, 2048)
    with pytest.raises(UsageError, match="routes to 4 experts"):
        shape_for("gptoss-20b", experts=2)
    with pytest.raises(UsageError, match="has no experts"):
        shape_for("qwen35-27b", experts=8)
    with pytest.raises(UsageError, match="--type MXFP4"):
        write_arch_model(tmp_path / "m.gguf", s, "MXFP4")
    from vramd.bench.decode import command
    res = CliRunner().invoke(command, ["--shape", "small", "--layers", "2"])
    # vramd's CLI prints a UsageError as one line (vramd/cli.py); the bench command raises it
    assert isinstance(res.exception, UsageError) and "only for the 2026 shapes" in str(res.exception)


@pytest.mark.parametrize("name,scale", [("gptoss-20b", dict(layers=2, experts=4)),
                                        ("qwen35moe-35b-a3b", dict(layers=4, experts=8))])
def test_llama_cpp_loads_a_scaled_down_file(tmp_path, name, scale):
    from vramd.bench.llama_server import LlamaServerProcess, find_binary
    binary = find_binary("llama-server-vulkan")
    path = write_arch_model(tmp_path / "m.gguf", shape_for(name, vocab=1024, **scale), "F16")
    ids = [int(x) for x in np.random.default_rng(0).integers(3, 1024, 12)]
    env_flags = ["-ngl", "0", "-c", "64", "-np", "1", "-t", "2"]
    with LlamaServerProcess(binary, path, env_flags, log=tmp_path / "server.log", start_timeout=300) as server:
        _status, chunks = server.stream("/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": False})
    t = chunks[-1].get("timings") or {}
    assert t.get("prompt_n") == len(ids), (chunks[-1], (tmp_path / "server.log").read_text()[-2000:])
