"""`aiayn trace`: the walk-through names every block in running order with true shapes."""

from __future__ import annotations

import torch

from aiayn.cli import main
from aiayn.config import load_config
from aiayn.inspect.trace import trace_forward
from aiayn.model import Transformer


def test_trace_rows_follow_the_forward_pass():
    cfg = load_config("configs/tiny.yaml").model
    model = Transformer(cfg)
    src = torch.randint(4, cfg.src_vocab_size, (3, 11))
    tgt = torch.randint(4, cfg.tgt_vocab_size, (3, 7))
    rows = trace_forward(model, src, tgt)
    by_name = {r.name: r for r in rows}
    d, V = cfg.d_model, cfg.tgt_vocab_size
    assert by_name["src_embed"].shape == (3, 11, d)
    assert by_name["encoder.layers.0.self_attn.qkv_proj"].shape == (3, 11, 3 * d)
    assert by_name["decoder.layers.0.cross_attn.q_proj"].shape == (3, 7, d)
    assert by_name["decoder.layers.0.cross_attn.kv_proj"].shape == (3, 11, 2 * d)
    assert by_name["decoder.layers.1.feed_forward.linear1"].shape == (3, 7, cfg.d_ff)
    assert by_name["generator"].shape == (3, 7, V)
    assert rows[0].shape == (3, 7, V) and rows[0].params == model.num_parameters()
    order = [r.name for r in rows]
    assert order.index("encoder") < order.index("decoder") < order.index("generator")
    # post-norm: the residual's LayerNorm runs after its sub-layer
    assert order.index("encoder.layers.0.self_attn") < order.index("encoder.layers.0.sublayer1.norm")


def test_trace_restores_training_mode_and_removes_hooks():
    cfg = load_config("configs/tiny.yaml").model
    model = Transformer(cfg).train()
    src = torch.randint(4, cfg.src_vocab_size, (1, 5))
    trace_forward(model, src, src)
    assert model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_trace_command_prints_the_table(capsys):
    assert main(["trace", "--config", "configs/tiny.yaml", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "MultiHeadAttention" in out and "Generator" in out
    assert "2x10x64" in out  # logits: batch 2, target length 10, vocabulary 64


def test_bad_config_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 30\n  n_heads: 4\n")
    assert main(["trace", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("aiayn: error:") and "bad.yaml" in err
    assert "Traceback" not in err
