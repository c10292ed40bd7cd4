"""One GRPO step as TRL runs it without vLLM: generation, scoring and training, qwen35-packed vs the built-in.

`PackedGRPOTrainer` on this project's model against TRL's own `GRPOTrainer` on transformers' built-in Qwen3.5, each
with PEFT LoRA (r=16 on every GDN, attention and MLP projection; the experts too on the MoE), `use_vllm=False` (TRL's
default: completions come from `model.generate()`), bf16 weights, gradient checkpointing, a toy reward (the share of
words with an even id in a completion). A step is `--prompts` prompts x `--generations` completions of exactly
`--completion` tokens (random weights almost never draw the end token; the benchmark asserts the lengths) after
prompts of `--prompt` tokens. Prompts are random words of a word-level tokenizer built here at the model's
vocabulary (no Hub access needed), a new draw for every step.

Each step's seconds are split where TRL's own methods split them, with the device synchronised at each boundary:
generation (`_generate`), scoring (the rest of `_generate_and_score_completions`: rewards, old and reference
log-probs) and training (the rest of `training_step`: loss forward, backward). The first `--warmup` steps (kernel
compilation, autotuning) are reported apart from the timed ones. Weights are random (seed 0); both implementations
get the same shapes, not the same weights (one model is built at a time, so a 35B-A3B fits).

    python benchmarks/bench_grpo_step.py [--models qwen35_4b:8,qwen35_35b_a3b] [--impls ours,ours:static,builtin]
        [--prompts 8] [--generations 8] [--prompt 512] [--completion 256] [--steps 2] [--warmup 1]
        [--bf16-adapters] [--activation-offloading] [--micro-batches 1] [--generation-rounds 1]
        [--config FIELD=VALUE,..] [--device cuda]
        [--tiny] [--out FILE]

An implementation `NAME:static` sets `GRPOConfig(cache_implementation="static")` (ours: its decode steps replayed
as CUDA graphs); `ours` / `ours:dynamic` sets "dynamic" (PackedGRPOTrainer's own default on CUDA is the static cache),
`builtin` leaves TRL's default. LoRA adapters are PEFT's default, fp32 beside the bf16 base, unless --bf16-adapters;
each row records their count and dtype, and what was allocated when generation, scoring and training last started;
a row that runs out of memory also the part of the step it was in.
`--micro-batches m` trains a step's completions in m forwards of a share each (gradient accumulation), as a user short
of memory would; a step is still one optimizer step. Its completions are generated and scored at once, or with
`--generation-rounds g` (dividing m) in g rounds of m/g micro-batches each (TRL's `steps_per_generation`): a
generation's cache and prefill hold a g-th of the step's completions, while the weights, the adapters' gradients and
the optimizer's state are all allocated.

--tiny runs a small config on the CPU (a check that the script runs, not a measurement). Prints a table and writes
JSON under results/benchmarks/ (or --out) after every model, and after every step that ends (the running model's row
then `in_progress`, with its `steps_ended`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers
from bench_generate import MOE_MODEL, build, config_kwargs, git_commit, implementation_and_cache
from bench_train_step import peak_gib, sync
from bench_workload import config_fields

ROOT = Path(__file__).resolve().parent


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer with exactly `vocab_size` ids: <pad> 0, <eos> 1, <unk> 2, then words w3, w4, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def prompt_dataset(n: int, words: int, vocab_size: int, seed: int):
    import datasets

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (n, words), generator=gen).tolist()
    return datasets.Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in row) for row in ids]})


def even_words(completions, **_) -> list[float]:
    """The toy reward: the share of a completion's words with an even id (it varies within a group, so the
    advantages and the loss's gradient are not zero)."""
    return [
        sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1) for c in completions
    ]


