"""Worker for tests/modeling/test_context_parallel.py, run under torchrun on CPU (gloo, fp32): every case runs one
packed row through the model unsharded (on every rank) and with context parallelism over all ranks, each rank
holding its shard (cut at the case's points), and records the largest differences: the shard's logits against the
row's, the sum of the ranks' losses against the row's loss, the sum of the ranks' parameter gradients against the
row's. Then every planted fault replaces one mechanism of context_parallel.py by what a shard would do without it
and runs a few cases again. Rank 0 writes the report (JSON: "exact" or the fault -> case name -> differences)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import packed_model  # noqa: E402
from fixtures_distributed import start_gloo_worker  # noqa: E402
from vl_tiny import IMAGE, PATCH_DIM, grid_tensor, image_tokens, packed_vl_model  # noqa: E402

from qwen35_packed.modeling import context_parallel  # noqa: E402

IGNORE = -100
# name -> (model kind, document lengths of the row, cut points of the shards (world + 1 entries), labels form,
# boundaries form). The tiny configs' conv kernel is 4: a halo of 3 tokens.
CASES = {
    2: {
        # a boundary inside a document, documents before and after it
        "straddle_dense": ("dense", [13, 19, 8], [0, 20, 40], "labels", "cu_seqlens"),
        "straddle_moe": ("moe", [13, 19, 8], [0, 20, 40], "labels", "cu_seqlens"),
        # the document starts 2 tokens before the boundary: the next shard's conv reads 2 tokens of it, not 3
        "boundary_inside_halo": ("dense", [18, 22], [0, 20, 40], "shift_labels", "position_ids"),
        # one-token documents as the last token of shard 0 and the first of shard 1
        "one_token_documents_at_boundary": ("dense", [11, 1, 1, 9], [0, 12, 22], "labels", "position_ids"),
        # the row's 70-token document crosses the delta rule's 64-token chunk on either side of the boundary
        "long_document_moe": ("moe", [3, 70, 7], [0, 41, 80], "shift_labels", "cu_seqlens"),
        # cut by shard_packed_row (even shards) from position_ids
        "shard_packed_row": ("dense", [7, 15, 10], None, "labels", "shard_packed_row"),
        # vision-language: the boundary cuts an image's placeholder tokens (VL_DOCUMENTS)
        "image_document_vl": ("vl", None, [0, 10, 31], "labels", "cu_seqlens"),
    },
    4: {
        # every boundary inside a document
        "straddle_every_boundary": ("dense", [6, 11, 12, 13], [0, 10, 20, 32, 42], "labels", "cu_seqlens"),
        # one document over three ranks (its middle rank holds nothing else)
        "document_over_three_ranks_moe": ("moe", [4, 30, 6], [0, 10, 20, 30, 40], "labels", "position_ids"),
        # shards of 1 and 2 tokens inside one document: the halo of shard 3 comes from shards 0, 1 and 2
        "short_shards_in_a_document": ("dense", [2, 28], [0, 10, 11, 13, 30], "shift_labels", "cu_seqlens"),
        # a one-token shard that is a whole document, between two straddled documents
        "one_token_shard_document": ("dense", [12, 1, 17], [0, 12, 13, 20, 30], "labels", "cu_seqlens"),
        # both images of the row cut by boundaries; shard 1 holds image tokens only
        "image_documents_vl": ("vl", None, [0, 10, 12, 22, 31], "shift_labels", "position_ids"),
    },
}
# planted fault -> the cases it runs on, per world size
TEXT_FAULT_CASES = {
    2: ["straddle_dense", "boundary_inside_halo", "long_document_moe"],
    4: ["straddle_every_boundary", "short_shards_in_a_document"],
}
FAULT_CASES = {
    world: {
        "no_halo": cases,
        "no_state_passing": cases,
        "targets_not_crossing": cases,
        "attention_local": cases,
        "image_features_from_the_first": [name for name, spec in CASES[world].items() if spec[0] == "vl"],
    }
    for world, cases in TEXT_FAULT_CASES.items()
}


def planted(fault: str) -> dict:
    """The replacements of context_parallel.py's functions that plant `fault`."""

    def conv_history(mixed, packed, layout, kernel):  # the conv of a shard starts from zeros
        return mixed.new_zeros(packed.num_docs, mixed.shape[1], kernel - 1)

    def incoming_state(q, k, v, g, beta, packed, delta_rule, layout):  # the recurrence of a shard starts from zero
        return v.new_zeros(packed.num_docs, v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32)

    def shard_targets(targets, layout):  # the shard's last token predicts nothing
        return targets

    def attention_across_shards(q, k, v, packed, scale, *, attention, layout):  # a shard's queries see its keys only
        return attention(q, k, v, packed, scale)

    def shard_slots(slots, features, layout, tokens):  # the shard's placeholders take the row's first features
        inside = (slots >= layout.offset) & (slots < layout.offset + tokens)
        return slots[inside] - layout.offset, features[: int(inside.sum())]

    return {
        "image_features_from_the_first": {"shard_slots": shard_slots},
        "no_halo": {"conv_history": conv_history},
        "no_state_passing": {"incoming_state": incoming_state},
        "targets_not_crossing": {"shard_targets": shard_targets},
        "attention_local": {"attention_across_shards": attention_across_shards},
    }[fault]


# The vision-language row: a text document, a document with a 4x4 image, one with a 4x8 image (31 tokens).
VL_GRIDS = [[1, 4, 4], [1, 4, 8]]


