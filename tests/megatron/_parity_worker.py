"""Run by test_megatron_model.py in a process of its own (Megatron's CPU shims patch torch.cuda):
``python _parity_worker.py MODEL_DIR OUT_JSON TP``. Each of TP gloo ranks builds its shard of the
Megatron model from the HF checkpoint; rank 0 compares the gathered logits with HF's and the
gathered weights, converted back, with the checkpoint."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(rank: int, world: int, model_dir: str, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from loongsage.megatron.cpu import apply_cpu_shims

    apply_cpu_shims()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state, tensor_parallel

    from loongsage.megatron.convert import Shape, mcore_to_hf
    from loongsage.megatron.forward import gpt_logits
    from loongsage.megatron.layout import Layout
    from loongsage.megatron.model import build_gpt, load_hf_weights

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hf = {n: t for p in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(str(p)).items()}
    shape = Shape.of(config)
    layout = Layout(tp=world)
    model = build_gpt(config, dtype=torch.float32, layout=layout, padded_vocab=shape.padded_vocab(world))
    load_hf_weights(model, hf, config, layout)
    model.eval()
    tokens = torch.randint(0, shape.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the trainer's forward: [b, s, this rank's vocabulary rows]
        local = gpt_logits(model, tokens, torch.ones_like(tokens), 1, vocab=shape.padded_vocab(world))
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(local)[..., : shape.vocab]
    shards = [None] * world
    dist.all_gather_object(shards, {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    if rank == 0:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            expected = reference(tokens).logits
        back = dict(mcore_to_hf(shards, shape))
        wanted = {n: t for n, t in hf.items() if not (shape.tied and n == "lm_head.weight")}
        Path(out).write_text(
            json.dumps(
                {
                    "max_abs_logit_diff": (logits - expected).abs().max().item(),
                    "logit_scale": expected.abs().max().item(),
                    "local_vocab_rows": local.shape[-1],
                    "round_trip_exact": back.keys() == wanted.keys()
                    and all(torch.equal(back[n], wanted[n]) for n in wanted),
                    "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__,
                }
            )
        )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, out, tp, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if tp == 1:
        run(0, 1, model_dir, out, port)
    else:
        from _ranks import start_ranks

        start_ranks(run, (tp, model_dir, out, port), tp)
