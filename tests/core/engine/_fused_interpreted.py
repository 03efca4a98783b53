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


def _qwen3(dtype: torch.dtype, *, qk_norm: bool = True, seed: int = 0, intermediate: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": intermediate,
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


@pytest.mark.parametrize("heads, kv", [(4, 2), (6, 2), (2, 2)])  # 8, 5 and 16 tokens a program
def test_causal_attention_gives_each_token_the_batch_invariant_decode_bits(fused, heads, kv):
    """Whole sequences at once, blocks of tokens sharing a program's reads, give every token what the
    batch-invariant decode path (one program a token, its columns in order) gives it, bit for bit,
    and causal attention's numbers: a width that no block size divides, past one block of columns."""
    attention = fused["attention"]
    torch.manual_seed(3)
    rows, dim, width = 3, 16, 83
    q = torch.randn(rows * width, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(rows, kv, width, dim, dtype=torch.bfloat16)
    v = torch.randn(rows, kv, width, dim, dtype=torch.bfloat16)
    got = attention.causal_attention(q, k, v, 0.3)
    positions = torch.arange(width).repeat(rows)
    sequences = torch.arange(rows).repeat_interleave(width)
    one_by_one = attention.decode_attention(q, k, v, positions + 1, 0.3, width, cache_rows=sequences, splits=1)
    assert torch.equal(got, one_by_one)
    want = F.scaled_dot_product_attention(
        q.double().view(rows, width, heads, dim).transpose(1, 2),
        k.double().repeat_interleave(heads // kv, 1),
        v.double().repeat_interleave(heads // kv, 1),
        is_causal=True,
        scale=0.3,
    )
    want = want.transpose(1, 2).reshape(rows * width, heads * dim)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("programs", [1, 1024])
def test_shared_prefix_tiles_read_the_prefix_from_their_source_row_only(fused, programs, monkeypatch):
    """Rows 0, 2, 3, 5 and 6 decode over one 130-column prompt (two tiles of at most 4 rows with
    group 4), rows 1 and 4 over a 70-column one, row 7 alone; a tile reads the prompt's whole blocks
    of 64 columns, the rows the rest; outside its source row, every copy of the columns a tile reads
    is NaN, so a row reading its own copy would be NaN. With one program a row (the batch-invariant
    path) the tiles give each row the bits it gets reading its whole cache alone."""
    attention = fused["attention"]
    splits_for = attention.splits_for
    monkeypatch.setattr(attention, "splits_for", lambda rows, kv, cols, _: splits_for(rows, kv, cols, programs))
    torch.manual_seed(5)
    rows, heads, kv, dim, length = 8, 8, 2, 16, 300
    q = torch.randn(rows, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(rows, kv, length, dim, dtype=torch.bfloat16)
    v = torch.randn(rows, kv, length, dim, dtype=torch.bfloat16)
    lengths = torch.tensor([131, 80, 200, 290, 71, 135, 140, 64])
    groups = [([0, 2, 3, 5, 6], 130), ([1, 4], 70), ([7], 64)]
    for members, prefix in groups:  # each row's own copy of its prompt, as the engine's slots hold
        k[members, :, :prefix], v[members, :, :prefix] = k[members[0], :, :prefix], v[members[0], :, :prefix]
    want = attention.decode_attention(q, k, v, lengths, 0.25, length).view(rows, heads, dim)
    # float32 for the batch-invariant comparison: a bf16 output would hide a float32 sum that differs
    alone = attention.decode_attention(q.float(), k.float(), v.float(), lengths, 0.25, length, splits=1)
    assert attention.tile_members(heads // kv) == 4 and attention.tile_members(2) == 8
    tiles = attention.shared_prefix_tiles(groups, attention.tile_members(heads // kv))
    assert tiles == [(128, [0, 2, 3]), (128, [5, 6]), (64, [1, 4])]
    table = torch.full((5, 2 + 4), -1, dtype=torch.int32)  # two tiles to spare, as a graph's table has
    table[:, 1] = 0
    first = torch.zeros(rows, dtype=torch.int32)
    for t, (prefix, members) in enumerate(tiles):
        table[t, 0], table[t, 1], table[t, 2 : 2 + len(members)] = members[-1], prefix, torch.tensor(members)
        first[members] = prefix
        others = [m for m in members if m != members[-1]]
        k[others, :, :prefix], v[others, :, :prefix] = float("nan"), float("nan")
    shared = attention.SharedPrefixes(table, first)
    got = attention.decode_attention(q, k, v, lengths, 0.25, length, shared=shared).view(rows, heads, dim)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    source = k.clone(), v.clone()
    for prefix, members in tiles:
        for buf, src in zip(source, (k, v)):
            buf[members, :, :prefix] = src[members[-1], :, :prefix]
    reference = F.scaled_dot_product_attention(
        q.double()[:, :, None],
        source[0].double().repeat_interleave(heads // kv, 1),
        source[1].double().repeat_interleave(heads // kv, 1),
        attn_mask=mask,
        scale=0.25,
    )[:, :, 0]
    assert not got.isnan().any()
    for result in (got, want):
        error = ((result.double() - reference).norm() / reference.norm()).item()
        assert error < 1e-2, error
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    q, k, v = q.float(), k.float(), v.float()
    assert torch.equal(attention.decode_attention(q, k, v, lengths, 0.25, length, shared=shared, splits=1), alone)
    # tables holding the prompts' own lengths (130, 70): the kernels cut them to whole blocks too
    uncut = table.clone(), first.clone()
    uncut[0][:3, 1] = torch.tensor([130, 130, 70])
    uncut[1][first == 128], uncut[1][first == 64] = 130, 70
    uncut = attention.SharedPrefixes(*uncut)
    assert torch.equal(attention.decode_attention(q, k, v, lengths, 0.25, length, shared=uncut, splits=1), alone)
    with pytest.raises(ValueError, match="shared prefixes are for decode rows, not a sequence's tokens"):
        attention.decode_attention(q, k, v, lengths, 0.25, length, shared=shared, cache_rows=torch.arange(rows))


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


def test_shared_prefix_decode_samples_what_each_row_reading_its_own_prompt_samples(fused, tmp_path):
    """The engine with ``shared_prefix_decode`` (fused kernels switched on as a CUDA device would,
    in Triton's interpreter): 13 rows of four requests over prompts of 66 to 109 tokens through 8
    slots (admissions, finishes, moves, retained slots), in bursts of three steps: the same tokens,
    stops and log-probs as the rows each reading their whole cache, and the tiles were used."""
    from _engine_helpers import build_engine_test_model, prompts, req

    from loongsage.core.engine.continuous import SlotBatch
    from loongsage.core.engine.native import NativeEngine

    model_dir = build_engine_test_model(tmp_path / "tiny")
    settings = [
        {"temperature": 1.0, "seed": 4, "n": 4},
        {"temperature": 0.0, "n": 3},
        {"temperature": 0.0},
        {"temperature": 0.7, "seed": 9, "n": 5},
    ]
    texts = prompts(4, seed=81, lo=66, hi=110)
    requests = [req(f"r{i}", p, max_new_tokens=5 + 2 * i, **settings[i]) for i, p in enumerate(texts)]
    common = {"max_batch_size": 8, "max_model_len": 160, "steps_per_sync": 3}
    sides = []
    for shared in (False, True):
        engine = NativeEngine(model_dir, shared_prefix_decode=shared, **common)
        engine._runner.fused = fused["decoder"].FusedDecoder(engine._runner)
        engine._batch = batch = SlotBatch(engine._runner, **engine._batch_args)
        tables = []
        if shared:
            prefixes, tile = batch.prefixes, batch.prefixes.tile

            def spy(slots, slot_group, tile=tile, prefixes=prefixes, tables=tables):
                tile(slots, slot_group)
                tables.append((list(slots), prefixes.tiles.clone(), prefixes.first.clone()))

            prefixes.tile = spy
        sides.append((engine, engine.generate_batch(requests), tables))
    (plain, want, untiled), (tiled, got, tables) = sides
    assert "shared prefixes" in tiled.health()["decode_kernels"] and not untiled
    assert "shared prefixes" not in plain.health()["decode_kernels"]
    for w_group, g_group in zip(want, got):
        for w, g in zip(w_group, g_group):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-5, rtol=0)
    widest = 0
    for slots, table, first in tables:
        tiled_rows = [r for entry in table.tolist() if entry[1] for r in entry[2:] if r >= 0]
        assert len(tiled_rows) == len(set(tiled_rows)) and set(tiled_rows) <= set(slots)
        for source, prefix, *members in table.tolist():
            if prefix:
                assert source in members and prefix in [len(p) - len(p) % 64 for p in texts]  # whole blocks
                assert first[[m for m in members if m >= 0]].eq(prefix).all()
        assert int(first.ne(0).sum()) == len(tiled_rows)
        widest = max(widest, max((sum(m >= 0 for m in entry[2:]) for entry in table.tolist()), default=0))
    assert widest >= 4  # the five samples of one request shared their prompt's reads


def test_batch_invariant_engine_and_trainer_give_the_same_log_probs_bit_for_bit(fused, tmp_path):
    """The engine's batch_invariant prefill and decode (switched on as a CUDA device would, its
    kernels in Triton's interpreter) and the trainer's batch-invariant forward give every sampled
    token the same log-prob, bit for bit, whatever else shares the batch on either side: both run
    the same computation for each token (positions, cache columns, attention spans, head, the
    log-prob's reduction), the two samples of a 70-token prompt decoding over it as one shared-prefix
    tile. That each kernel's sums do not depend on the batch is the business of the kernel tests
    above (on a CPU, at these sizes, torch's matmuls happen not to depend on it either)."""
    from _engine_helpers import req

    from loongsage.core.engine.continuous import SlotBatch
    from loongsage.core.engine.native import NativeEngine
    from loongsage.core.trainer.invariant import InvariantForward

    # an MLP 600 wide: the down projection sums two chunks of K (see fused/matmul.py)
    _qwen3(torch.bfloat16, intermediate=600).save_pretrained(tmp_path / "tiny")
    engine = NativeEngine(
        str(tmp_path / "tiny"), dtype="bfloat16", max_batch_size=6, max_model_len=96, steps_per_sync=3, eos_token_ids=[]
    )
    runner = engine._runner
    # merged q/k/v and gate/up in the engine, the trainer's projections apart: the same bits
    runner.fused, runner.invariant = fused["decoder"].FusedDecoder(runner, invariant=True), True
    assert runner.fused.layers[0].qkv is not None
    engine._batch = batch = SlotBatch(runner, **engine._batch_args)
    firsts, prefixes, tile = [], batch.prefixes, batch.prefixes.tile
    prefixes.tile = lambda slots, slot_group: tile(slots, slot_group) or firsts.append(prefixes.first.tolist())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in (5, 17, 9, 70)]
    settings = [
        {"temperature": 1.0, "seed": 1, "n": 2},
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 20, "seed": 3},
    ]
    requests = [req(f"r{i}", p, max_new_tokens=4 + 3 * i, **settings[i % 3]) for i, p in enumerate(prompts)]
    results = engine.generate_batch(requests)
    assert engine.health()["decode_kernels"] == "triton, batch-invariant, shared prefixes"
    assert any(first.count(64) == 2 for first in firsts)  # the 70-token prompt's samples: one tile
    samples = [(p, r) for p, group in zip(prompts, results) for r in group]

    from transformers import AutoModelForCausalLM

    # loaded as the trainer loads it (a model cast with .to(bfloat16) would round its rotary
    # frequencies, which from_pretrained keeps in float32)
    trainer_model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.bfloat16).train()
    forward = InvariantForward(trainer_model, fp32_lm_head=True)

    def trainer_logprobs(batch: list) -> list[list[float]]:
        width = max(len(p) + len(r.output_ids) for p, r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (p, r) in enumerate(batch):
            ids[b, : len(p) + len(r.output_ids)] = torch.tensor(p + r.output_ids)
        first = min(len(p) for p, _ in batch)
        lp, _ = forward.logprobs(ids, first, with_entropy=False)
        return [lp[b, len(p) : len(p) + len(r.output_ids)].tolist() for b, (p, r) in enumerate(batch)]

    together = trainer_logprobs(samples)
    for (_, r), lp in zip(samples, together):
        assert lp == r.logprobs  # bit for bit: the engine's decode and prefill are the trainer's forward
    assert trainer_logprobs(samples[2:5]) == together[2:5] and trainer_logprobs(samples[-1:]) == together[-1:]
    assert engine.health()["prefill_forwards"] == 1  # the four prompts in one pass, no padding

    # prompts cut into chunks of 8 tokens (long prompts' prefill): the same samples, bit for bit
    chunked = NativeEngine(
        str(tmp_path / "tiny"),
        dtype="bfloat16",
        max_batch_size=6,
        max_model_len=96,
        steps_per_sync=3,
        eos_token_ids=[],
        prefill_chunk_tokens=8,
    )
    chunked._runner.fused = fused["decoder"].FusedDecoder(chunked._runner, invariant=True)
    chunked._runner.invariant = True
    chunked._batch = SlotBatch(chunked._runner, **chunked._batch_args)
    again_chunked = chunked.generate_batch(requests)
    assert chunked.health()["prefill_forwards"] > 1
    for want, got in zip(results, again_chunked):
        assert [(r.output_ids, r.logprobs) for r in got] == [(r.output_ids, r.logprobs) for r in want]

    # next turns: each prompt extends a finished sample, whose columns the engine reuses (only the
    # new tokens are prefilled, beside a fresh prompt), and still agrees with the trainer
    turns = [p + r.output_ids + [7, 8, 9] for p, r in samples[:3]] + [prompts[0][:3]]
    again = engine.generate_batch(
        [req(f"t{i}", t, max_new_tokens=5, temperature=1.0, seed=i) for i, t in enumerate(turns)]
    )
    assert engine.health()["prefix_hit_tokens"] > 0
    later = [(t, group[0]) for t, group in zip(turns, again)]
    for (_, r), lp in zip(later, trainer_logprobs(later)):
        assert lp == r.logprobs

    # the gradient: the HF model's, taken at the invariant forward's own activations (one forward):
    # close to plain bf16 autograd's on every weight, and the same bits with activation
    # checkpointing (each layer's kernels recomputed in the backward give the same numbers)
    batch = samples[:3]
    width = max(len(p) + len(r.output_ids) for p, r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    response = torch.zeros(len(batch), width)
    for b, (p, r) in enumerate(batch):
        ids[b, : len(p) + len(r.output_ids)] = torch.tensor(p + r.output_ids)
        response[b, len(p) : len(p) + len(r.output_ids)] = 1
    first = min(len(p) for p, _ in batch)
    weights = list(trainer_model.parameters())

    def gradients(logprobs) -> list[torch.Tensor]:
        trainer_model.zero_grad(set_to_none=True)
        (logprobs() * response).sum().backward()
        return [w.grad.float().clone() for w in weights]

    def hf_logprobs() -> torch.Tensor:
        logits = trainer_model(input_ids=ids).logits[:, first - 1 : -1].float()
        taken = torch.log_softmax(logits, -1).gather(-1, ids[:, first:, None])[..., 0]
        return F.pad(taken, (first, 0))

    invariant = gradients(lambda: forward.logprobs(ids, first, with_entropy=False)[0])
    plain = gradients(hf_logprobs)
    for (name, _), got, want in zip(trainer_model.named_parameters(), invariant, plain):
        assert torch.isfinite(got).all() and got.norm() > 0, name
        assert (got - want).norm() <= 0.05 * want.norm(), (name, float((got - want).norm() / want.norm()))
    trainer_model.gradient_checkpointing_enable()
    checkpointed = gradients(lambda: forward.logprobs(ids, first, with_entropy=False)[0])
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, invariant))


def test_a_frozen_input_of_a_fused_kernel_gets_no_gradient_and_the_others_theirs(fused):
    """The kernels' backward (fused/differentiable.py) with frozen inputs: the first layer's norm
    reads the embedding alone (no residual yet, the embedding frozen), and a norm whose residual is
    frozen; the inputs that want one get torch's gradient (HF's RMSNorm under autograd)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from loongsage.core.engine.fused.differentiable import AddRmsNorm

    torch.manual_seed(4)
    x = torch.randn(5, 32, dtype=torch.bfloat16)  # frozen: no gradient wanted
    residual = torch.randn(5, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, dtype=torch.bfloat16)
    close = {"rtol": 2e-2, "atol": 1e-2}
    for frozen_x in (True, False):
        ours = weight.clone().requires_grad_()
        mine = x.clone().requires_grad_(not frozen_x)
        normed, total = AddRmsNorm.apply(mine, None if frozen_x else residual, ours, 1e-6)
        (normed.float().square().sum() + total.float().sum()).backward()
        norm = Qwen3RMSNorm(32, eps=1e-6).to(torch.bfloat16)
        norm.weight.data.copy_(weight)
        theirs = x.clone().requires_grad_(not frozen_x)
        summed = theirs if frozen_x else theirs + residual
        (norm(summed).float().square().sum() + summed.float().sum()).backward()
        torch.testing.assert_close(ours.grad.float(), norm.weight.grad.float(), **close)
        if not frozen_x:
            torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), **close)


@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, True), (True, True, False)])
def test_attention_gives_the_inputs_that_want_one_sdpas_gradient(fused, wanted):
    """Causal attention's backward (recomputed SDPA with its kv heads shared) for any mix of queries,
    keys and values wanting a gradient: those get SDPA's under autograd, the others none."""
    from loongsage.core.engine.fused.differentiable import Attention

    torch.manual_seed(6)
    rows, width, heads, kv, dim = 2, 9, 4, 2, 16
    base = [
        torch.randn(rows * width, heads, dim, dtype=torch.bfloat16),
        torch.randn(rows, kv, width, dim, dtype=torch.bfloat16),
        torch.randn(rows, kv, width, dim, dtype=torch.bfloat16),
    ]
    ours = [t.clone().requires_grad_(w) for t, w in zip(base, wanted)]
    g = torch.randn(rows * width, heads * dim, dtype=torch.bfloat16)
    (Attention.apply(*ours, 0.3).float() * g.float()).sum().backward()
    theirs = [t.clone().requires_grad_(w) for t, w in zip(base, wanted)]
    query = theirs[0].view(rows, width, heads, dim).transpose(1, 2)
    keys, values = (t.repeat_interleave(heads // kv, 1) for t in theirs[1:])
    out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.3)
    (out.transpose(1, 2).reshape(rows * width, heads * dim).float() * g.float()).sum().backward()
    for mine, want, w in zip(ours, theirs, wanted):
        assert (mine.grad is None) == (not w)
        if w:
            torch.testing.assert_close(mine.grad.float(), want.grad.float(), rtol=2e-2, atol=2e-2)


def _probe_rows_in(batch: torch.Tensor, probe: torch.Tensor, at: list[int]) -> torch.Tensor:
    batch = batch.clone()
    batch[at] = probe
    return batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_invariant_matmul_matches_a_float32_reference(fused, dtype):
    """Odd M, N and K (masked tails of every block), an x read in place with a row stride (a column
    slice of a wider tensor, its rows not 16-byte aligned), a weight that is a row slice of a merged
    buffer, a bias, a float32 output (the FP32 head) and a half one rounded once from the same sums."""
    mm = fused["matmul"]
    torch.manual_seed(11)
    for m in (1, 37, 130):
        for n, k in ((96, 80), (200, 192), (72, 1100)):  # the last: three chunks of K, a short one last
            x = torch.randn(m, k + 24, dtype=dtype)[:, 5 : 5 + k]
            merged = torch.randn(40 + n + 24, k, dtype=dtype)
            w = merged[40 : 40 + n]
            bias = torch.randn(n, dtype=dtype)
            for b in (None, bias):
                want = x.float() @ w.float().T + (0 if b is None else b.float())
                wide = mm.invariant_matmul(x, w, b, out_dtype=torch.float32)
                assert wide.dtype == torch.float32 and wide.shape == (m, n)
                torch.testing.assert_close(wide, want, atol=1e-4, rtol=1e-5)
                half = mm.invariant_matmul(x, w, b)
                assert half.dtype == dtype
                assert torch.equal(half, wide.to(dtype)), "the float32 sums rounded once, bias included"
    x_t = torch.randn(80, 9, dtype=dtype).T  # no unit stride on K: copied
    w = torch.randn(96, 80, dtype=dtype)
    torch.testing.assert_close(
        mm.invariant_matmul(x_t, w, out_dtype=torch.float32), x_t.float() @ w.float().T, atol=1e-4, rtol=1e-5
    )
    with pytest.raises(ValueError, match="bf16/fp16"):
        mm.invariant_matmul(x_t.float(), w.float())
    with pytest.raises(ValueError, match="out_dtype"):
        mm.invariant_matmul(x_t, w, out_dtype=torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    assert mm.invariant_matmul(x_t[:0], w).shape == (0, 96)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_invariant_matmul_rows_do_not_depend_on_the_batch(fused, dtype):
    """Bit for bit: five rows computed alone (M = 1) and among other random rows in batches of 7,
    64, 130 and 1,030 (at the edges of row tiles; the last runs the large tiles), and a
    projection's columns computed with its own weight and inside a merged [w1; w; w3] (offsets off
    the column tiles, as the engine's q/k/v)."""
    mm = fused["matmul"]
    torch.manual_seed(12)
    k, n = 1100, 96  # three chunks of K (the last short), and a merged N of 40 + 96 + 24
    probe = torch.randn(5, k, dtype=dtype)
    w1, w, w3 = (torch.randn(rows, k, dtype=dtype) for rows in (40, n, 24))
    b1, b, b3 = (torch.randn(rows, dtype=dtype) for rows in (40, n, 24))
    merged, merged_bias = torch.cat([w1, w, w3]), torch.cat([b1, b, b3])
    for out_dtype, bias, biases in ((None, b, merged_bias), (torch.float32, None, None)):  # a projection, the head
        alone = torch.cat([mm.invariant_matmul(probe[i : i + 1], w, bias, out_dtype) for i in range(5)])
        sizes = ((7, [0, 2, 3, 5, 6]), (64, [0, 1, 31, 62, 63]), (130, [3, 63, 64, 127, 129]))
        for size, at in (*sizes, (1030, [0, 127, 128, 600, 1029])):  # the last on large tiles
            batch = _probe_rows_in(torch.randn(size, k, dtype=dtype), probe, at)
            assert torch.equal(mm.invariant_matmul(batch, w, bias, out_dtype)[at], alone), (size, out_dtype)
            whole = mm.invariant_matmul(batch, merged, biases, out_dtype)
            assert torch.equal(whole[at, 40 : 40 + n], alone), (size, out_dtype)


def test_invariant_matmul_layouts_give_the_same_bits(fused, monkeypatch):
    """Small, medium or large tiles, a chunk per program (with the in-order sum of the chunks
    after), a tile per program (walking its chunks) or TMA loads with programs walking the tiles:
    layouts of one computation, the same bits, with and without a bias, rounded to bf16 or kept in
    float32, with a short last chunk, a single chunk (no sum of chunks), chunks longer than 512
    (K = 2600: three of 1,024), ``x`` a column slice of a wider tensor, the result written into
    columns of a wider one, and rows TMA cannot read (K = 1100: the pointer kernel runs)."""
    mm = fused["matmul"]
    torch.manual_seed(13)
    sizes = (mm.SMALL_TILES, mm.MEDIUM_TILES, mm.LARGE_TILES)  # (the interpreter has no warps)
    layouts = [(tiles, layout) for tiles in sizes for layout in ("split", "tile")]
    layouts += [(mm.TMA_TILES, "tma"), (mm.TMA_WIDE_OUT_TILES, "tma")]
    chosen = {mm._layout(m, 128, 1100, torch.device("cpu"), False) for m in (40, 1100)}
    assert chosen == {(mm.SMALL_TILES, "split"), (mm.TMA_TILES, "tma")}  # the interpreter runs both sizes
    assert mm._layout(64, 1024, 1100, torch.device("cpu"), True) == (mm.MEDIUM_WIDE_OUT_TILES, "tile")
    tma_runs, run_tma = [], mm._run_tma
    monkeypatch.setattr(mm, "_run_tma", lambda *args: tma_runs.append(args[0].shape[1]) or run_tma(*args))
    assert [mm._chunk_k(k) for k in (320, 1088, 2048, 2600, 6144, 8960)] == [512, 512, 512, 1024, 1536, 2560]
    for k in (1088, 320, 1100, 2600):
        x = torch.randn(200, k + 8, dtype=torch.bfloat16)[:, 8:]  # read in place, rows of k + 8
        w, bias = torch.randn(136, k, dtype=torch.bfloat16), torch.randn(136, dtype=torch.bfloat16)
        variants = ((bias, None), (None, torch.float32), (bias, torch.float32))
        for b, out_dtype in variants[:1] if k == 2600 else variants:  # long chunks: one is enough
            outs = []
            for layout in layouts:
                monkeypatch.setattr(mm, "_layout", lambda m, n, k, device, wide_out, layout=layout: layout)
                outs.append(mm.invariant_matmul(x, w, b, out_dtype))
                wider = torch.full((200, 160), 7.0, dtype=outs[-1].dtype)
                written = mm.invariant_matmul(x, w, b, out_dtype, out=wider[:, 8:144])
                assert written.data_ptr() == wider[:, 8:].data_ptr()
                assert torch.equal(wider[:, 8:144], outs[-1]), (k, out_dtype, layout)
                assert wider[:, :8].eq(7).all() and wider[:, 144:].eq(7).all()  # nothing written beside
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (k, out_dtype)
            want = x.float() @ w.float().T + (0 if b is None else b.float())
            torch.testing.assert_close(outs[0].float(), want, atol=1e-4 if out_dtype else 0.1, rtol=1e-2)
    assert set(tma_runs) == {1088, 320, 2600}  # TMA read the aligned rows; those of K = 1100 are not


def test_projections_side_by_side_are_each_ones_bits_and_torchs_gradients(fused):
    """q/k/v as the trainer runs them (its modules' weights, a bias on some only) written into one
    result: each block the bits of its projection alone, and torch's gradients."""
    mm = fused["matmul"]
    torch.manual_seed(14)
    x = torch.randn(70, 96, dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(n, 96, dtype=torch.bfloat16, requires_grad=True) for n in (64, 32, 40)]
    biases = [None, torch.randn(32, dtype=torch.bfloat16, requires_grad=True), None]
    out = mm.invariant_linears(x, weights, biases)
    with torch.no_grad():
        alone = torch.cat([mm.invariant_matmul(x, w, b) for w, b in zip(weights, biases)], 1)
    assert torch.equal(out, alone)
    g = torch.randn(70, 136, dtype=torch.bfloat16)
    (out.float() * g).sum().backward()
    params = [x, *weights, biases[1]]
    refs = [t.detach().float().requires_grad_() for t in params]
    want = torch.cat([F.linear(refs[0], refs[1]), F.linear(refs[0], refs[2], refs[4]), F.linear(refs[0], refs[3])], 1)
    (want * g.float()).sum().backward()
    for got, ref in zip(params, refs):  # bf16 gradients: within their rounding of float32's
        assert got.grad.dtype == torch.bfloat16 and got.grad.shape == ref.grad.shape
        assert ((got.grad.float() - ref.grad).norm() / ref.grad.norm()).item() < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_head", [False, True])
def test_invariant_linear_gradients_are_torchs(fused, dtype, fp32_head):
    mm = fused["matmul"]
    torch.manual_seed(13)
    k, n = 72, 40
    x = torch.randn(2, 5, k, dtype=dtype, requires_grad=True)  # leading dims flattened into M
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)
    b = torch.randn(n, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 5, n)
    out = mm.invariant_linear(x, w, b, torch.float32 if fp32_head else None)
    assert out.shape == (2, 5, n) and out.dtype == (torch.float32 if fp32_head else dtype)
    (out.float() * g).sum().backward()  # a half output receives g rounded to its dtype
    refs = [t.detach().float().requires_grad_() for t in (x, w, b)]
    want = F.linear(*refs)
    (want * g).sum().backward()
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    for got, ref in zip((x, w, b), refs):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.float(), ref.grad, atol=3e-2, rtol=2e-2)
    if fp32_head:  # HalfGemmFp32Out's convention: the float32 gradient rounded to the half dtype first
        g_half = g.reshape(-1, n).to(dtype).float()
        assert torch.equal(x.grad.reshape(-1, k), (g_half @ w.detach().float()).to(dtype))
        assert torch.equal(w.grad, (g_half.T @ x.detach().reshape(-1, k).float()).to(dtype))
        assert torch.equal(b.grad, g_half.sum(0).to(dtype))


class _GridSpy:
    """Records the grids a kernel is launched on."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_token_logprobs_equal_the_fixed_chunk_samplers_in_any_batch(fused, monkeypatch):
    """Blocks of 64 and chunks of 256 (a vocabulary of 600: three chunks, the last partial): the
    log-prob of a given token equals, bit for bit, the one the fixed-chunk sampler reports for the
    token it drew (greedy and sampled rows), and both are the same bits for a row sampled alone, in
    three rows or in all twelve; the chunk count is the vocabulary's alone."""
    from loongsage.core.engine.sampling import SamplingTensors
    from loongsage.core.types import SamplingParams

    sampling = fused["sampling"]
    monkeypatch.setattr(sampling, "_BLOCK", 64)
    monkeypatch.setattr(sampling, "_CHUNK_BLOCKS", 4)
    spy = _GridSpy(sampling._chunk_kernel)
    monkeypatch.setattr(sampling, "_chunk_kernel", spy)
    rows, vocab = 12, 600
    assert sampling.fixed_chunks_for(vocab) == (256, 3)
    torch.manual_seed(14)
    logits = torch.randn(rows + 5, vocab) * 2
    logits += torch.randn(rows + 5, 3).mul(3).repeat_interleave(256, 1)[:, :vocab]  # chunk maxima far apart
    logits[2, :300] = float("-inf")  # a chunk without mass
    at = torch.randperm(rows + 5)[:rows]
    temperatures = [0.0 if r % 4 == 0 else (0.5, 1.0, 1.6)[r % 3] for r in range(rows)]
    st = SamplingTensors.build([SamplingParams(temperature=t) for t in temperatures], vocab, "cpu")
    uniforms = torch.rand(rows)

    given = torch.randint(0, vocab, (rows,))
    given[at == 2] = 400
    want = torch.log_softmax(logits[at], -1).gather(-1, given[:, None])[:, 0]
    torch.testing.assert_close(sampling.token_logprobs_rows(logits, at, given), want, atol=2e-5, rtol=0)

    def sample(idx, fixed=True):
        u = None if uniforms is None else uniforms[idx]
        return sampling.sample_rows(logits, at[idx], u, st.inv_temperature[idx], st.greedy[idx], fixed_chunks=fixed)

    everything = torch.arange(rows)
    tok, lp = sample(everything)
    assert torch.equal(sampling.token_logprobs_rows(logits, at, tok), lp)
    assert torch.equal(tok[st.greedy], logits[at][st.greedy].argmax(-1)) and (~st.greedy).sum() >= 6
    for part in (everything[5:6], everything[[1, 8, 10]]):
        part_tok, part_lp = sample(part)
        assert torch.equal(part_tok, tok[part]) and torch.equal(part_lp, lp[part])
        assert torch.equal(sampling.token_logprobs_rows(logits, at[part], tok[part]), lp[part])
    assert {grid[1] for grid in spy.grids} == {3}, "fixed chunks: three whatever the rows"

    all_greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * rows, vocab, "cpu")
    tok, lp = sampling.sample_rows(logits, at, None, all_greedy.inv_temperature, all_greedy.greedy, fixed_chunks=True)
    assert torch.equal(tok, logits[at].argmax(-1))
    assert torch.equal(sampling.token_logprobs_rows(logits, at, tok), lp)
    alone = sampling.sample_rows(logits, at[:1], None, all_greedy.inv_temperature[:1], all_greedy.greedy[:1], True)
    assert torch.equal(alone[1], lp[:1])

    # the default follows the batch: two-block chunks for one row (five of them), and other bits
    spy.grids.clear()
    one = torch.stack([sample(everything[i : i + 1], fixed=False)[1] for i in range(rows)])[:, 0]
    assert {grid[1] for grid in spy.grids} == {5}
    assert not torch.equal(one, sample(everything, fixed=False)[1]), "the comparisons above can tell"


def test_invariant_token_logprobs_gradient_is_torchs(fused):
    sampling = fused["sampling"]
    torch.manual_seed(15)
    logits = (torch.randn(6, 300) * 3).requires_grad_()
    tokens = torch.randint(0, 300, (6,))
    grad = torch.randn(6)
    got = sampling.InvariantTokenLogprobs.apply(logits, tokens)
    assert torch.equal(got, sampling.token_logprobs_rows(logits.detach(), torch.arange(6), tokens))
    (got * grad).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    want = torch.log_softmax(ref, -1).gather(-1, tokens[:, None])[:, 0]
    (want * grad).sum().backward()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-6, rtol=1e-5)


def test_fp8_rows_quantize_as_torch_does_bit_for_bit(fused):
    """The one-pass quantization of a GEMM's input gives torch's per-token scales and float8 rows
    exactly: rows of any scale, a row of zeros, a K that is not a power of two, a strided x."""
    fp8 = fused["fp8"]
    torch.manual_seed(14)
    wide = torch.randn(9, 300, dtype=torch.bfloat16) * torch.logspace(-4, 3, 9)[:, None].to(torch.bfloat16)
    wide[4] = 0
    for x in (wide, wide[:, 7:207]):
        x8, scale = fp8.quantize_rows(x)
        xf = x.float()
        want_scale = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp_(min=1e-12)
        assert scale.shape == (x.shape[0], 1) and torch.equal(scale, want_scale)
        assert x8.dtype == torch.float8_e4m3fn and torch.equal(
            x8.view(torch.uint8), (xf / want_scale).to(x8.dtype).view(torch.uint8)
        )
    assert fp8.quantize_rows(wide[:0])[0].shape == (0, 300)


def test_fp8_inputs_leave_the_norm_and_swiglu_kernels_quantized_as_torch_would(fused):
    """The residual add + RMSNorm and the SwiGLU kernels with float8 output give the bf16 kernels'
    rows quantized by :func:`quantize_rows`, bit for bit, and the same residual sum."""
    ops, fp8 = fused["ops"], fused["fp8"]
    torch.manual_seed(15)
    x, res = torch.randn(5, 96, dtype=torch.bfloat16), torch.randn(5, 96, dtype=torch.bfloat16) * 4
    weight = torch.randn(96, dtype=torch.bfloat16)
    for residual in (None, res):
        (x8, scale), total = ops.add_rms_norm_fp8(x, residual, weight, 1e-6)
        normed, want_total = ops.add_rms_norm(x, residual, weight, 1e-6)
        want8, want_scale = fp8.quantize_rows(normed)
        assert torch.equal(total, want_total) and torch.equal(scale, want_scale)
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
    gate_up = torch.randn(5, 2 * 300, dtype=torch.bfloat16) * 3
    x8, scale = ops.silu_mul_fp8(gate_up)
    want8, want_scale = fp8.quantize_rows(ops.silu_mul(gate_up))
    assert x8.shape == (5, 300) and torch.equal(scale, want_scale)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))


def test_fp8_weights_decode_close_to_bf16_and_follow_weight_updates(fused, tmp_path):
    """``quantization="fp8"`` (switched on as a CUDA device would; torch's float8 GEMM runs on the
    CPU too): the decode step's logits stay within FP8's rounding of the bf16 ones, and an update of
    the weights reaches the float8 copies."""
    from loongsage.core.engine.native import NativeEngine

    model = _qwen3(torch.bfloat16)
    for w in model.parameters():  # weights of a trained model's scale: this random model's 0.3 would
        w.data.mul_(0.2)  # turn FP8's 3% per GEMM into chaos after two layers
    model.save_pretrained(tmp_path / "tiny")
    engine = NativeEngine(str(tmp_path / "tiny"), dtype="bfloat16", eos_token_ids=[])
    runner = engine._runner
    rows, length = 4, 40
    lens = torch.tensor([3, 17, 0, 30])
    torch.manual_seed(3)
    keys = [torch.randn(rows, 2, length, 16, dtype=torch.bfloat16) for _ in range(2)]
    values = [torch.randn(rows, 2, length, 16, dtype=torch.bfloat16) for _ in range(2)]
    ids = torch.randint(0, 128, (rows, 1))

    decoder = runner.fused = fused["decoder"].FusedDecoder(runner, fp8=True)  # as quantization="fp8" sets up

    def step(fp8: bool) -> torch.Tensor:
        decoder.fp8 = fp8  # off: the same merged bf16 weights, multiplied in bf16
        return runner.forward_slots(
            ids, lens[:, None], [c.clone() for c in keys], [c.clone() for c in values], length, None, cols=lens
        )

    def error() -> float:
        got, want = step(True), step(False)
        decoder.fp8 = True
        return ((got - want).norm() / want.norm()).item()

    assert 1e-3 < error() < 0.1  # quantized, and by e4m3's rounding only
    engine.update_weights([(n, t * 0.5) for n, t in engine.named_weights() if n.endswith("proj.weight")])
    assert 1e-3 < error() < 0.1  # the copies follow the update (stale ones would be twice the weights)
    decoder.unbind()
    assert decoder.layers == [] and decoder.quantized == []