def vl_row(seed: int) -> tuple[list[int], torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)

    def words(n):
        return torch.randint(0, 100, (n,), generator=g).tolist()

    docs = [words(5), words(3) + image_tokens(VL_GRIDS[0]) + words(4), image_tokens(VL_GRIDS[1]) + words(3)]
    vision = {
        "pixel_values": torch.randn(sum(t * h * w for t, h, w in VL_GRIDS), PATCH_DIM, generator=g),
        "image_grid_thw": grid_tensor(VL_GRIDS),
    }
    return [len(d) for d in docs], torch.tensor([t for d in docs for t in d])[None], vision


def row(kind_docs: list[int] | None, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    vision = {}
    if kind_docs is None:
        kind_docs, ids, vision = vl_row(seed)
    else:
        ids = torch.randint(0, vocab, (1, sum(kind_docs)), generator=g)
    total = sum(kind_docs)
    labels = ids.clone()
    labels[ids == IMAGE] = IGNORE
    labels[0, torch.randperm(total, generator=g)[: total // 6]] = IGNORE  # some positions without a target
    positions = torch.cat([torch.arange(n) for n in kind_docs])[None]
    cu = torch.tensor([0, *torch.tensor(kind_docs).cumsum(0).tolist()], dtype=torch.int32)
    shift = torch.full_like(labels, IGNORE)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        shift[0, start : end - 1] = labels[0, start + 1 : end]
    return {
        "input_ids": ids,
        "labels": labels,
        "shift_labels": shift,
        "position_ids": positions,
        "cu_seqlens": cu,
        "vision": vision,  # the whole row's images, given to every rank
    }


def run_case(name, spec, models, rank, world) -> dict:
    kind, docs, cuts, labels_form, boundaries = spec
    model = models[kind]
    data = row(docs, model.config.get_text_config().vocab_size, seed=len(name))
    model.set_context_parallel(None)
    model.zero_grad()
    full = model(input_ids=data["input_ids"], cu_seqlens=data["cu_seqlens"], labels=data["labels"], **data["vision"])
    full.loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}

    if boundaries == "shard_packed_row":
        given = {"input_ids": data["input_ids"], "position_ids": data["position_ids"], labels_form: data[labels_form]}
        shard = context_parallel.shard_packed_row(given, rank, world)
        sizes = [None] * world
        dist.all_gather_object(sizes, shard["input_ids"].shape[1])
        cuts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    else:
        piece = slice(cuts[rank], cuts[rank + 1])
        shard = {"input_ids": data["input_ids"][:, piece], labels_form: data[labels_form][:, piece]}
        if boundaries == "cu_seqlens":
            shard["cu_seqlens"] = data["cu_seqlens"]
        else:
            shard["position_ids"] = data["position_ids"][:, piece]
    model.zero_grad()
    model.set_context_parallel(dist.group.WORLD)
    out = model(**shard, **data["vision"])
    out.loss.backward()
    model.set_context_parallel(None)

    logits_error = (out.logits[0] - full.logits[0, cuts[rank] : cuts[rank + 1]]).abs().max().reshape(1)
    dist.all_reduce(logits_error, op=dist.ReduceOp.MAX)
    loss = out.loss.detach().reshape(1)
    dist.all_reduce(loss)
    grad_error = 0.0
    for n, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        grad_error = max(grad_error, float((grad - reference[n]).abs().max()))
    return {
        "logits": float(logits_error),
        "loss": abs(float(loss) - float(full.loss.detach())),
        "grads": grad_error,
        "logits_scale": float(full.logits.abs().max()),
        "grad_scale": max(float(g.abs().max()) for g in reference.values()),
    }


def run_fsdp2_case(rank, world) -> dict:
    """Context parallelism composed with FSDP2 on the same ranks (fp32, the decoder layers and the root sharded
    over all ranks, context parallelism over a group of its own): each rank's loss times the group size, as the
    Trainer scales it, and FSDP2's gradient average give the unsharded row's gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference_model = packed_model("dense")
    data = row([13, 19, 8], reference_model.config.vocab_size, seed=7)
    full = reference_model(input_ids=data["input_ids"], cu_seqlens=data["cu_seqlens"], labels=data["labels"])
    full.loss.backward()
    model = packed_model("dense")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_context_parallel(dist.new_group(list(range(world))))
    total = data["input_ids"].shape[1]
    piece = slice(rank * total // world, (rank + 1) * total // world)
    out = model(input_ids=data["input_ids"][:, piece], labels=data["labels"][:, piece], cu_seqlens=data["cu_seqlens"])
    (out.loss * world).backward()
    reference = dict(reference_model.named_parameters())
    grad_error = max(float((p.grad.full_tensor() - reference[n].grad).abs().max()) for n, p in model.named_parameters())
    loss = out.loss.detach().reshape(1)
    dist.all_reduce(loss)
    return {
        "logits": float((out.logits[0] - full.logits[0, piece]).abs().max()),
        "loss": abs(float(loss) - float(full.loss.detach())),
        "grads": grad_error,
        "logits_scale": float(full.logits.abs().max()),
        "grad_scale": max(float(p.grad.abs().max()) for p in reference.values()),
    }


def main():
    args, rank, world = start_gloo_worker()
    torch.set_num_threads(1)
    models = {kind: packed_model(kind) for kind in ("dense", "moe")}
    models["vl"] = packed_vl_model("dense", seed=3)
    report = {"exact": {name: run_case(name, spec, models, rank, world) for name, spec in CASES[world].items()}}
    report["exact"]["fsdp2_on_the_same_ranks"] = run_fsdp2_case(rank, world)
    for fault, cases in FAULT_CASES[world].items():
        original = {name: getattr(context_parallel, name) for name in planted(fault)}
        for name, replacement in planted(fault).items():
            setattr(context_parallel, name, replacement)
        report[fault] = {name: run_case(name, CASES[world][name], models, rank, world) for name in cases}
        for name, function in original.items():
            setattr(context_parallel, name, function)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    # every rank leaves together: gloo can abort a rank that tears down while its peer is still working
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
