"""End-to-end fixtures: the tiny model on disk and the reference implementation's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.device.default_model import write_model


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("e2e") / "tiny-gpt-oss", seed=0)


@pytest.fixture(scope="session")
def reference_greedy(e2e_model_dir: Path):  # type: ignore[no-untyped-def]
    """input_ids, max_new -> the reference implementation's greedy output ids and their
    logprobs (float32)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GptOssForCausalLM.from_pretrained(e2e_model_dir, dtype=torch.float32)
    model.eval()

    def generate(input_ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and each one's logprob under the raw logits."""
        ids = torch.tensor([input_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = [int(t) for t in out.sequences[0, len(input_ids):]]
        logprobs = [float(torch.log_softmax(step[0].float(), -1)[t])
                    for step, t in zip(out.logits, tokens, strict=True)]
        return tokens, logprobs

    return generate
