"""gpt-oss model: config, weights loading (safetensors, MXFP4) and the forward pass."""

from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model

__all__ = ["GptOssConfig", "GptOssModel", "load_model"]
