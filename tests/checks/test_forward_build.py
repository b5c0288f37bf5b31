"""The forward check builds its model without random initialisation (fast on large checkpoints);
the logits must be exactly those of a model built the slow, initialised way with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.checks.forward import build_model
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick


def _initialised_reference(directory: Path) -> torch.nn.Module:
    """transformers' plain path: random init on the CPU, then the checkpoint's weights over it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state, strict=False)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_uninitialised_build_gives_the_same_logits(tmp_path: Path, tied: bool) -> None:
    d = make_tiny_checkpoint(tmp_path / "ckpt", seed=7, shards=2, config_overrides={"tie_word_embeddings": tied})
    ids = torch.tensor([[1, 5, 9, 13, 2, 40]])
    rng = torch.get_rng_state()
    model = build_model(d, "cpu")
    assert torch.equal(torch.get_rng_state(), rng), "build_model drew random weights it then overwrote"
    with torch.inference_mode():
        fast = model(input_ids=ids).logits
        slow = _initialised_reference(d)(input_ids=ids).logits
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, slow)