class StepTimer:
    """Wraps a trainer's `_generate`, `_generate_and_score_completions` and `training_step` (instance attributes,
    so TRL's own calls go through them), synchronising the device around each, and splits every step's seconds;
    `phase()` names the part of the step running now (where an error such as running out of memory struck).
    `allocated_at_start` holds the GiB allocated when each part last started (CUDA): what a part that ran out of
    memory had left to it."""

    PHASES = {"_generate": "generation", "_generate_and_score_completions": "scoring", "training_step": "training"}

    def __init__(self, trainer, device: torch.device, calls_per_step: int = 1, allocated=None, on_step=None):
        """`calls_per_step`: training_step calls of one optimizer step (gradient accumulation: a generation round
        generates and scores the completions of one or more of them, each trains on its share). `allocated`: bytes
        allocated now (default: torch.cuda.memory_allocated on CUDA, nothing recorded elsewhere). `on_step` is called
        with the steps so far each time one ends."""
        self.device, self.steps, self.current, self.running, self.on_step = device, [], {}, [], on_step
        self.calls_per_step, self.calls = calls_per_step, 0
        if allocated is None and device.type == "cuda":
            allocated = torch.cuda.memory_allocated
        self.allocated, self.allocated_at_start = allocated, {}
        for name in self.PHASES:
            setattr(trainer, name, self._timed(name, getattr(trainer, name)))

    def phase(self) -> str:
        if not self.running:
            return "outside the timed methods (the optimizer's step, logging)"
        return f"{self.PHASES[self.running[-1]]} (step {len(self.steps)})"

    def _timed(self, name, method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            sync(self.device)
            if self.allocated is not None:
                self.allocated_at_start[self.PHASES[name]] = round(self.allocated() / 2**30, 2)
            start = time.perf_counter()
            self.running.append(name)
            result = method(*args, **kwargs)  # left on the stack if it raises: phase() names it
            self.running.pop()
            sync(self.device)
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start
            if name == "training_step":
                self.calls += 1
                if self.calls % self.calls_per_step == 0:
                    self._close_step()
            return result

        return run

    def _close_step(self):
        t = self.current
        generation = t.get("_generate", 0.0)
        scoring = t.get("_generate_and_score_completions", 0.0) - generation
        training = t["training_step"] - generation - scoring
        total = t["training_step"]
        self.steps.append({"generation_s": generation, "scoring_s": scoring, "training_s": training, "total_s": total})
        if self.on_step is not None:
            self.on_step(self.steps)
        self.current = {}


def run_trainer(
    model, impl: str, cache: str, tokenizer, args, device: torch.device, output_dir: str, progress=None
) -> dict:
    """One implementation's steps -> its result row; `progress(partial row)` after each step, so that a run cut
    short (a device call's time limit) still keeps the steps that ended."""
    import trl

    from qwen35_packed.integrations.grpo import PackedGRPOTrainer
    from qwen35_packed.integrations.lora import lora_config

    trainer_cls = PackedGRPOTrainer if impl == "ours" else trl.GRPOTrainer
    total_steps = args.warmup + args.steps
    completions = args.prompts * args.generations
    if completions % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches} does not divide {completions} completions")
    config = trl.GRPOConfig(
        output_dir=output_dir,
        # every completion of an optimizer step generated in --generation-rounds, trained in --micro-batches forwards
        per_device_train_batch_size=completions // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches,
        steps_per_generation=args.micro_batches // args.generation_rounds,
        num_generations=args.generations,
        max_completion_length=args.completion,
        max_steps=total_steps,
        learning_rate=1e-5,
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        generation_kwargs={"min_new_tokens": args.completion},
        # ours names its cache (PackedGRPOTrainer's own default on CUDA is the static one); the built-in's dynamic
        # row is TRL's default
        cache_implementation=cache if impl == "ours" or cache == "static" else None,
    )
    # the project's targets (GDN, attention, MLP, the experts of a MoE), matched by name in either implementation
    lora = lora_config(model, r=16, lora_alpha=32, lora_dropout=0.0)
    if args.bf16_adapters:  # wrapped here, as TRL would, but with the adapters in the base's dtype
        from peft import get_peft_model

        model, lora = get_peft_model(model, lora, autocast_adapter_dtype=False), None
    data = prompt_dataset(args.prompts * total_steps, args.prompt, model.config.vocab_size, seed=1)
    offloading = {"activation_offloading": True} if args.activation_offloading else {}
    trainer = trainer_cls(
        model=model,
        reward_funcs=even_words,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        **offloading,
    )
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    adapters = {
        "trained_parameters": sum(p.numel() for p in trained),
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trained}),
    }
    on_step = None
    if progress is not None:

        def on_step(steps):
            ended = [{k: round(v, 3) for k, v in step.items()} for step in steps]
            progress(
                {
                    "in_progress": f"{len(ended)} of {total_steps} steps ended",
                    "steps_ended": ended,
                    "adapters": adapters,
                    "peak_gib": peak_gib(device),
                }
            )

    timer = StepTimer(trainer, device, calls_per_step=args.micro_batches, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        first_line = str(error).splitlines()[0]
        return {
            "error": f"out of memory: {first_line}",
            "phase": timer.phase(),
            "allocated_at_phase_start_GiB": timer.allocated_at_start,
            "adapters": adapters,
            "peak_gib": peak_gib(device),
        }
    lengths = [log["completions/min_length"] for log in trainer.state.log_history if "completions/min_length" in log]
    if not lengths or min(lengths) != args.completion:
        raise RuntimeError(f"completions shorter than --completion {args.completion}: min lengths {lengths}")
    warm, timed = timer.steps[: args.warmup], timer.steps[args.warmup :]

    def mean(key):
        return round(sum(s[key] for s in timed) / len(timed), 3) if timed else None

    return {
        "trainer": trainer_cls.__name__,
        "adapters": adapters,
        "warmup_steps": [{k: round(v, 3) for k, v in s.items()} for s in warm],
        "timed_steps": len(timed),
        **{key: mean(key) for key in ("generation_s", "scoring_s", "training_s", "total_s")},
        "completion_tokens_per_step": args.prompts * args.generations * args.completion,
        "allocated_at_phase_start_GiB": timer.allocated_at_start,  # of the last step
        "peak_gib": peak_gib(device),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<30}{'impl':<16}{'gen s':>8}{'score s':>9}{'train s':>9}{'step s':>8}{'warm-up s':>11}{'GiB':>7}")
    for row in rows:
        r = row["result"]
        impl = f"{row['impl']}:{row['cache']}"
        if "error" in r:
            print(f"{row['model']:<30}{impl:<16}  {r['error'][:80]}")
            continue
        first = sum(s["total_s"] for s in r["warmup_steps"])
        print(
            f"{row['model']:<30}{impl:<16}{r['generation_s'] or 0:>8.2f}{r['scoring_s'] or 0:>9.2f}"
            f"{r['training_s'] or 0:>9.2f}{r['total_s'] or 0:>8.2f}{first:>11.1f}{r['peak_gib'] or 0:>7.1f}"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=f"qwen35_4b,{MOE_MODEL}")
    parser.add_argument("--impls", default="ours,ours:static,builtin", help="as bench_generate.py's")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=256, help="completion tokens")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones")
    parser.add_argument(
        "--bf16-adapters",
        action="store_true",
        help="LoRA adapters in the base's bf16 (get_peft_model(..., autocast_adapter_dtype=False) before the "
        "trainer), not PEFT's default fp32",
    )
    parser.add_argument(
        "--activation-offloading",
        action="store_true",
        help="PackedGRPOTrainer(activation_offloading=True): each training step in TRL's activation offloading "
        "(ours only: TRL's GRPOTrainer has no such option)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="train each step's completions in this many forwards (gradient accumulation)",
    )
    parser.add_argument(
        "--generation-rounds",
        type=int,
        default=1,
        help="generate each step's completions in this many rounds (dividing --micro-batches), each for its share",
    )
    parser.add_argument(
        "--config",
        default="",
        help="ours only: comma-separated FIELD=VALUE of the model config, e.g. moe_token_chunk=8192 (recorded in the "
        "setup)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fields = config_fields(args.config)
    if fields and any(i.split(":")[0] != "ours" for i in args.impls.split(",")):
        parser.error("--config sets fields of ours only")
    if args.micro_batches < 1:
        parser.error("--micro-batches must be at least 1")
    if args.generation_rounds < 1 or args.micro_batches % args.generation_rounds:
        parser.error("--generation-rounds must be a divisor of --micro-batches")
    if args.prompts % args.generation_rounds:  # TRL generates a prompt's completions in one round
        parser.error("--generation-rounds must be a divisor of --prompts")
    if args.activation_offloading and any(i.split(":")[0] != "ours" for i in args.impls.split(",")):
        parser.error("--activation-offloading is an option of ours (PackedGRPOTrainer) only")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    date = datetime.date.today().isoformat()
    out = (
        Path(args.out) if args.out else ROOT.parent / "results" / "benchmarks" / f"{date}-grpo-step-{device.type}.json"
    )
    report = {
        "date": date,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "setup": {
            k: getattr(args, k)
            for k in (
                "prompts",
                "generations",
                "prompt",
                "completion",
                "steps",
                "warmup",
                "bf16_adapters",
                "activation_offloading",
                "micro_batches",
                "generation_rounds",
            )
        }
        | {"config_fields_set": fields},
        "rows": [],
    }

    def write(content: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(content, indent=1) + "\n")

    for spec in args.models.split(","):
        name, key, kwargs = config_kwargs(spec, args.tiny)
        tokenizer = word_tokenizer(kwargs["vocab_size"])
        for impl, cache in map(implementation_and_cache, args.impls.split(",")):
            model = build(key, impl, {**kwargs, **fields}, device, dtype).train()
            row = {"model": name, "impl": impl, "cache": cache}

            def progress(partial, row=row):
                write(report | {"rows": [*report["rows"], row | {"result": partial}]})

            try:
                with tempfile.TemporaryDirectory() as output_dir:
                    result = run_trainer(model, impl, cache, tokenizer, args, device, output_dir, progress)
            except torch.OutOfMemoryError as error:
                result = {
                    "error": f"out of memory: {str(error).splitlines()[0]}",
                    "phase": "setup (the adapters, the trainer)",
                    "peak_gib": peak_gib(device),
                }
            report["rows"].append(row | {"result": result})
            print_table(report["rows"][-1:])
            write(report)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print_table(report["rows"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
