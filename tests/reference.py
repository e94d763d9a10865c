"""The numerical oracle: transformers' DeepSeek-V4 on CPU in float32, built from the same config.json dict
jaxserve parses, with its zero-initialised parameters randomised, saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def build_reference(raw_config: dict, seed: int = 0) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV4Config(**{k: v for k, v in raw_config.items() if k != "model_type"}, initializer_range=0.15)
    model = DeepseekV4ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("tid2eid"):
                n_experts = config.n_routed_experts
                rows = [
                    torch.randperm(n_experts, generator=generator)[: tensor.shape[1]] for _ in range(tensor.shape[0])
                ]
                tensor.copy_(torch.stack(rows))
    return model


def save_reference(model: DeepseekV4ForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def reference_logits(model: DeepseekV4ForCausalLM, tokens: np.ndarray) -> np.ndarray:
    """Full-sequence logits [t, V] for one prompt."""
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens, np.int64))[None]).logits
    return out[0].float().numpy()


def load_reference(folder: Path) -> DeepseekV4ForCausalLM:
    """transformers' DeepSeek-V4 reading a checkpoint folder, in float32; every tensor must be used."""
    model, info = DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    return model.float().eval()


def reference_logprobs(model: DeepseekV4ForCausalLM, tokens) -> np.ndarray:
    """log-softmax of the full-sequence logits [t, V]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(tokens, np.int64))[None]).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()


def reference_greedy(model: DeepseekV4ForCausalLM, prompt, n: int) -> tuple[list[int], np.ndarray]:
    """The n greedy tokens after `prompt` (full forward each step, no cache) and the log-softmax row [n, V] each
    was chosen from."""
    tokens, rows = list(prompt), []
    for _ in range(n):
        row = reference_logprobs(model, tokens)[-1]
        rows.append(row)
        tokens.append(int(np.argmax(row)))
    return tokens[len(prompt) :], np.stack(rows)
