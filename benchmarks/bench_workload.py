"""What one GPU trains: the whole Qwen3.5-35B-A3B with LoRA and Qwen3.5-4B fully fine-tuned, on the RL batch and on
single long documents; ours or transformers' built-in, one implementation and one model per process.

Models are the official text configs (examples/configs, vocab 248,320, every layer), built in bf16 on the device
with random weights (seed 0). A row is BATCH:SETUP:
  BATCH  rl (bench_train_step's RL batch: 16 documents, 26,354 tokens, packed in one row) or doc_N (one document of
         N tokens);
  SETUP  lora (PEFT LoRA r=16 on GDN + attention + the experts, base frozen) | lora_no_experts (GDN + attention) |
         full (every parameter trains), each with decoder-layer checkpointing; a `_no_ckpt` suffix turns it off,
         and for ours `_ckpt_mlp` / `_ckpt_mixer` recompute only that segment of each layer (the config's
         checkpoint_granularity, recorded in the row's setup; "layer" without either);
         for ours and the MoE, `lora_low_rank` / `lora_peft_fold` force moe_lora_kernel (the expert adapters as
         low-rank products on the expert rows / PEFT's rebuilt expert weights); `lora` is moe_lora_kernel="auto".
         Before `_no_ckpt`, `_offload` runs each step inside TRL's activation offloading (what
         `SFTConfig(activation_offloading=True)` wraps a training step in: saved tensors go to pinned CPU memory on a
         side stream, which under layer checkpointing are the layers' inputs) and `_save_on_cpu` inside PyTorch's
         `torch.autograd.graph.save_on_cpu(pin_memory=True)` (the same tensors, copied on the compute stream).
         LoRA adapters are PEFT's default, fp32 beside the bf16 base (`autocast_adapter_dtype=True`); `_bf16_adapters`
         keeps them in bf16 (`autocast_adapter_dtype=False`, what TRL passes under ZeRO-3); `_autocast` runs each step
         under `torch.autocast(bfloat16)`, as Accelerate's bf16 mixed precision (TRL's `bf16=True`) runs the forward.
         Ours takes a plain adapter's sum in place (modeling/adapter_products.py); a last `_peft_sums` runs PEFT's
         own LoRA forward instead (`peft_adapter_sums()`), to measure what that saves. For ours and the MoE,
         `_moe_chunk` (after every other suffix but `_gdn_chunk` and `_adamw`) runs each MoE block in checkpointed
         chunks of 16,384 tokens (the config's moe_token_chunk). For ours, `_gdn_chunk` runs each GDN layer's delta
         rule over a longer document in pieces of 16,384 tokens (gdn_token_chunk); `_layer_chunk` (after it) every decoder
         layer in checkpointed pieces of 16,384 tokens (layer_token_chunk; `_layer_chunk_8k` / `_4k`: 8,192 / 4,096). `_adamw` (last) ends each step with an optimizer step, as
         transformers' Trainer runs its default (`adamw_torch_fused`: torch's AdamW, fused on CUDA): its two states
         per trained parameter, in the parameter's dtype, count in the row's peak (`optimizer_state_bytes`).
A forward + backward per step (without `_adamw` no optimizer: its state is the same for both implementations; a card
that fits a row's peak must also hold it, see lora_memory_budget.py), ours with its defaults (a training forward
with labels keeps no logits) and cu_seqlens, the built-in on its correct packed path (cu_seq_lens + seq_idx, FLA +
causal_conv1d installed). Rows run in the order given; switching LoRA targets unloads the adapters and wraps the
base model again. A row that runs out of memory records the peak at failure and the next row goes on; if memory of a
failed row stays allocated, the later rows are recorded as not run (their peaks would include it), so rows expected
to fail go last. --profile ROW[,ROW..] adds the kernel time of one step of each by kernel class (GDN, attention, GEMM,
loss, ...), the top kernels by name (the largest split by the host operators that launched them), the GPU's idle time
between kernels by the host operator before it, and the forward's and the backward's (recompute included) share of an
unprofiled step. --memory-at-peak ROW[,ROW..] adds what is live at the peak of one step of each, by allocating line
(memory_peak.py); for a row that ran out of memory, what was live when it failed and the request that failed, which
says where a budget is exceeded and by how much.

    python benchmarks/bench_workload.py --model qwen35_35b_a3b --impl ours --rows rl:lora_low_rank,doc_131072:lora
                                        [--profile ROW[,ROW..]] [--memory-at-peak ROW[,ROW..]] [--reps 2] [--warmup 1] [--config FIELD=VALUE,..]
                                        [--out FILE] [--device cuda] [--tiny]

--tiny (with --device cpu) runs the rows on a small config and short documents to check the script itself.
Writes results/benchmarks/<date>-workload-<model>-<impl>.json (or --out) after every row.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import re
import time
import traceback
from pathlib import Path

import torch
import transformers
from bench_moe import layer_shapes
from bench_train_step import CONFIGS, TINY, batches, default_dtype, peak_gib, sync
from memory_peak import record_step_memory
from trace_train_step import idle_gaps, kernel_time_by_launching_ops, kernel_time_by_name, trace_events

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.integrations.lora import lora_config
from qwen35_packed.modeling import kernel_selection
from qwen35_packed.modeling.adapter_products import peft_adapter_sums

ROOT = Path(__file__).resolve().parent
MODELS = {"qwen35_35b_a3b": "Qwen3.5-35B-A3B.config.json", "qwen35_4b": "Qwen3.5-4B.config.json"}
LORA_GROUPS = {"lora": ("gdn", "attention", "experts"), "lora_no_experts": ("gdn", "attention")}
# Setup suffixes (field, value), stripped from the end of a setup's name in this order.
SUFFIXES = (
    ("_adamw", "optimizer", "adamw"),
    ("_layer_chunk", "layer_token_chunk", 16384),
    ("_layer_chunk_8k", "layer_token_chunk", 8192),
    ("_layer_chunk_4k", "layer_token_chunk", 4096),
    ("_gdn_chunk", "gdn_token_chunk", 16384),
    ("_moe_chunk", "moe_token_chunk", 16384),
    ("_peft_sums", "peft_adapter_sums", True),
    ("_no_ckpt", "checkpointing", False),
    ("_ckpt_mlp", "checkpoint_granularity", "mlp"),
    ("_ckpt_mixer", "checkpoint_granularity", "mixer"),
    ("_autocast", "autocast", True),
    ("_bf16_adapters", "bf16_adapters", True),
    ("_offload", "offloading", "trl"),
    ("_save_on_cpu", "offloading", "save_on_cpu"),
)
# Kernel classes of a profiled step, first matching pattern wins (names as the profiler reports them).
KERNEL_CLASSES = (
    ("gdn", r"chunk_|gated_delta|fused_recurrent|kda|tilelang|flash_qla|qla|solve_tril|wy_fast|l2norm"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("conv", r"conv"),
    ("loss", r"cross_entropy|loss|logsumexp|triton_.*red|log_softmax"),
    # torch._grouped_mm's CUTLASS kernel, by its full name: the experts and, with one group, every row-invariant
    # projection's forward (projection.py)
    ("grouped_gemm", r"grouped|groupproblemshape"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|ampere_|cublas|matmul"),
    ("elementwise_ours", r"^_?(rmsnorm|swiglu|gated_norm|gate|topk|gather_sum|elementwise)"),
)


@dataclasses.dataclass(frozen=True)
class Setup:
    lora_groups: tuple[str, ...] | None  # None: a full fine-tune
    checkpointing: bool = True
    checkpoint_granularity: str = "layer"  # ours only: what the backward of a checkpointed layer reruns
    moe_lora_kernel: str | None = None  # ours only; None keeps the config's ("auto")
    offloading: str | None = None  # "trl" | "save_on_cpu": where the step's saved tensors wait for the backward
    bf16_adapters: bool = False  # LoRA adapters kept in the base's bf16 instead of PEFT's fp32
    autocast: bool = False  # the step under torch.autocast(bfloat16)
    peft_adapter_sums: bool = False  # ours only: PEFT's own LoRA forward instead of the in-place sum
    moe_token_chunk: int | None = None  # ours only, MoE: tokens per checkpointed chunk of each MoE block
    gdn_token_chunk: int | None = None  # ours only: tokens per piece of a long document's delta rule
    layer_token_chunk: int | None = None  # ours only: tokens per checkpointed piece of every decoder layer
    optimizer: str | None = None  # "adamw": each step ends with the Trainer's default optimizer step


def parse_setup(name: str) -> Setup:
    base, fields = name, {}
    for suffix, field, value in SUFFIXES:
        if base.endswith(suffix):
            base, fields[field] = base[: -len(suffix)], value
    if not fields.get("checkpointing", True) and "checkpoint_granularity" in fields:
        raise SystemExit(
            f"{name!r}: _ckpt_mlp / _ckpt_mixer choose what checkpointing recomputes; _no_ckpt turns it off"
        )
    kernel = {"lora_low_rank": "low_rank", "lora_peft_fold": "peft"}.get(base)
    groups_key = "lora" if kernel else base
    if groups_key == "full":
        if fields.get("bf16_adapters"):
            raise SystemExit("_bf16_adapters is a LoRA setup's suffix")
        return Setup(None, **fields)
    if groups_key not in LORA_GROUPS:
        raise SystemExit(
            f"unknown setup {name!r}: lora, lora_low_rank, lora_peft_fold, lora_no_experts, full "
            "[_offload | _save_on_cpu] [_bf16_adapters] [_autocast] [_ckpt_mlp | _ckpt_mixer | _no_ckpt] [_peft_sums] "
            "[_moe_chunk] [_gdn_chunk] [_layer_chunk | _layer_chunk_8k | _layer_chunk_4k] [_adamw]"
        )
    return Setup(LORA_GROUPS[groups_key], moe_lora_kernel=kernel, **fields)


def config_fields(spec: str) -> dict:
    """'moe_token_chunk=8192,long_document_attention=sdpa' -> {field: value}: a value that reads as JSON (a number,
    null, true) is that value, any other is the string."""
    fields = {}
    for item in filter(None, spec.split(",")):
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--config: {item!r} is not FIELD=VALUE")
        try:
            fields[name] = json.loads(text)
        except json.JSONDecodeError:
            fields[name] = text
    return fields


def batch_lengths(name: str, tiny: bool) -> list[int]:
    if name == "rl":
        lengths = batches()["rl_longtail_x16"]
    elif re.fullmatch(r"doc_\d+", name):
        lengths = [int(name[4:])]
    else:
        raise SystemExit(f"unknown batch {name!r}: rl or doc_N")
    return [max(1, n // 64) for n in lengths] if tiny else lengths


def text_config(model: str, tiny: bool) -> dict:
    if tiny:
        return layer_shapes(4, 512, tiny=True) if model == "qwen35_35b_a3b" else dict(TINY)
    composite = json.loads((CONFIGS / MODELS[model]).read_text())
    kwargs = {k: v for k, v in composite["text_config"].items() if k not in ("model_type", "dtype", "torch_dtype")}
    kwargs.setdefault("tie_word_embeddings", composite.get("tie_word_embeddings", False))
    return kwargs


def classes(model: str, impl: str):
    moe = model == "qwen35_35b_a3b"
    if impl == "ours":
        return (
            (Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig)
            if moe
            else (Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig)
        )
    if moe:
        return transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((cls for cls, pattern in KERNEL_CLASSES if re.search(pattern, lowered)), "other")


def kernel_ms_by_class(by_name: dict[str, float]) -> collections.Counter:
    """Kernel milliseconds by name summed per kernel class (KERNEL_CLASSES)."""
    by_class = collections.Counter()
    for name, ms in by_name.items():
        by_class[kernel_class(name)] += ms
    return by_class


def profile_step(step, workload: "Workload") -> dict:
    """Kernel milliseconds of one forward + backward by class and by name (top 25; the top 8 also by the host
    operators around their launches: which calls an elementwise kernel's time comes from), the kernels' span, the
    GPU's idle time between kernels by the outermost host operator before the next kernel, the step's wall time
    (trace_train_step.py's reading of the profiler's trace), and an unprofiled step timed in its two halves. Each
    step starts without gradients, as a trainer's step after its optimizer's does."""
    device, step_context = workload.device, workload.step_context
    if device.type != "cuda":
        return {"skipped": "kernel times are read from a CUDA trace"}
    from torch.profiler import ProfilerActivity, profile

    try:
        with step_context():
            sync(device)
            start = time.perf_counter()
            loss = step()
            sync(device)
            forward = time.perf_counter() - start
            loss.backward()
            sync(device)
            backward = time.perf_counter() - start - forward
        del loss
        workload.release()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, step_context():
            start = time.perf_counter()
            step().backward()
            sync(device)
            wall = time.perf_counter() - start
    except torch.OutOfMemoryError:
        return {"error": "out of memory", "peak_GiB": peak_gib(device)}
    events = trace_events(prof)
    by_name = kernel_time_by_name(events, top=None)
    by_class = kernel_ms_by_class(kernel_time_by_name(events, top=None, width=None))
    gaps = idle_gaps(events)
    return {
        "forward_ms_unprofiled": round(forward * 1e3, 1),
        "backward_ms_unprofiled": round(backward * 1e3, 1),
        "wall_ms_profiled": round(wall * 1e3, 1),
        "kernel_ms": gaps["kernel_ms"],
        "span_ms": gaps["span_ms"],
        "idle_in_gaps_ms": round(gaps["idle_in_gaps_ms"], 1),
        "idle_by_outermost_op_ms": {k: round(v, 1) for k, v in list(gaps["idle_by_outermost_op_ms"].items())[:10]},
        "by_class_ms": {k: round(v, 1) for k, v in by_class.most_common()},
        "top_kernels_ms": dict(list(by_name.items())[:25]),
        "top_kernels_by_launching_ops_ms": kernel_time_by_launching_ops(events, list(by_name)[:8]),
    }


class Workload:
    """One model of one implementation on the device, with the training setup of the current row applied."""

    def __init__(self, model: str, impl: str, device: torch.device, tiny: bool):
        self.tiny = tiny
        self.impl, self.device = impl, device
        self.kwargs = text_config(model, tiny)
        model_cls, config_cls = classes(model, impl)
        self.reference_config = (Qwen3_5MoePackedConfig if model == "qwen35_35b_a3b" else Qwen3_5PackedConfig)(
            **self.kwargs
        )
        torch.manual_seed(0)
        start = time.perf_counter()
        with default_dtype(torch.bfloat16), torch.device(device):
            self.base = model_cls(config_cls(**self.kwargs)).train()
        self.build_seconds = round(time.perf_counter() - start, 1)
        if impl == "builtin" and model == "qwen35_35b_a3b":
            self.base.set_experts_implementation("grouped_mm")  # its default, as bench_moe.py's baseline runs it
        self.model, self.groups = self.base, "none"
        self.offloading_kind, self.trl_offloading, self.autocast, self.peft_sums = None, None, False, False
        self.optimizer_kind = None

    def step_context(self):
        """The context a step runs in: none, TRL's activation offloading or PyTorch's save_on_cpu, each under
        autocast and with PEFT's own LoRA sums where the setup asks for them."""
        stack = contextlib.ExitStack()
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.peft_sums:
            stack.enter_context(peft_adapter_sums())
        stack.enter_context(self._offloading())
        return stack

    def _offloading(self):
        if self.offloading_kind == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        if self.offloading_kind == "trl":
            if self.trl_offloading is None:  # built once per model: it hooks the output head
                from accelerate import PartialState
                from trl.models.activation_offloading import get_act_offloading_ctx_manager

                PartialState()  # as a trainer's Accelerator does: the offloading's warnings log through accelerate

                self.trl_offloading = get_act_offloading_ctx_manager(self.model)
            return self.trl_offloading
        return contextlib.nullcontext()

    def apply(self, setup: Setup):
        if setup.moe_lora_kernel and self.impl != "ours":
            raise SystemExit("lora_low_rank / lora_peft_fold are ours-only setups")
        if setup.checkpoint_granularity != "layer" and self.impl != "ours":
            raise SystemExit("_ckpt_mlp / _ckpt_mixer are ours-only setups")
        if setup.peft_adapter_sums and (self.impl != "ours" or not setup.lora_groups):
            raise SystemExit("_peft_sums is a setup of ours with LoRA")
        if setup.moe_token_chunk and (self.impl != "ours" or not self.base.config.is_moe):
            raise SystemExit("_moe_chunk is a setup of ours on the MoE model")
        if setup.gdn_token_chunk and self.impl != "ours":
            raise SystemExit("_gdn_chunk is a setup of ours")
        if setup.layer_token_chunk and self.impl != "ours":
            raise SystemExit("_layer_chunk is a setup of ours")
        groups = (setup.lora_groups, setup.bf16_adapters) if setup.lora_groups else "full"
        if groups != self.groups:
            if self.model is not self.base:
                self.base = self.model.unload()  # the adapters removed, the base modules back in place
            if setup.lora_groups is None:
                self.model = self.base
                self.base.requires_grad_(True)
            else:
                from peft import get_peft_model

                self.base.requires_grad_(False)
                config = lora_config(self.reference_config, r=16, lora_dropout=0.0, targets=setup.lora_groups)
                self.model = get_peft_model(self.base, config, autocast_adapter_dtype=not setup.bf16_adapters)
            self.groups = groups
            self.trl_offloading = None
            gc.collect()
        if setup.offloading == "trl" and self.device.type != "cuda":
            raise SystemExit("_offload runs TRL's activation offloading, which needs an accelerator")
        self.offloading_kind, self.autocast, self.peft_sums = setup.offloading, setup.autocast, setup.peft_adapter_sums
        self.optimizer_kind = setup.optimizer
        if setup.checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_disable()
        if self.impl == "ours":
            self.base.config.moe_lora_kernel = setup.moe_lora_kernel or "auto"
            self.base.config.checkpoint_granularity = setup.checkpoint_granularity
            # --tiny's documents are 64x shorter: so are its chunks
            for field in ("gdn_token_chunk", "layer_token_chunk"):
                piece = getattr(setup, field)
                setattr(self.base.config, field, piece // 64 if piece and self.tiny else piece)
            if self.base.config.is_moe:
                chunk = setup.moe_token_chunk
                self.base.config.moe_token_chunk = chunk // 64 if chunk and self.tiny else chunk
        self.model.train()

    def step_fn(self, lengths: list[int]):
        g = torch.Generator().manual_seed(2)
        flat = torch.cat([torch.randint(0, self.kwargs["vocab_size"], (n,), generator=g) for n in lengths])[None]
        flat = flat.to(self.device)
        cu = torch.tensor([0, *lengths], device=self.device).cumsum(0).to(torch.int32)
        if self.impl == "ours":
            return lambda: self.model(input_ids=flat, cu_seqlens=cu, labels=flat, use_cache=False).loss
        packing = dict(
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(self.device),
            seq_idx=torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(
                self.device
            ),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        )
        return lambda: self.model(input_ids=flat, labels=flat, use_cache=False, **packing).loss

    def optimizer(self) -> torch.optim.Optimizer | None:
        """The row's optimizer over the trained parameters, or None: transformers' default `adamw_torch_fused` (its
        learning rate is immaterial here); its state is allocated at its first step."""
        if self.optimizer_kind is None:
            return None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=1e-5, fused=self.device.type == "cuda")

    def release(self):
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds in its state (AdamW: two per parameter and a step count)."""
    return sum(
        t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )


def measure(workload: Workload, step, n_tokens: int, warmup: int, reps: int) -> dict:
    """Seconds per training step (forward, backward, and the row's optimizer step if it has one) after `warmup`
    steps (the first step of new shapes autotunes), the peak."""
    optimizer = workload.optimizer()

    def train_step():
        with workload.step_context():
            loss = step()
            loss.backward()
        if optimizer is not None:
            optimizer.step()
        workload.model.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(warmup):
            train_step()
        sync(workload.device)
        start = time.perf_counter()
        for _ in range(reps):
            loss = train_step()
        sync(workload.device)
        seconds = (time.perf_counter() - start) / reps
        row = {
            "s_per_step": round(seconds, 3),
            "real_tok_per_s": round(n_tokens / seconds),
            "peak_GiB": peak_gib(workload.device),
            "loss": loss.item(),
            "warmup_steps": warmup,
            "timed_steps": reps,
        }
        if optimizer is not None:
            row["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
        return row
    except torch.OutOfMemoryError:
        return {"error": "out of memory", "peak_GiB": peak_gib(workload.device)}
    except Exception as exc:  # e.g. the built-in refusing packed input without its kernels: a result too
        # where it was raised: the innermost frames (a kernel's own out-of-memory error names no allocating line)
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)[-4:]]
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "raised_at": where, "peak_GiB": peak_gib(workload.device)}  # fmt: skip
    finally:
        optimizer = None  # its state goes before the next row measures what stayed allocated
        workload.release()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--impl", required=True, choices=("ours", "builtin"))
    parser.add_argument("--rows", required=True, help="comma-separated BATCH:SETUP (see the module docstring)")
    parser.add_argument("--profile", default="", help="comma-separated rows of --rows: also profile one step of each")
    parser.add_argument(
        "--memory-at-peak",
        default="",
        help="comma-separated rows of --rows: also what is live at each one's memory peak, or at its failure (CUDA)",
    )
    parser.add_argument("--reps", type=int, default=2, help="timed steps per row (one for documents of >= 128k)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed steps first (0: the timed step includes autotuning)"
    )
    parser.add_argument(
        "--config",
        default="",
        help="ours only: comma-separated FIELD=VALUE set on the config, e.g. long_document_attention=sdpa",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = [tuple(spec.split(":")) for spec in args.rows.split(",")]
    memory_rows = set(filter(None, args.memory_at_peak.split(",")))
    profile_rows = set(filter(None, args.profile.split(",")))
    for option, chosen in (("--memory-at-peak", memory_rows), ("--profile", profile_rows)):
        unknown = chosen - {f"{batch}:{setup}" for batch, setup in rows}
        if unknown:
            raise SystemExit(f"{option}: not among --rows: {sorted(unknown)}")
    if any(parse_setup(row.split(":")[1]).optimizer for row in memory_rows):
        raise SystemExit("--memory-at-peak records a forward + backward: an _adamw row's optimizer step is not in it")
    plans = [(batch, setup, batch_lengths(batch, args.tiny), parse_setup(setup)) for batch, setup in rows]
    workload = Workload(args.model, args.impl, device, args.tiny)
    fields = config_fields(args.config)
    if fields and args.impl != "ours":
        raise SystemExit("--config sets fields of ours only")
    for name, value in fields.items():
        if not hasattr(workload.base.config, name):
            raise SystemExit(f"--config: the config has no field {name!r}")
        if name == "checkpoint_granularity":  # each row sets it (Workload.apply), which would override this
            raise SystemExit(
                "--config: checkpoint_granularity is chosen per row, by the _ckpt_mlp / _ckpt_mixer setups"
            )
        setattr(workload.base.config, name, value)
    choice = (
        kernel_selection.select_kernels(workload.reference_config, device, torch.bfloat16)
        if args.impl == "ours"
        else None
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "model": f"{args.model} (official text config, every layer, vocab {workload.kwargs['vocab_size']})"
        if not args.tiny
        else f"{args.model} tiny",
        "impl": args.impl,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla_available": kernel_selection.FLA_AVAILABLE,
        "ours_kernels": dataclasses.asdict(choice) if choice else None,
        "build_seconds": workload.build_seconds,
        "config_fields_set": fields,
        "rows": {},
    }
    out = Path(
        args.out or ROOT.parent / "results" / "benchmarks" / f"{result['date']}-workload-{args.model}-{args.impl}.json"
    )
    leaked = None
    for batch, setup_name, lengths, setup in plans:
        row_name = f"{batch}:{setup_name}"
        if leaked:  # every later peak would include it: those rows are not measurements of themselves
            result["rows"][row_name] = {"error": f"not run: {leaked}", "peak_GiB": None, "tokens": sum(lengths)}
            continue
        workload.apply(setup)
        step = workload.step_fn(lengths)
        long = max(lengths) >= 131072 and not args.tiny
        workload.release()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        row = measure(workload, step, sum(lengths), args.warmup, reps=1 if long else args.reps)
        row.update(tokens=sum(lengths), documents=len(lengths), setup=dataclasses.asdict(setup))
        if row_name in profile_rows and "error" not in row:
            row["profile"] = profile_step(step, workload)
            workload.release()
        # Triton's kernels report running out of memory as a RuntimeError of their own
        if row_name in memory_rows and "out of memory" in row.get("error", "out of memory"):
            row["memory_at_peak"] = (
                record_step_memory(step, workload.step_context)
                if device.type == "cuda"
                else {"skipped": "the allocator history is CUDA's"}
            )
            workload.release()
        kept = (torch.cuda.memory_allocated() - before) / 2**30 if device.type == "cuda" else 0.0
        if kept > 1.0:
            row["memory_not_released_GiB"] = round(kept, 2)
            leaked = f"{kept:.1f} GiB of row {row_name} ({row.get('error', 'measured')}) stayed allocated"
        result["rows"][row_name] = row
        print(row_name, json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=1))
    print(f"\n{'row':<34}{'tokens':>8}{'tok/s':>9}{'s/step':>8}{'peak GiB':>10}")
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"{name:<34}{row['tokens']:>8}  {row['error']} (peak {row['peak_GiB']} GiB)")
        else:
            print(
                f"{name:<34}{row['tokens']:>8}{row['real_tok_per_s']:>9}{row['s_per_step']:>8}{row['peak_GiB']!s:>10}"
            )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
