"""The native engine's fused Triton decode kernels, run in Triton's interpreter on the CPU.

Run by ``test_fused_kernels.py`` in a process of its own (``TRITON_INTERPRET=1`` from the start).
On a GPU the kernels run compiled (``tests/gpu/test_engine_gpu.py``); here the same kernel code is
checked against the HF modules it replaces (bit for bit where it only rounds like them) and the
fused decode step against the torch decode path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _triton_cpu import load_fused  # noqa: E402

from loongsage.core.engine.kv_cache import DecoderRunner  # noqa: E402


@pytest.fixture(scope="module")
def fused():
    return load_fused()


def _qwen3(dtype: torch.dtype, *, qk_norm: bool = True, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    }
    model = (Qwen3ForCausalLM(Qwen3Config(**shape)) if qk_norm else LlamaForCausalLM(LlamaConfig(**shape))).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.eval().requires_grad_(False)


def test_pointwise_kernels_round_like_the_hf_modules_bit_for_bit(fused):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    ops = fused["ops"]
    torch.manual_seed(1)
    rows, hidden = 7, 96
    x, r = torch.randn(rows, hidden, dtype=torch.bfloat16) * 3, torch.randn(rows, hidden, dtype=torch.bfloat16) * 3
    norm = Qwen3RMSNorm(hidden, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.3)
    out, total = ops.add_rms_norm(x, r, norm.weight, 1e-6)
    assert torch.equal(total, x + r) and torch.equal(out, norm(x + r))
    out, total = ops.add_rms_norm(x, None, norm.weight, 1e-6)
    assert torch.equal(total, x) and torch.equal(out, norm(x))
    gate_up = torch.randn(rows, 2 * hidden, dtype=torch.bfloat16) * 3
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:])

    heads, kv, dim, length = 4, 2, 16, 10
    qkv = torch.randn(rows, (heads + 2 * kv) * dim, dtype=torch.bfloat16) * 2
    angles = torch.rand(rows, dim // 2) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    cols = torch.randint(0, length, (rows,))
    q_all, k_all = qkv[:, : heads * dim].view(rows, heads, dim), qkv[:, heads * dim : (heads + kv) * dim]
    v_all = qkv[:, (heads + kv) * dim :].view(rows, kv, dim)
    for with_norm in (True, False):  # Qwen3's per-head q/k norm, and a Llama without one
        q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6).to(torch.bfloat16), Qwen3RMSNorm(dim, eps=1e-6).to(torch.bfloat16)
        q_norm.weight.data.normal_(1, 0.3)
        k_norm.weight.data.normal_(1, 0.3)
        k_cache = torch.full((rows + 1, kv, length, dim), float("nan"), dtype=torch.bfloat16)
        v_cache = k_cache.clone()
        q = ops.qk_rope_store(
            qkv,
            heads,
            kv,
            q_norm.weight if with_norm else None,
            k_norm.weight if with_norm else None,
            1e-6,
            cos,
            sin,
            k_cache,
            v_cache,
            cols,
        )
        want_q = q_norm(q_all) if with_norm else q_all
        want_k = k_norm(k_all.view(rows, kv, dim)) if with_norm else k_all.view(rows, kv, dim)
        want_q, want_k = apply_rotary_pos_emb(want_q.transpose(0, 1), want_k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
        assert torch.equal(q, want_q.transpose(0, 1))
        at = torch.arange(rows)
        assert torch.equal(k_cache[at, :, cols], want_k.transpose(0, 1)) and torch.equal(v_cache[at, :, cols], v_all)
        written = torch.zeros(rows + 1, length, dtype=torch.bool)
        written[at, cols] = True
        assert k_cache.isnan().all(-1).all(1).eq(~written).all(), "a store outside the rows' own columns"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("programs", [1, 1024])  # one program per (row, kv head), or the columns split
def test_decode_attention_reads_each_rows_own_columns(fused, dtype, programs, monkeypatch):
    attention = fused["attention"]
    splits_for = attention.splits_for
    monkeypatch.setattr(attention, "splits_for", lambda rows, kv, cols, _: splits_for(rows, kv, cols, programs))
    assert (attention.splits_for(5, 2, 600, 0) > 1) == (programs > 1)
    torch.manual_seed(2)
    rows, heads, kv, dim, length = 5, 4, 2, 16, 600
    q = torch.randn(rows, heads, dim, dtype=dtype)
    k, v = torch.randn(rows + 2, kv, length, dim, dtype=dtype), torch.randn(rows + 2, kv, length, dim, dtype=dtype)
    lengths = torch.tensor([1, 64, 65, 300, 600])
    got = attention.decode_attention(q, k[:rows], v[:rows], lengths, 0.3, length).view(rows, heads, dim)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(
        q.double()[:, :, None],
        k[:rows].double().repeat_interleave(heads // kv, 1),
        v[:rows].double().repeat_interleave(heads // kv, 1),
        attn_mask=mask,
        scale=0.3,
    )[:, :, 0]
    error = ((got.double() - want).norm() / want.norm()).item()
    assert error < (1e-6 if dtype == torch.float32 else 1e-2), error


@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_decode_step_matches_the_torch_path(fused, qk_norm):
    model = _qwen3(torch.float32, qk_norm=qk_norm)
    runner = DecoderRunner(model, kernels="torch")
    assert runner.fused is None
    rows, length = 5, 300
    lens = torch.tensor([3, 150, 0, 77, 299])
    torch.manual_seed(3)
    keys = [torch.randn(8, 2, length, 16) for _ in range(2)]
    values = [torch.randn(8, 2, length, 16) for _ in range(2)]
    ids = torch.randint(0, 128, (rows, 1))
    mask = (torch.arange(length)[None, :] <= lens[:, None])[:, None, None, :]

    def step(cache_k, cache_v):
        return runner.forward_slots(
            ids, lens[:, None], [c[:rows] for c in cache_k], [c[:rows] for c in cache_v], length, mask, cols=lens
        )

    torch_k, torch_v = [c.clone() for c in keys], [c.clone() for c in values]
    want = step(torch_k, torch_v)
    runner.fused = fused["decoder"].FusedDecoder(runner)
    fused_k, fused_v = [c.clone() for c in keys], [c.clone() for c in values]
    got = step(fused_k, fused_v)
    assert ((got - want).norm() / want.norm()) < 1e-5
    for a, b in zip(torch_k + torch_v, fused_k + fused_v):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_merged_projections_stay_the_hf_parameters(fused):
    model = _qwen3(torch.bfloat16)
    runner = DecoderRunner(model, kernels="torch")
    decoder = fused["decoder"].FusedDecoder(runner)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = decoder.layers[1][1], decoder.layers[1][7]
    with torch.no_grad():  # an in-place update by HF name, as the engine's update_weights does
        attn.k_proj.weight.copy_(torch.full_like(attn.k_proj.weight, 0.5))
        mlp.up_proj.weight.mul_(2)
    q_rows = attn.q_proj.weight.shape[0]
    assert torch.equal(qkv[q_rows : q_rows + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    assert torch.equal(gate_up[mlp.gate_proj.weight.shape[0] :], mlp.up_proj.weight)
    model.to(torch.float32)  # a move replaces the parameters' storage: bind() merges them again
    decoder.bind()
    assert decoder.layers[1][1].dtype == torch.float32
    assert attn.v_proj.weight.untyped_storage().data_ptr() == decoder.layers[1][1].untyped_storage().data_ptr()


def test_the_kernels_option_is_checked():
    model = _qwen3(torch.bfloat16)
    assert DecoderRunner(model).fused is None  # auto on the CPU: the torch path
    assert "device 'cpu'" in DecoderRunner(model).fused_off_because
    with pytest.raises(ValueError, match=r"kernels=triton: device 'cpu'"):
        DecoderRunner(model, kernels="triton")
    with pytest.raises(ValueError, match=r"kernels='cuda': must be one of \['auto', 'triton', 'torch'\]"):
        DecoderRunner(model, kernels="cuda")


def test_fused_sampling_draws_what_the_torch_path_draws(fused):
    from loongsage.core.engine.sampling import SamplingTensors, sample
    from loongsage.core.types import SamplingParams

    torch.manual_seed(4)
    rows, vocab = 48, 3000  # a vocabulary over one kernel block, not a multiple of it
    logits = torch.randn(rows + 5, vocab) * 4
    logits[3, [17, 2900]] = 50.0  # a tie for the maximum: greedy takes the first, as argmax does
    at = torch.randperm(rows + 5)[:rows]  # rows read where they lie, in any order
    temperatures = [0.0 if r % 5 == 0 else (0.7, 1.0, 1.6)[r % 3] for r in range(rows)]
    params = [SamplingParams(temperature=t) for t in temperatures]
    st = SamplingTensors.build(params, vocab, "cpu")
    uniforms = torch.rand(rows)
    uniforms[1] = 0.9999999  # the far end of the CDF
    want_tok, want_lp = sample(logits[at], st, uniforms)
    got_tok, got_lp = fused["sampling"].sample_rows(logits, at, uniforms, st.inv_temperature, st.greedy)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, atol=2e-5, rtol=0)
    greedy_row = [i for i, r in enumerate(at.tolist()) if r == 3 and temperatures[i] == 0.0]
    for i in greedy_row:
        assert got_tok[i] == 17
    all_greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * rows, vocab, "cpu")
    tok, lp = fused["sampling"].sample_rows(logits, at, None, all_greedy.inv_temperature, all_greedy.greedy)
    assert torch.equal(tok, logits[at].argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits[at], -1).gather(-1, tok[:, None])[:, 0], atol=2e-5, rtol=0)


def test_fused_sampling_chunk_sizes_cover_the_vocabulary(fused):
    sampling = fused["sampling"]
    for vocab in (1, 128, 2047, 2048, 2049, 32000, 151936):
        for rows in (1, 3, 128, 1000):
            for programs in (1, 8 * 132):
                chunk, splits = sampling.chunks_for(rows, vocab, programs)
                assert chunk % sampling._BLOCK == 0 and chunk <= sampling._CHUNK_BLOCKS * sampling._BLOCK
                assert (splits - 1) * chunk < vocab <= splits * chunk, (rows, vocab, programs)  # no empty chunk
    # Qwen3's vocabulary on an H200 (132 multiprocessors): one block a chunk for one row, at 128
    # rows nineteen chunks of four blocks (2,432 programs)
    assert sampling.chunks_for(1, 151936, 8 * 132) == (2048, 75)
    assert sampling.chunks_for(128, 151936, 8 * 132) == (4 * 2048, 19)
    assert sampling.chunks_for(128, 32000, 8 * 132) == (2 * 2048, 8)


def test_fused_sampling_merges_chunks_like_one_pass(fused, monkeypatch):
    """Each row's vocabulary split over nine chunks (blocks of 64, chunks of 128): greedy ties across
    chunk boundaries, draws landing in every chunk, chunks of very different maxima (their masses
    must be rescaled to the row's maximum before they are merged), temperatures, -inf chunks."""
    from loongsage.core.engine.sampling import SamplingTensors, sample
    from loongsage.core.types import SamplingParams

    sampling = fused["sampling"]
    monkeypatch.setattr(sampling, "_BLOCK", 64)
    monkeypatch.setattr(sampling, "_CHUNK_BLOCKS", 2)
    rows, vocab = 24, 1100  # 8 chunks of 128 and one of 76 (a partial block): 9, padded to 16 in the merge
    assert sampling.chunks_for(rows, vocab, 8) == (128, 9)
    torch.manual_seed(7)
    logits = torch.randn(rows + 5, vocab) * 2
    logits += torch.randn(rows + 5, 9).mul(3).repeat_interleave(128, 1)[:, :vocab]  # chunk maxima far apart
    logits[0, [127, 128, 1000]] = 40.0  # a greedy tie across a chunk boundary: the first index wins
    logits[1, [300, 1099]] = 40.0
    logits[2, :400] = float("-inf")  # whole chunks without mass, and the next chunk's first 16 tokens
    logits[2, 512:640] = float("-inf")
    logits[3, 1024:] = float("-inf")  # the last chunk without mass
    logits[3, 1023] = 30.0  # and the last possible token well apart
    logits[4] = torch.randn(vocab) * 0.1  # a flat row: its mass spread over every chunk
    at = torch.randperm(rows + 5)[:rows]
    at[[0, 1, 2, 3, 4]] = at[[5, 6, 7, 8, 9]]  # rows 5..9 read their logits twice, once greedy
    at[[5, 6, 7, 8, 9]] = torch.tensor([0, 1, 2, 3, 4])
    temperatures = [0.0 if r % 4 == 0 else (0.5, 1.0, 1.6)[r % 3] for r in range(rows)]
    temperatures[5:10] = [0.0, 0.0, 0.7, 1.6, 1.0]
    st = SamplingTensors.build([SamplingParams(temperature=t) for t in temperatures], vocab, "cpu")
    uniforms = torch.rand(rows)
    uniforms[8] = 0.9999999  # the far end of the CDF: the last chunk with mass, not the last chunk
    uniforms[9] = 0.97  # a late chunk of the flat row
    want_tok, want_lp = sample(logits[at], st, uniforms)
    got_tok, got_lp = sampling.sample_rows(logits, at, uniforms, st.inv_temperature, st.greedy)
    assert torch.equal(got_tok, want_tok), (got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, atol=2e-5, rtol=0)
    assert got_tok[5] == 127 and got_tok[6] == 300
    assert got_tok[7] >= 400 and not (512 <= got_tok[7] < 640)
    assert got_tok[8] == 1023 and got_tok[9] >= 7 * 128
    assert len(set((got_tok[~st.greedy] // 128).tolist())) >= 5, "draws from many chunks"

    # u = 1: the target is the whole mass, which rounding may leave unreached; the draw then takes
    # the last possible token of the row (the torch path clamps to the last token, -inf or not)
    one = torch.ones(rows)
    tok, _ = sampling.sample_rows(logits, at, one, st.inv_temperature, st.greedy)
    assert tok[8] == 1023 and tok[9] == vocab - 1
    # u = 0: the first token with mass (the cumulative mass must exceed the target, not reach it)
    zero = torch.zeros(rows)
    tok, _ = sampling.sample_rows(logits, at, zero, st.inv_temperature, st.greedy)
    assert torch.equal(tok, sample(logits[at], st, zero)[0]) and tok[7] == 400

    all_greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * rows, vocab, "cpu")
    tok, lp = sampling.sample_rows(logits, at, None, all_greedy.inv_temperature, all_greedy.greedy)
    assert torch.equal(tok, logits[at].argmax(-1)) and tok[5] == 127
    torch.testing.assert_close(lp, torch.log_softmax(logits[at], -1).gather(-1, tok[:, None])[:, 0], atol=2e-5, rtol=0)


def test_bursts_of_decode_steps_on_the_fused_sampler_draw_what_the_torch_sampler_draws(fused, tmp_path):
    """The engine's masked decode step (``SlotBatch._advance``) with the fused sampler, as a graph
    replays it on a GPU, in bursts of four steps: the torch sampler's tokens, stops and lengths."""
    from _engine_helpers import build_engine_test_model, prompts, req

    from loongsage.core.engine.native import NativeEngine

    model_dir = build_engine_test_model(tmp_path / "tiny")
    settings = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.6, "seed": 8, "n": 2}]
    requests = [req(f"r{i}", p, max_new_tokens=2 + 5 * i, **settings[i % 3]) for i, p in enumerate(prompts(7, seed=80))]
    common = {"max_batch_size": 4, "max_model_len": 128, "eos_token_ids": [7, 11, 19], "steps_per_sync": 4}
    torch_side = NativeEngine(model_dir, **common)
    fused_side = NativeEngine(model_dir, **common)
    fused_side._batch.fused_sampling = fused["sampling"].sample_rows
    want, got = torch_side.generate_batch(requests), fused_side.generate_batch(requests)
    for w_group, g_group in zip(want, got):
        for w, g in zip(w_group, g_group):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-5, rtol=0)
    assert fused_side.health()["read_backs"] < fused_side.health()["steps"]
