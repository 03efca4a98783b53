"""The ``megatron`` trainer against the torch trainer on the same checkpoint and batch (fp32, rows
padded on either side): the same log-probs and entropies, the same exported HF tensors, the same
first gradient; a checkpoint resumes exactly (weights and optimizer); the HF export loads in
transformers as the tensors it pushes; the megatron teacher scores as the embedded one. Megatron runs in a
process of its own (its CPU shims).
And the trainer is the core's skeleton over the Megatron adapter, not a torch trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "engine"))
from _engine_helpers import build_engine_test_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _worker_server import run_worker  # noqa: E402

WORKER = Path(__file__).with_name("_trainer_worker.py")


@pytest.mark.timeout(300)
def test_the_megatron_trainer_computes_as_the_torch_trainer(tmp_path):
    model_dir = build_engine_test_model(tmp_path / "m")
    run = run_worker(WORKER, model_dir, str(tmp_path), timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["logprob_diff"] < 1e-5 and r["entropy_diff"] < 1e-5, r  # measured 0.0 and 0.0
    assert r["export_names_equal"] and r["export_exact"], r
    assert r["grad_norm_rel_diff"] < 1e-5, r
    assert r["logprob_diff_after_step"] < 1e-4, r  # measured 2.4e-6: AdamW over merged tensors rounds apart
    assert r["resumed_exact"] and r["resumed_step_exact"] and r["export_hf_exact"], r
    assert r["bf16_head_float32"] and r["bf16_logprob_mean_diff"] < 1e-3, r  # measured 0.0 on CPU
    # the megatron teacher (MOPD) scores the student's tokens as the embedded teacher does
    assert r["teacher_logprob_diff"] < 1e-5 and r["teacher_topk_diff"] < 1e-5 and r["teacher_full_diff"] < 1e-5, r
    assert r["teacher_topk_ids_equal"] and r["teacher_frozen"], r


def test_the_megatron_trainer_is_the_skeleton_over_its_own_adapter():
    """Not a torch trainer: the core's skeleton (nothing of it defined again) driving the Megatron
    adapter, which implements every member of the model-adapter contract."""
    from loongsage.core import contract_check
    from loongsage.core.trainer.adapter import ModelAdapter
    from loongsage.core.trainer.skeleton import TrainerSkeleton
    from loongsage.core.trainer.torch_model import TorchModel
    from loongsage.core.trainer.torch_trainer import TorchTrainer
    from loongsage.megatron.adapter import MegatronModel
    from loongsage.megatron.trainer import MegatronTrainer

    assert MegatronTrainer.__mro__[1] is TrainerSkeleton and not issubclass(MegatronTrainer, TorchTrainer)
    assert not issubclass(MegatronModel, TorchModel)
    skeleton = {
        name
        for name, value in vars(TrainerSkeleton).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, (property, classmethod)))
    }
    assert not skeleton & set(vars(MegatronTrainer))
    built_in_init = {"model"}  # set when the model is built
    missing = [
        m.name
        for m in contract_check.members(ModelAdapter)
        if m.name not in built_in_init and not hasattr(MegatronModel, m.name)
    ]
    assert not missing
