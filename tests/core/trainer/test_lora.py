"""LoRA in the torch trainer: merged export, adapter-only training, exact resume, engine sync, DP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loongsage.algos.policy_losses import PPOClip
from loongsage.core.engine.native import NativeEngine
from loongsage.core.loss import LossPlan
from loongsage.core.placement import free_port
from loongsage.core.plugins import load_registry
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.lora import LoraConfig, require_peft
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.types import ConfigError, GenerationRequest, SamplingParams, TrainBatch

WORKER = Path(__file__).with_name("_lora_dp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _lora_dp_worker import lora_batch, trained_adapters  # noqa: E402

LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-lora")
    build_tiny_qwen3(path, hidden_size=32, num_layers=2, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return str(path)


def _base(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _trainer(model_dir: str, lr: float = 1e-2, **lora) -> TorchTrainer:
    trainer = TorchTrainer(model_dir, lora=LoraConfig(**{"rank": 4, "alpha": 8.0, **lora}))
    trainer.setup_optimizer(lr, [0.9, 0.999], 1e-8, 0.0, 1.0)
    return trainer


def _steps(trainer: TorchTrainer, batch: TrainBatch, n: int = 2) -> None:
    pipeline = LossPlan(policy_loss=PPOClip())
    prepared, _ = pipeline.prepare(batch)
    for _ in range(n):
        trainer.train_step(prepared, pipeline.closure(), 10_000)


def test_export_is_the_base_model_at_init_and_only_adapters_train(model_dir):
    base = _base(model_dir)
    trainer = _trainer(model_dir, target_modules=["q_proj", "v_proj", "down_proj"])
    exported = dict(trainer.export_weights())
    # only the targeted weights travel, under the base checkpoint's names
    assert sorted(exported) == sorted(
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    for name, tensor in exported.items():  # lora_B starts at zero: merged == base, bit for bit
        assert torch.equal(tensor, base[name]), name
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable) == 2 * 6

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _steps(trainer, lora_batch())
    for name, p in trainer.model.named_parameters():
        changed = not torch.equal(p, before[name])
        if ".lora_B." in name or ".lora_A." in name:  # B moves at step 1, A once B is non-zero
            assert changed, name
        else:
            assert not changed, name
    assert any(not torch.equal(t, base[n]) for n, t in trainer.export_weights())


def test_merged_export_equals_peft_merge_and_unload(model_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir, target_modules=["q_proj", "up_proj"])
    _steps(trainer, lora_batch())
    # an independent reference: peft's own model wrapper, given our adapters, merged and unloaded
    ref = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "up_proj"]),
    )
    adapters = {n: p for n, p in trainer.model.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".lora_" in name:
                p.copy_(adapters[name.removeprefix("base_model.model.")])
    merged = ref.merge_and_unload().state_dict()
    exported = dict(trainer.export_weights())
    assert len(exported) == 4
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-7, rtol=0, msg=name)

    # export_hf: a plain HF folder (no peft names) holding the merged model
    trainer.export_hf(tmp_path / "hf")
    assert not (tmp_path / "hf" / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert loaded.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0, msg=name)


def test_save_load_restores_adapters_and_optimizer_exactly(model_dir, tmp_path):
    batch = lora_batch()
    a = _trainer(model_dir)
    _steps(a, batch)
    a.save(tmp_path / "ck")
    saved = torch.load(tmp_path / "ck" / "trainer.pt", weights_only=False)
    assert saved["model"] and all(".lora_" in n for n in saved["model"])  # the base is not duplicated
    torch.manual_seed(123)  # a different random lora_A init: the load must overwrite it
    b = _trainer(model_dir)
    b.load(tmp_path / "ck")
    assert b.steps == 2
    _steps(a, batch, 1)
    _steps(b, batch, 1)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)

    other = _trainer(model_dir, rank=2)
    with pytest.raises(ValueError, match="same lora rank") as err:
        other.load(tmp_path / "ck")
    assert "\n" not in str(err.value)


def test_engine_logprobs_after_a_push_equal_the_trainers(model_dir):
    trainer = _trainer(model_dir, lr=5e-2)
    _steps(trainer, lora_batch(), 3)
    pushed = NativeEngine(model_dir, max_model_len=64, seed=0)
    stale = NativeEngine(model_dir, max_model_len=64, seed=0)
    assert pushed.update_weights(trainer.export_weights()) == 1
    g = torch.Generator().manual_seed(9)
    vocab = trainer.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 7)]
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=8, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = [r for (r,) in pushed.generate_batch(requests)]

    T = max(len(p) + len(r.output_ids) for p, r in zip(prompts, results))
    ids, attn, mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T)
    for i, (p, r) in enumerate(zip(prompts, results)):
        seq = p + r.output_ids
        ids[i, : len(seq)], attn[i, : len(seq)], mask[i, len(p) : len(seq)] = torch.tensor(seq), 1, 1
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        rollout_logprobs=torch.zeros(3, T),
        advantages=torch.zeros(3, T),
        rewards=torch.zeros(3),
        group_ids=torch.arange(3),
    )
    lp, _ = trainer.logprobs(batch, 10_000)
    for i, (p, r) in enumerate(zip(prompts, results)):
        torch.testing.assert_close(
            torch.tensor(r.logprobs), lp[i, len(p) : len(p) + len(r.output_ids)], atol=1e-5, rtol=0
        )
    # the push mattered: the base model scores the same tokens differently
    forced = [
        GenerationRequest(f"s{i}", p + r.output_ids[:-1], SamplingParams(temperature=0, max_new_tokens=1))
        for i, (p, r) in enumerate(zip(prompts, results))
    ]
    new = [r.logprobs[0] for (r,) in pushed.generate_batch(forced)]
    old = [r.logprobs[0] for (r,) in stale.generate_batch(forced)]
    assert max(abs(a - b) for a, b in zip(new, old)) > 1e-3


def test_config_errors_are_one_line(model_dir, monkeypatch):
    registry = load_registry()
    supplied = {"model_path": model_dir}
    for params, expected in [
        ({"lora": {"rank": 0}}, "trainer.backend.params.lora.rank=0: must be >= 1"),
        ({"lora": {"rank": 4, "dropout": 1.0}}, "lora.dropout=1.0: must be in [0, 1)"),
        (
            {"lora": {"target_modules": ["qproj"]}},
            f"'qproj' is not a linear layer of the decoder; allowed: {', '.join(LINEARS)}",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            registry.create("trainer", {"name": "torch", "params": params}, "trainer.backend", **supplied)
        assert expected in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not support LoRA"):
        registry.create(
            "trainer", {"name": "torch_critic", "params": {"lora": {}}}, "trainer.critic.backend", **supplied
        )

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"install it with: pip install 'loongsage-core\[lora\]'"):
        require_peft()


def test_launcher_refuses_a_bad_target_before_any_actor_starts(model_cache, in_tmp, capsys, monkeypatch):
    """Checks that need the model's layer names run in the driver: one line, exit code 2, no actor."""
    import ray

    from loongsage.core.cli import main
    from loongsage.core.controller import Controller

    ray_was_up = ray.is_initialized()  # an earlier test of this process may have started Ray

    def started(*args, **kwargs):
        raise AssertionError("the launcher started actors before refusing the recipe")

    monkeypatch.setattr(Controller, "_start_actors", started)

    code = main(
        ["train", "tiny/grpo_lora_cpu", "trainer.backend.params.lora.target_modules=[qproj]", "tracking.progress=false"]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the launcher's log lines come first
    assert code == 2
    assert err.startswith(
        "loongsage: error: trainer.backend.params.lora.target_modules: 'qproj' is not a linear "
        "layer of the decoder; allowed: down_proj"
    )
    code = main(["train", "tiny/grpo_lora_cpu", "trainer.world_size=2", "tracking.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(
        "loongsage: error: trainer.backend.params.lora: dp_mode='fsdp2' is not supported with LoRA"
    )
    assert ray.is_initialized() == ray_was_up


def test_replicated_dp2_equals_dp1_and_fsdp2_is_refused(model_dir, tmp_path):
    """Two replicas (different seeds, uneven rows) end where one process on all rows ends."""
    port, prefix = str(free_port()), str(tmp_path / "dp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", port, model_dir, prefix],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    ranks = [dict(np.load(f"{prefix}-rank{r}.npz")) for r in range(2)]
    assert "refused" in ranks[0] and "dp_mode='replicate'" in str(ranks[0].pop("refused"))
    ranks[1].pop("refused")
    torch.manual_seed(1)  # rank 0's seed: the replicas start from rank 0's adapters
    ref = trained_adapters(model_dir, list(range(8)))
    assert ranks[0].keys() == ranks[1].keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)  # replicas agree exactly
        np.testing.assert_allclose(ranks[0][name], ref[name], atol=1e-6, rtol=1e-4, err_msg=name)


def test_gradient_checkpointing_still_trains_the_adapters(model_dir):
    """Checkpointed layers whose input (the frozen embedding's output) has no grad must still give
    the adapters the same gradients as a plain forward."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        trainer = TorchTrainer(model_dir, gradient_checkpointing=checkpointing, lora=LoraConfig(rank=4, alpha=8.0))
        trainer.setup_optimizer(1e-30, [0.9, 0.999], 1e-8, 0.0, 1e9)  # lr ~ 0: gradients at the start point
        _steps(trainer, lora_batch(), 1)
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    assert all(checkpointed[n] is not None for n in plain)
    assert any(float(g.abs().sum()) > 0 for n, g in checkpointed.items() if ".lora_B." in n)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-7, rtol=1e-5, msg=name)


def test_the_kl_reference_is_the_base_model_with_adapters_off(model_dir):
    """A LoRA policy's frozen reference needs no second model: its adapters switched off give it."""
    plain = TorchTrainer(model_dir)
    assert plain.reference_logprobs(lora_batch(), 10_000) is None  # full fine-tuning keeps its own reference
    trainer = _trainer(model_dir)
    batch = lora_batch()
    base_lp = plain.logprobs(batch, 10_000)[0]
    _steps(trainer, batch)
    trained_lp = trainer.logprobs(batch, 10_000)[0]
    assert not torch.equal(trained_lp, base_lp)  # the adapters moved the policy
    torch.testing.assert_close(trainer.reference_logprobs(batch, 10_000), base_lp, atol=1e-6, rtol=0)
    # the adapters are back on and still train afterwards
    assert torch.equal(trainer.logprobs(batch, 10_000)[0], trained_lp)
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if ".lora_" in n)
