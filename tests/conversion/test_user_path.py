"""The user path: built-in model saved -> `qwen35-packed convert` -> AutoModelForCausalLM with and without
trust_remote_code."""

import subprocess
import sys

import pytest
import torch
import transformers
from conftest import builtin_pair


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_convert_then_load_with_and_without_remote_code(kind, tmp_path):
    builtin, _ = builtin_pair(kind, seed=3)
    src, out = tmp_path / "official", tmp_path / "packed"
    builtin.save_pretrained(src)
    subprocess.run(
        [sys.executable, "-m", "qwen35_packed.cli", "convert", str(src), str(out), "--no-progress"],
        check=True,
        capture_output=True,
    )

    ids = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = builtin(ids, use_cache=False).logits

    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    arch = "Qwen3_5MoePackedForCausalLM" if kind == "moe" else "Qwen3_5PackedForCausalLM"
    assert type(remote).__name__ == arch
    assert type(remote).__module__.startswith("transformers_modules.")
    with torch.no_grad():
        assert (remote(ids, use_cache=False).logits - expected).abs().max().item() <= 1e-4
        # packed on the loaded model: two documents in one row equal the two run alone
        packed = remote(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 50, 100]), use_cache=False).logits
    assert (packed.reshape(2, 50, -1) - expected).abs().max().item() <= 1e-4

    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(plain) is (transformers.Qwen3_5MoeForCausalLM if kind == "moe" else transformers.Qwen3_5ForCausalLM)
    with torch.no_grad():
        assert (plain(ids, use_cache=False).logits - expected).abs().max().item() <= 1e-4
