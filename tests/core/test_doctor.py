"""``loongsage doctor``: one line per need of a run on this machine, the fix beside what is missing,
and a non-zero exit when a capability asked for is missing. Run here as a user runs it (the
launcher's own entry point), against this machine's real state: no GPU, no SGLang, Megatron-Core
and bubblewrap as the dev environment installs them."""

from __future__ import annotations

import pytest
import torch

from loongsage.core.cli import main
from loongsage.core.doctor import Capability, backend_checks
from loongsage.core.plugins import load_registry
from loongsage.core.types import Check, ConfigError

NO_GPU = not torch.cuda.is_available()


def _doctor(capsys, *flags: str) -> tuple[int, dict[str, str]]:
    rc = main(["doctor", *flags])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("doctor: asked for ")
    return rc, {line[6:].split("  ")[0].strip(): line for line in lines[:-1]}


def test_the_machine_alone_is_checked_and_nothing_is_required_beyond_it(capsys):
    rc, lines = _doctor(capsys)
    assert rc == 0
    for name in ("python", "torch", "ray", "shared memory", "NCCL", "GPUs (torch)"):
        assert name in lines, name
    assert lines["python"].startswith("ok ")
    assert all(not line.startswith("FAIL") for line in lines.values())  # nothing was asked for


@pytest.mark.skipif(not NO_GPU, reason="checks the answer of a machine without a GPU")
def test_asking_for_a_gpu_on_a_cpu_machine_fails_naming_the_fix(capsys):
    rc, lines = _doctor(capsys, "--gpu")
    assert rc == 1
    assert lines["GPUs (torch)"].startswith("FAIL") and "-> check the driver" in lines["GPUs (torch)"]
    assert lines["python"].startswith("ok ")


@pytest.mark.skipif(not NO_GPU, reason="SGLang serves on CUDA GPUs only")
def test_sglang_asked_for_without_sglang_or_a_gpu_fails_with_the_install_line(capsys):
    rc, lines = _doctor(capsys, "--sglang")
    assert rc == 1
    assert lines["sglang: loongsage-sglang"].startswith("ok ")  # the plugin is installed,
    assert lines["sglang: a CUDA GPU to serve on"].startswith("FAIL")  # what it drives is not
    if "not installed" in lines["sglang: sglang"]:
        assert "-> pip install 'sglang[all]==0.5.16'" in lines["sglang: sglang"]


def test_megatron_is_present_and_transformer_engine_is_optional(capsys):
    pytest.importorskip("megatron.core")
    rc, lines = _doctor(capsys, "--megatron")
    assert rc == 0
    assert lines["megatron: megatron-core"].startswith("ok ")
    te = lines["megatron: Transformer Engine (layer_spec te)"]
    assert te.startswith("ok ") or te.startswith("-- ")  # reported, never required


def test_the_sandbox_answer_follows_the_jail_probe(capsys):
    from loongsage.sandbox.jail import jail_problem

    rc, lines = _doctor(capsys, "--sandbox")
    assert rc == (0 if jail_problem() is None else 1)
    assert lines["sandbox: bubblewrap jail"].startswith("ok " if jail_problem() is None else "FAIL")


def test_a_backend_not_installed_is_one_line_with_its_package():
    checks = backend_checks("fp8", Capability("trainer", "no-such-trainer", "loongsage-fp8"), load_registry([]))
    assert checks == [Check("fp8: loongsage-fp8", False, "not installed", "pip install loongsage-fp8")]


def test_a_doctor_flag_that_is_not_callable_is_refused_when_the_plugin_loads(tmp_path, monkeypatch):
    (tmp_path / "bad_doctor_plugin.py").write_text(
        "from loongsage.core.hookspecs import hookimpl\n"
        "from loongsage.core.engine.native import NativeEngine\n"
        "class Odd(NativeEngine):\n"
        "    doctor = 'bubblewrap'\n"
        "@hookimpl\n"
        "def loongsage_backends():\n"
        "    return {'odd': Odd}\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"engine 'odd' .*doctor='bubblewrap': expected a callable"):
        load_registry(["bad_doctor_plugin"]).names("engine")
