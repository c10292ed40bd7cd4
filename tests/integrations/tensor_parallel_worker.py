"""Worker for tests/integrations/test_tensor_parallel.py, run under torchrun on CPU (gloo, 2 ranks): a saved tiny
folder loaded with transformers' tensor parallelism (`from_pretrained(tp_plan="auto")`, the config's
base_model_tp_plan and the class's lm_head entry), then in fp32 a packed forward with labels and its backward, and
an eval forward without labels (logits through the sharded lm_head). Rank 0 writes the loss, the logits and every
parameter's full gradient to OUT."""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tensor_parallel_case import CLASSES, batch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--kind", required=True, choices=sorted(CLASSES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = CLASSES[args.kind].from_pretrained(args.folder, tp_plan="auto")
    ids, cu = batch()
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name] = grads[name].detach().clone()
    with torch.no_grad():
        logits = model.eval()(ids, cu_seqlens=cu).logits
    sharded = sorted(name for name, param in model.named_parameters() if hasattr(param, "full_tensor"))
    if dist.get_rank() == 0:
        torch.save({"loss": loss.detach(), "logits": logits, "grads": grads, "sharded": sharded}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
