"""Oracle fixtures: the tiny default model written once, loaded by both runtimes (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def model(model_dir: Path) -> GptOssModel:
    return load_model(model_dir, "cpu", torch.float32)


@pytest.fixture(scope="session")
def reference(model_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    ref = transformers.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return ref.eval()
