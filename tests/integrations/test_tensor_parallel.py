"""transformers' tensor parallelism on CPU (gloo, 2 processes under torchrun): a folder loaded with
`from_pretrained(tp_plan="auto")` shards attention, GDN, the dense MLPs / the shared expert and lm_head by the
classes' plans (the built-in's), and a packed training step gives the unsharded loss, logits and every gradient;
with lm_head tied to the embedding too, whose sharded weight the chunked loss gathers."""

from pathlib import Path

import pytest
import torch
from fixtures_distributed import run_worker_script
from tensor_parallel_case import batch, build

WORKER = Path(__file__).resolve().parent / "tensor_parallel_worker.py"


@pytest.mark.parametrize("kind", ["dense", "moe"], ids=["dense-tied", "moe-untied"])
def test_tensor_parallel_step_equals_the_unsharded_step(tmp_path, kind):
    model = build(kind)
    model.save_pretrained(tmp_path / "folder")
    ids, cu = batch()
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    with torch.no_grad():
        logits = model.eval()(ids, cu_seqlens=cu).logits
    out = tmp_path / "sharded.pt"
    run_worker_script(WORKER, "--folder", tmp_path / "folder", "--kind", kind, "--out", out)
    sharded = torch.load(out)
    # the plans took effect: lm_head and the attention / GDN projections are sharded
    assert "lm_head.weight" in sharded["sharded"] or "model.embed_tokens.weight" in sharded["sharded"]
    assert any(".self_attn.q_proj." in name for name in sharded["sharded"])
    assert any(".linear_attn.in_proj_qkv." in name for name in sharded["sharded"])
    assert abs(sharded["loss"].item() - loss.item()) <= 1e-5
    assert (sharded["logits"] - logits).abs().max().item() <= 1e-5
    expected = {name: param.grad for name, param in model.named_parameters()}
    assert sharded["grads"].keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(sharded["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
