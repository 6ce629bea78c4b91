"""The trainer's choice of attention backend on CUDA (``cudnn_attention``), and the stride pattern behind it.

The Flux-width trainer failed on an H100 (torch 2.11) with ``CUBLAS_STATUS_EXECUTION_FAILED``, then an illegal
memory access. The lead: torch >= 2.10 prefers cuDNN's attention on sm90/sm100, whose backward (cuDNN >= 9.5) takes
the output gradient with the strides it arrives with, and Flux's two kinds of blocks hand it two row strides. The
second test pins that pattern on the CPU, with diffusers' own blocks: what a GPU run needs to confirm or rule out.
"""

from __future__ import annotations

import pytest
import torch

from manifests.errors import UsageError
from train.backends import choose_attention


def test_auto_turns_cudnn_attention_off_where_torch_prefers_it_and_says_why(tmp_path):
    from train.config import load_config

    allow, why = choose_attention("auto", (9, 0), "2.11.0+cu130")
    assert allow is False and "cuDNN SDPA off" in why and "sm90" in why and "cudnn_attention: on" in why
    assert choose_attention("auto", (10, 0), "2.13.0")[0] is False
    assert choose_attention("auto", (9, 0), "2.9.1+cu128")[0] is None  # before 2.10: flash first already
    assert choose_attention("auto", (8, 0), "2.13.0")[0] is None  # A100: torch does not prefer cuDNN there
    assert choose_attention("on", (9, 0), "2.11.0")[0] is True and choose_attention("off", (8, 9), "2.4.0")[0] is False
    assert choose_attention("auto", None, "2.13.0") == (None, "")  # no CUDA: nothing chosen, nothing said
    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on")):
        (tmp_path / "c.yaml").write_text(f"cudnn_attention: {text}\n")  # YAML 1.1 reads on/off/true as booleans
        assert load_config(tmp_path / "c.yaml").cudnn_attention == want
    (tmp_path / "c.yaml").write_text("cudnn_attention: sometimes\n")
    with pytest.raises(UsageError, match="cudnn_attention must be auto, on or off"):
        load_config(tmp_path / "c.yaml")


def test_flux_single_stream_blocks_hand_attention_a_gradient_with_another_row_stride(monkeypatch):
    """SDPA's output gradient in Flux's blocks: the single-stream block's is a slice of the joined attention + MLP
    gradient (row stride dim + mlp = 5 x dim: 15,360 at Flux's 3,072), the double-stream block's has row stride dim.
    The same q/k/v shapes, two layouts of the gradient: a backward graph cached by shapes alone would replay one on
    the other."""
    import torch.nn.functional as F
    from diffusers import FluxTransformer2DModel

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        out.register_hook(lambda g: seen.append((tuple(g.shape), g.stride())))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    dim, heads = 32, 2
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=dim // heads, num_attention_heads=heads, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))  # fmt: skip
    image, text = 16, 8
    out = model(hidden_states=torch.randn(1, image, 16), encoder_hidden_states=torch.randn(1, text, 32),
                pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]), img_ids=torch.zeros(image, 3),
                txt_ids=torch.zeros(text, 3)).sample  # fmt: skip
    out.square().mean().backward()
    assert len(seen) == 2  # backward reaches the single-stream block first
    (single_shape, single), (double_shape, double) = seen
    assert single_shape == double_shape == (1, heads, image + text, dim // heads)  # the same shapes
    mlp = model.single_transformer_blocks[0].mlp_hidden_dim
    assert mlp == 4 * dim and single[2] == dim + mlp == 5 * dim  # (B, H, L, D) strides: the row stride is [2]
    assert double[2] == dim and single[1] == double[1] == dim // heads and single[3] == double[3] == 1
