"""Worker for tests/integrations/test_context_parallel_guard.py, run under torchrun on CPU (gloo, 2 processes = one
context-parallel group of 2): what Accelerate's `ParallelismConfig(cp_size=2)` and the transformers Trainer do, with
their own code, and what the packed model does there. Each case is written to the JSON report as "ran" (the
forward returned: silently, on a shard) or the error's type and message.

`Accelerator(parallelism_config=ParallelismConfig(cp_size=2))` cannot be constructed on CPU (Accelerate sets up
context parallelism only for FSDP2 on GPU-like devices; for MULTI_CPU it raises "ParallelismConfig is only
compatible DistributedType.FSDP (version 2) or ..."), and neither can a Trainer over it. So the Accelerator and
the Trainer are stand-ins holding exactly what their constructors would hold for cp_size=2 (the ParallelismConfig,
the device mesh Accelerate builds from it), and Accelerate's and the Trainer's own methods run on them unchanged:
`Accelerator._prepare_cp` (what `prepare` runs for cp_size > 1), `Trainer._prepare_context_parallel_inputs` (the
buffers the Trainer shards each step) and `Accelerator.maybe_context_parallel` (which enters torch's
`context_parallel` on the "cp" mesh). The steps after `prepare` run as for a model `prepare` never saw (prepared
apart, or torch's `context_parallel` used directly): only the forward's own check stands between them and a shard.
Every rank writes OUT.<rank>."""

import argparse
import functools
import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import packed_model  # noqa: E402


def outcome(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the report names whatever was raised
        return f"{type(error).__name__}: {error}"
    return "ran"


def batch(vocab: int, length: int = 16) -> dict:
    """One packed row of two documents, as a collator gives it (position_ids restart per document)."""
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(6), torch.arange(length - 6)])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": position_ids}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = ParallelismConfig(cp_size=2)
    accelerator = types.SimpleNamespace(
        parallelism_config=config, torch_device_mesh=config.get_device_mesh("cpu"), _cp_context=None
    )
    accelerator.maybe_context_parallel = functools.partial(Accelerator.maybe_context_parallel, accelerator)
    trainer = types.SimpleNamespace(accelerator=accelerator)

    model = packed_model("dense").train()
    vocab = model.config.vocab_size
    report = {"world_size": dist.get_world_size(), "supports_context_parallel": model.supports_context_parallel}

    # Accelerator.prepare(model, ...) with cp_size=2.
    report["prepare"] = outcome(lambda: Accelerator._prepare_cp(accelerator, model))
    # The same context for a model prepare never saw: _prepare_cp on nothing sets the context Accelerate enters.
    Accelerator._prepare_cp(accelerator)

    def trainer_step(inputs):
        # Trainer.training_step: `cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)`, then
        # the loss is computed `with cp_context():`.
        cp_context, inputs = Trainer._prepare_context_parallel_inputs(trainer, model, inputs)
        with cp_context():
            report.setdefault("shard_columns", inputs["input_ids"].shape[1])
            model(**inputs).loss.backward()

    report["trainer_step"] = outcome(lambda: trainer_step(batch(vocab)))

    def accelerate_loop(with_position_ids: bool):
        # A hand-written Accelerate loop: `with accelerator.maybe_context_parallel(buffers=..., ...)`.
        inputs = batch(vocab)
        if not with_position_ids:
            del inputs["position_ids"]
        buffers = list(inputs.values())
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ):
            model(**inputs).loss.backward()

    report["accelerate_loop"] = outcome(lambda: accelerate_loop(True))
    report["accelerate_loop_ids_only"] = outcome(lambda: accelerate_loop(False))

    # torch's module-wrapper API (torchtitan's way): the DTensor dispatcher routes SDPA to ring attention.
    from torch.distributed.tensor.experimental import _attention as torch_cp

    torch_cp._enable_context_parallel_dispatcher()
    try:
        report["module_wrapper"] = outcome(lambda: model(**batch(vocab)))
    finally:
        torch_cp._disable_context_parallel_dispatcher()

    # Context parallelism off again: the same model trains (no false alarm after the blocks exited).
    report["after"] = outcome(lambda: model(**batch(vocab)).loss.backward())

    Path(f"{args.out}.{rank}").write_text(json.dumps(report, indent=1))
    # every rank leaves together: gloo can abort a rank that tears down while its peer is still working
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
