"""The Megatron-Core GPT model built from an HF checkpoint computes what the HF model computes:
fp32 logits within float rounding, at tensor-parallel 1 and 2 (gloo, on CPU), with torch's fused
attention as its core attention; and its weights, gathered from the ranks, convert back exactly.
Megatron runs in a process of its own (its CPU shims patch torch.cuda)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from loongsage.core.placement import free_port
from loongsage.megatron.layout import Layout
from loongsage.megatron.model import architecture, layer_spec, resolve_layer_spec, rope_base, transformer_engine_error

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_parity_worker.py")


def checkpoint(path: Path, *, tied: bool) -> str:
    build_engine_test_model(path)
    if not tied:  # an untied head of its own
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path))
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
        model.save_pretrained(str(path))
    return str(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,tied", [(1, True), (2, False)])
def test_megatron_logits_match_hf_and_the_weights_convert_back(tmp_path, tp, tied):
    model_dir = checkpoint(tmp_path / "m", tied=tied)
    out = tmp_path / "parity.json"
    run = run_worker(WORKER, model_dir, str(out), str(tp), str(free_port()), timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["core_attention"] == "SDPAAttention"
    assert result["max_abs_logit_diff"] < 2e-5, result  # measured 2.3e-6 (TP=1) and 2.4e-6 (TP=2)
    assert result["round_trip_exact"] is True
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    assert result["local_vocab_rows"] == -(-vocab // tp)


def test_unsupported_models_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"architecture \['GemmaForCausalLM'\] is not supported; allowed: Qwen3ForCausalLM"
    ):
        architecture({"architectures": ["GemmaForCausalLM"]})
    with pytest.raises(
        ValueError,
        match=r"architecture \['DeepseekV4ForCausalLM'\] is not supported \(its "
        r"hyper-connections \(mHC\), compressed sparse attention",
    ):
        architecture({"architectures": ["DeepseekV4ForCausalLM"]})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported yet; allowed: default"):
        rope_base({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    assert rope_base({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == 1e6
    assert rope_base({"rope_theta": 5e5}) == 5e5
    with pytest.raises(ValueError, match="layer_spec='flash'; allowed: auto, te, sdpa, local"):
        layer_spec({"architectures": ["Qwen3ForCausalLM"]}, "flash")


def test_layer_spec_resolves_to_what_runs_here():
    """``auto`` is Transformer Engine's layer only on a GPU where it imports, and never under
    context parallelism; asking for ``te`` where it cannot run is refused in one line."""
    assert resolve_layer_spec("auto", "cpu") == "sdpa"
    assert resolve_layer_spec("local", "cpu") == "local"
    assert resolve_layer_spec("auto", "cuda:0", Layout(cp=2)) == "sdpa"
    with pytest.raises(ValueError, match=r"layer_spec=te on cpu: it runs on GPUs only; allowed: auto, sdpa, local"):
        resolve_layer_spec("te", "cpu")
    with pytest.raises(ValueError, match=r"layer_spec=te on cuda:0: context_parallel is built on the sdpa spec"):
        resolve_layer_spec("te", "cuda:0", Layout(cp=2))
    if transformer_engine_error() is not None:  # this machine: the one line says why
        assert resolve_layer_spec("auto", "cuda:0") == "sdpa"
        with pytest.raises(ValueError, match=r"layer_spec=te on cuda:0: transformer_engine"):
            resolve_layer_spec("te", "cuda:0")


def test_fp8_is_refused_where_it_cannot_run_and_reaches_megatrons_config():
    """``fp8`` (Transformer Engine's FP8 GEMMs in the decoder layers): bad formats and recipes are
    refused in one line, layers other than Transformer Engine's are refused, and Megatron's config
    carries the format and the recipe (built in a process of its own, as Megatron runs here)."""
    import subprocess

    from loongsage.megatron.model import build_gpt, check_fp8

    with pytest.raises(ValueError, match=r"fp8='e5m2'; allowed: hybrid, e4m3, or null \(bf16 GEMMs\)"):
        check_fp8("e5m2", "delayed")
    with pytest.raises(ValueError, match=r"fp8_recipe='current'; allowed: delayed, tensorwise, blockwise, mxfp8"):
        check_fp8("hybrid", "current")
    check_fp8(None, "delayed")
    with pytest.raises(
        ValueError, match=r"fp8='hybrid' runs on Transformer Engine's layers; the layers here are 'sdpa'"
    ):
        build_gpt({"num_hidden_layers": 2}, dtype=torch.bfloat16, spec="sdpa", fp8="hybrid")
    shape = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
    }
    code = (
        "import torch; from loongsage.megatron.model import transformer_config as tc; "
        f"c = tc({shape!r}, dtype=torch.bfloat16, fp8='hybrid', fp8_recipe='tensorwise'); "
        f"p = tc({shape!r}, dtype=torch.bfloat16); print(c.fp8, c.fp8_recipe, p.fp8)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-3:] == ["hybrid", "tensorwise", "None"]
