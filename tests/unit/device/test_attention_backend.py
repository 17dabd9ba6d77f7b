"""`model.attention_backend`: what auto means where, and `triton` refused at start-up where it
cannot run (no CUDA, no triton), naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.daemon.shared.runtime import build_runtime
from decode_worker.device import attention_backend
from decode_worker.device.attention_backend import resolve_attention_backend
from decode_worker.errors import ConfigError
from decode_worker.settings import load_settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_when_triton_imports_and_torch_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("torch", CUDA) == "torch"
    monkeypatch.setattr(attention_backend, "triton_import_error", lambda: None)
    assert resolve_attention_backend("auto", CUDA) == "triton"
    assert resolve_attention_backend("triton", CUDA) == "triton"
    monkeypatch.setattr(attention_backend, "triton_import_error",
                        lambda: "No module named 'triton'")
    assert resolve_attention_backend("auto", CUDA) == "torch"
    with pytest.raises(ConfigError, match="model.attention_backend='triton': triton does not "
                                          "import .No module named 'triton'."):
        resolve_attention_backend("triton", CUDA)
    with pytest.raises(ConfigError, match="model.attention_backend='flash'"):
        resolve_attention_backend("flash", CUDA)


def test_triton_without_cuda_is_a_startup_error_naming_the_setting(tmp_path: Path) -> None:
    settings = load_settings(overrides={
        "model.attention_backend": "triton", "model.device": "cpu",
        "model.cache_dir": str(tmp_path)}).settings
    with pytest.raises(ConfigError, match="model.attention_backend='triton' needs a CUDA "
                                          "device .the model runs on cpu.; use 'auto' or "
                                          "'torch'"):
        build_runtime(settings, use_cuda_graph=True)


def test_an_unknown_backend_is_refused_when_settings_load() -> None:
    with pytest.raises(ConfigError, match="model.attention_backend"):
        load_settings(overrides={"model.attention_backend": "flash"})
