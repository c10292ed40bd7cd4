"""Upload a model or PEFT adapter folder to the Hugging Face Hub, with a generated model card.

`qwen35-packed upload FOLDER --repo-id ORG/NAME` and `hub_upload.py FOLDER --repo-id ORG/NAME` (a thin entry point at the
repository root, which calls `main`) run `run_upload`. The logic:

* `plan_upload` decides what goes: an allow-list of top-level files (weights and their index, configs, this
  package's remote-code modules, tokenizer / processor files, LICENSE, the card, the verification report). Anything
  else is left out with the reason: symlinks (even with an allowed name), hidden files, folders (caches), files that
  look like credentials, shards the index does not name, unknown files. A folder is a `packed` model (auto_map to
  this package's classes), an `official` one (transformers' architectures) or a PEFT `adapter` (adapter_config.json);
  a model may be a sequence-classification (reward / value) one, whose card loads it through
  AutoModelForSequenceClassification and has no generation, TRL GRPO, PEFT or vLLM snippets.
* The card (a huggingface_hub `ModelCard`) carries metadata (library_name, base_model, tags, license: `--license`,
  else the report's `source.license`, else recognised from the LICENSE file copied from the source checkpoint),
  usage snippets for transformers, `trl grpo`, vLLM and PEFT, and the measured numbers of
  `qwen35_packed_report.json` when the folder has one. A README.md already in the folder is uploaded instead unless
  `--replace-card`.
* `upload` is the only place that talks to the Hub: `api.create_repo(...)` then one `api.create_commit(...)` with
  an explicit list of `CommitOperationAdd`. The token comes from `HF_TOKEN` or the cached login (huggingface_hub
  resolves it); it is never printed, only where it came from.

The conversion helpers are imported where they are used: the conversion package loads torch, and `qwen35-packed
--help` builds this module's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .json_files import read_json_object
from .report_schema import REPORT_NAME, REPORT_SCHEMA, read_report_file

CARD_NAME = "README.md"

CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
OTHER_FILES = ("LICENSE", CARD_NAME, REPORT_NAME)
SINGLE_WEIGHTS = ("model.safetensors", "adapter_model.safetensors")
INDEX_NAME = "model.safetensors.index.json"
CREDENTIAL_PATTERN = re.compile(r"(^|[._-])(token|credentials?|secrets?|netrc|api[_-]?key)([._-]|$)", re.IGNORECASE)
# A Hugging Face access token inside a file that is otherwise allowed (a config or tokenizer file someone pasted it in)
TOKEN_CONTENT_PATTERN = re.compile(rb"hf_[A-Za-z0-9]{30,}")
# architecture -> (MoE, vision-language): every folder `convert` writes, and the official ones.
PACKED_ARCHITECTURES = {
    "Qwen3_5PackedForCausalLM": (False, False), "Qwen3_5MoePackedForCausalLM": (True, False),
    "Qwen3_5PackedForConditionalGeneration": (False, True), "Qwen3_5MoePackedForConditionalGeneration": (True, True),
    "Qwen3_5PackedForSequenceClassification": (False, False),
    "Qwen3_5MoePackedForSequenceClassification": (True, False),
}  # fmt: skip
OFFICIAL_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": (False, False), "Qwen3_5MoeForCausalLM": (True, False),
    "Qwen3_5ForConditionalGeneration": (False, True), "Qwen3_5MoeForConditionalGeneration": (True, True),
    "Qwen3_5TextForSequenceClassification": (False, False),
}  # fmt: skip
REWARD_AUTO_CLASS = "AutoModelForSequenceClassification"


class UploadError(Exception):
    """The folder or the options cannot be uploaded as asked; the message says why."""


@dataclass
class UploadFile:
    path_in_repo: str
    size: int
    local: Path | None = None  # None: `content` (the generated card)
    content: bytes | None = None


@dataclass
class UploadPlan:
    folder: Path
    repo_id: str
    private: bool
    kind: str  # "packed", "official" or "adapter"
    is_moe: bool
    files: list[UploadFile]
    skipped: list[tuple[str, str]]  # (name, reason)
    card_text: str
    card_source: str  # "generated" or "README.md in FOLDER"
    token_source: str
    notes: list[str] = field(default_factory=list)
    vision: bool = False  # a vision-language model (or an adapter of one)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def lines(self) -> list[str]:
        from .conversion.sizes import format_bytes

        visibility = "private" if self.private else "public"
        out = [
            f"repo {self.repo_id} (model repository, {visibility}; created if missing)",
            f"folder {self.folder}: {self.kind} {'MoE' if self.is_moe else 'dense'}"
            + (" vision-language" if self.vision else " text")
            + (" adapter" if self.kind == "adapter" else " model"),
            f"token: {self.token_source}",
            f"upload {len(self.files)} files, {format_bytes(self.total_size)}:",
        ]
        for f in self.files:
            origin = "" if f.local is not None else "  (generated model card)"
            out.append(f"  {f.path_in_repo}  {format_bytes(f.size)}{origin}")
        if self.skipped:
            out.append(f"left out ({len(self.skipped)}):")
            out.extend(f"  {name}: {reason}" for name, reason in self.skipped)
        out.extend(self.notes)
        return out


def token_source() -> str:
    """Where huggingface_hub will take the token from; never the token itself."""
    if os.environ.get("HF_TOKEN"):
        return "from the HF_TOKEN environment variable"
    try:
        from huggingface_hub import get_token

        if get_token():
            return "from the cached login (hf auth login)"
    except ImportError:
        pass
    return "none found (set HF_TOKEN or run `hf auth login` before uploading)"


def _read_json(path: Path) -> dict:
    return read_json_object(path, UploadError, path.name)


def remote_code_names() -> set[str]:
    from .conversion.remote_code import remote_code_files

    return {p.name for p in remote_code_files()}


def _adapter_of_vision_model(weights: Path) -> bool:
    """Whether a PEFT adapter's tensors sit in a vision-language model (its text decoder is `language_model`)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        return any(".language_model." in key or ".visual." in key for key in handle.keys())


def _classify(folder: Path) -> tuple[str, bool, bool, dict]:
    """(kind, is_moe, vision-language, config or adapter config)."""
    from .conversion.config import is_sequence_classifier

    if (folder / "adapter_config.json").is_file():
        adapter = _read_json(folder / "adapter_config.json")
        weights = folder / "adapter_model.safetensors"
        if not weights.is_file():
            raise UploadError("adapter_config.json without adapter_model.safetensors (only safetensors are uploaded)")
        targets = json.dumps(adapter.get("target_parameters") or [])
        return "adapter", "experts" in targets, _adapter_of_vision_model(weights), adapter
    if not (folder / "config.json").is_file():
        raise UploadError(f"{folder} has neither config.json (a model) nor adapter_config.json (a PEFT adapter)")
    config = _read_json(folder / "config.json")
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch in PACKED_ARCHITECTURES:
        auto_map = config.get("auto_map") or {}
        modules = {v.split(".")[0] + ".py" for v in auto_map.values() if isinstance(v, str)}
        missing = sorted(m for m in modules if not (folder / m).is_file())
        if not auto_map or missing:
            raise UploadError(
                f"config.json names {arch} but the remote code is incomplete (auto_map {auto_map or 'missing'}, "
                f"missing files {missing}); convert the checkpoint with `qwen35-packed convert`"
            )
        if is_sequence_classifier(config) and REWARD_AUTO_CLASS not in auto_map:
            # the card loads it through this entry; without it trust_remote_code would build the built-in head
            raise UploadError(
                f"config.json names {arch} but auto_map has no {REWARD_AUTO_CLASS} entry; convert the checkpoint "
                "with `qwen35-packed convert`"
            )
        return ("packed", *PACKED_ARCHITECTURES[arch], config)
    if arch in OFFICIAL_ARCHITECTURES:
        return ("official", *OFFICIAL_ARCHITECTURES[arch], config)
    raise UploadError(
        f"config.json has architectures {architectures}; expected one of {list(PACKED_ARCHITECTURES)} (this "
        f"project's layout) or {list(OFFICIAL_ARCHITECTURES)} (official)"
    )


def select_files(folder: Path, kind: str) -> tuple[list[Path], list[tuple[str, str]], list[str]]:
    """(files to upload, (name, reason) left out, notes) by the allow-list; README.md is decided by the caller."""
    allowed = set(CONFIG_FILES) | set(TOKENIZER_FILES) | set(PROCESSOR_FILES) | set(OTHER_FILES)
    code = remote_code_names() if kind == "packed" else set()
    indexed: set[str] | None = None
    if (folder / INDEX_NAME).is_file():
        weight_map = _read_json(folder / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UploadError(f"{INDEX_NAME} has no weight_map")
        indexed = set(weight_map.values())
        outside = sorted(str(n) for n in indexed if not isinstance(n, str) or n in ("", ".", "..") or "/" in n
                         or "\\" in n)  # fmt: skip
        if outside:
            raise UploadError(f"{INDEX_NAME} names shards outside the folder or not by a file name: {outside[:10]}")
        absent = sorted(n for n in indexed if not (folder / n).is_file() or (folder / n).is_symlink())
        if absent:
            raise UploadError(f"{INDEX_NAME} names shards that are missing (or symlinks): {absent[:10]}")
    chosen, skipped, notes = [], [], []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        name = path.name
        if path.is_symlink():
            skipped.append((name, "symlink (never uploaded; copy the file if it belongs)"))
        elif name.startswith("."):
            skipped.append((name, "hidden"))
        elif path.is_dir():
            skipped.append((name, "folder (only top-level files are uploaded)"))
        elif not path.is_file():
            skipped.append((name, "not a regular file"))
        elif CREDENTIAL_PATTERN.search(name) and name not in allowed:
            skipped.append((name, "looks like a credential"))
        elif name.endswith(".safetensors"):  # any shard name the index uses; without an index the single files
            if name in SINGLE_WEIGHTS or (indexed is not None and name in indexed):
                chosen.append(path)
            elif indexed is not None:
                skipped.append((name, f"a shard {INDEX_NAME} does not name (stale?)"))
            else:
                skipped.append((name, f"a shard without {INDEX_NAME}"))
        elif name == INDEX_NAME or name in allowed:
            chosen.append(path)
        elif name in code:
            chosen.append(path)
        elif name.endswith(".py"):
            skipped.append((name, "Python file that is not one of this package's remote-code modules"))
        else:
            skipped.append((name, "not on the allow-list"))
    if not any(p.name.endswith(".safetensors") for p in chosen):
        raise UploadError(f"{folder} holds no safetensors weights to upload")
    for path in chosen:
        if not path.name.endswith(".safetensors") and TOKEN_CONTENT_PATTERN.search(path.read_bytes()):
            raise UploadError(
                f"{path.name} contains what looks like a Hugging Face access token (hf_...); remove it from the file "
                "before uploading (nothing was uploaded)"
            )
    if kind == "packed":
        missing = sorted(code - {p.name for p in chosen})
        if missing:
            notes.append(f"note: remote-code modules of this package version not in the folder: {', '.join(missing)}")
    return chosen, skipped, notes


# ------------------------------------------------------------------------------------------------------- report


def load_report(folder: Path) -> dict | None:
    """The folder's verification report (`load_report_file`), or None when there is none."""
    path = folder / REPORT_NAME
    return load_report_file(path) if path.is_file() else None


def load_report_file(path: Path) -> dict:
    """A verification report file, validated (`report_schema.read_report_file`); UploadError when it is not one."""
    return read_report_file(path, UploadError)


def record_round_trip(folder, result) -> Path:
    """Write a `convert --verify` result (a VerifyResult) as `round_trip` into FOLDER's report (created if absent)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UploadError(f"--report-to {folder} is not a folder")
    path = folder / REPORT_NAME
    report = load_report(folder) or {"schema": REPORT_SCHEMA}
    report["round_trip"] = {"identical": result.identical, "tensors": result.tensors_a, "digest": result.digest_a}
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


def license_from_file(folder: Path) -> str | None:
    """The license id of a LICENSE file copied from the source checkpoint, for the texts recognised here."""
    path = folder / "LICENSE"
    if not path.is_file():
        return None
    head = path.read_text(encoding="utf-8", errors="replace")[:2000]
    if "Apache License" in head and "Version 2.0" in head:
        return "apache-2.0"
    if re.search(r"\bMIT License\b", head):
        return "mit"
    return None


# --------------------------------------------------------------------------------------------------------- card


def usage_snippets(
    repo_id: str, kind: str, is_moe: bool, base_model: str | None, vision: bool = False, reward: bool = False
) -> dict[str, str]:
    """The code blocks of the card, by name; each is complete as shown (the tests run the transformers one).
    A vision-language folder loads through `AutoModelForImageTextToText` (its auto_map / the built-in mapping), a
    sequence-classification (`reward`) one through `AutoModelForSequenceClassification`, scored, not generating."""
    if reward:
        return _reward_snippets(repo_id, kind)
    builtin = (
        ("Qwen3_5MoeForConditionalGeneration" if is_moe else "Qwen3_5ForConditionalGeneration")
        if vision
        else ("Qwen3_5MoeForCausalLM" if is_moe else "Qwen3_5ForCausalLM")
    )
    auto = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    remote = ", trust_remote_code=True" if kind == "packed" else ""
    snippets = {}
    if kind == "adapter":
        base = base_model or "BASE_MODEL"
        snippets["peft"] = (
            "from peft import PeftModel\n"
            f"from transformers import {auto}\n\n"
            f'base = {auto}.from_pretrained("{base}", trust_remote_code=True)\n'
            f'model = PeftModel.from_pretrained(base, "{repo_id}")\n'
            "merged = model.merge_and_unload()  # plain weights with the base model's names (vLLM loads them)\n"
        )
        return snippets
    snippets["transformers"] = (
        "import torch\n"
        f"from transformers import {auto}\n\n"
        f'model = {auto}.from_pretrained("{repo_id}"{remote})\n'
        "ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])\n"
        "logits = model(ids).logits\n"
    )
    if kind == "packed":
        snippets["packed"] = (
            "import torch\n"
            f"from transformers import {auto}\n\n"
            f'model = {auto}.from_pretrained("{repo_id}", trust_remote_code=True)\n'
            "# two documents (4 and 3 tokens) packed in one row: each one sees only itself\n"
            "ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])\n"
            "out = model(ids, cu_seqlens=torch.tensor([0, 4, 7]), labels=ids)\n"
            "# also accepted: position_ids restarting at 0 per document (DataCollatorWithFlattening)\n"
        )
        if not vision:  # `trl grpo` trains text models
            snippets["trl"] = (
                f"trl grpo --model_name_or_path {repo_id} --trust_remote_code true \\\n"
                "    --dataset_name YOUR_DATASET --reward_funcs my_rewards.reward_fn \\\n"
                "    --output_dir grpo-out\n"
                "# my_rewards.py (on PYTHONPATH): def reward_fn(completions, **kwargs) -> list[float]\n"
            )
        snippets["peft"] = (
            "from peft import LoraConfig, get_peft_model\n"
            f"from transformers import {auto}\n\n"
            f'model = {auto}.from_pretrained("{repo_id}", trust_remote_code=True)\n'
            "config = LoraConfig(\n"
            '    r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",\n'
            '    target_modules=["q_proj", "k_proj", "v_proj", "o_proj",  # gated attention\n'
            '                    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",  # GDN\n'
            '                    "gate_proj", "up_proj", "down_proj"],  # MLP / shared expert\n'
            + (
                '    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # needs dropout 0\n'
                if is_moe
                else ""
            )
            + ")\n"
            "model = get_peft_model(model, config)  # conv1d takes LoRA too, at r a multiple of its channels\n"
        )
        snippets["vllm"] = (
            "# with the qwen35-packed package installed next to vLLM, its `qwen35_packed` plugin (entry point group\n"
            "# vllm.general_plugins) maps this folder's architecture onto vLLM's native Qwen3.5 classes\n"
            "from vllm import LLM, SamplingParams\n\n"
            f'llm = LLM(model="{repo_id}")\n'
            "# without the plugin, name vLLM's class yourself:\n"
            f'# llm = LLM(model="{repo_id}", hf_overrides={{"architectures": ["{builtin}"]}})\n'
            'print(llm.generate(["Hello"], SamplingParams(max_tokens=16))[0].outputs[0].text)\n'
        )
    else:
        snippets["vllm"] = (
            "from vllm import LLM, SamplingParams\n\n"
            f'llm = LLM(model="{repo_id}")\n'
            'print(llm.generate(["Hello"], SamplingParams(max_tokens=16))[0].outputs[0].text)\n'
        )
    return snippets


def _reward_snippets(repo_id: str, kind: str) -> dict[str, str]:
    remote = ", trust_remote_code=True" if kind == "packed" else ""
    snippets = {
        "transformers": (
            "import torch\n"
            f"from transformers import {REWARD_AUTO_CLASS}\n\n"
            f'model = {REWARD_AUTO_CLASS}.from_pretrained("{repo_id}"{remote})\n'
            "ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])\n"
            "scores = model(ids).logits  # [1, num_labels]: the score of the sequence, read at its last token\n"
        )
    }
    if kind == "packed":
        snippets["packed"] = (
            "import torch\n"
            f"from transformers import {REWARD_AUTO_CLASS}\n\n"
            f'model = {REWARD_AUTO_CLASS}.from_pretrained("{repo_id}", trust_remote_code=True)\n'
            "# two documents (4 and 3 tokens) packed in one row: each one sees only itself\n"
            "ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])\n"
            "scores = model(ids, cu_seqlens=torch.tensor([0, 4, 7])).logits  # [2, num_labels]: one per document\n"
        )
    return snippets


_LANGUAGES = {"transformers": "python", "packed": "python", "trl": "bash", "peft": "python", "vllm": "python"}
_TITLES = {
    "transformers": "transformers",
    "packed": "Packed documents (exact)",
    "trl": "TRL GRPO (`trl grpo` CLI)",
    "peft": "PEFT LoRA",
    "vllm": "vLLM",
}


def _report_section(report: dict) -> list[str]:
    lines = ["## Verification", "", f"Measured numbers from `{REPORT_NAME}` (schema `{REPORT_SCHEMA}`).", ""]
    round_trip = report.get("round_trip")
    if round_trip:
        verdict = "bit-identical" if round_trip["identical"] else "NOT identical"
        extra = f", {round_trip['tensors']} tensors" if "tensors" in round_trip else ""
        digest = f", digest `{round_trip['digest'][:16]}`" if "digest" in round_trip else ""
        lines += [f"- Round trip official -> packed -> official: {verdict}{extra}{digest}.", ""]
    doctor = report.get("doctor")
    if doctor:
        lines += [f"### Doctor: {doctor['status']}", "",
                  f"`qwen35-packed doctor` on {doctor.get('device', '?')}"
                  + (" with " + ", ".join(f"{k} {v}" for k, v in sorted(doctor.get("versions", {}).items()))
                     if doctor.get("versions") else "") + ".", "",
                  "| check | status | detail |", "|---|---|---|"]  # fmt: skip
        for c in doctor["checks"]:
            cells = [c["check"], c["status"], c["detail"] + (f" Fix: {c['fix']}" if c["fix"] else "")]
            lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
        lines.append("")
    for section, title in (("parity", "Parity"), ("performance", "Performance")):
        entries = report.get(section) or []
        if not entries:
            continue
        lines += [f"### {title}", "", "| check | value | unit | dtype | device | notes |", "|---|---|---|---|---|---|"]
        for e in entries:
            cells = [e["check"], f"{e['value']:.4g}", e.get("unit", ""), e.get("dtype", ""), e.get("device", ""),
                     e.get("notes", "")]  # fmt: skip
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return lines


def build_card(
    repo_id: str,
    kind: str,
    is_moe: bool,
    *,
    base_model: str | None,
    license: str | None,
    config: dict,
    report: dict | None,
    vision: bool = False,
):
    """The model card (a huggingface_hub ModelCard) for the folder."""
    from huggingface_hub import ModelCard, ModelCardData

    from .conversion.config import is_sequence_classifier

    reward = kind != "adapter" and is_sequence_classifier(config)
    tags = ["qwen3_5", "qwen35-packed", "packed-sequences"]
    tags += ["moe"] if is_moe else []
    tags += ["reward-model"] if reward else []
    tags += ["peft", "lora"] if kind == "adapter" else []
    data = ModelCardData(
        library_name="peft" if kind == "adapter" else "transformers",
        base_model=base_model,
        license=license,
        tags=tags,
        pipeline_tag="text-classification" if reward else "image-text-to-text" if vision else "text-generation",
    )
    name = repo_id.split("/")[-1]
    size = ("MoE" if is_moe else "dense") + (" vision-language" if vision else " text")
    size += " sequence-classification (reward / value)" if reward else ""
    about = {
        "packed": (
            f"Qwen3.5 {size} model in the `qwen35-packed` layout: "
            "transformers remote code (`trust_remote_code=True`) that is exact for packed documents (the GDN conv, "
            "the delta-rule recurrence, attention, rope positions and the loss all honour document boundaries). The "
            "weights have the names and shapes of transformers' built-in Qwen3.5 classes, "
            + (
                "which have no MoE sequence-classification class: the remote code is the one that loads them."
                if reward and is_moe
                else "which load them without `trust_remote_code` (unpacked input only)."
            )
        ),
        "official": (
            f"Qwen3.5 {size} checkpoint in the official layout, written by `qwen35-packed convert --to official` "
            "(transformers' architectures, fused experts; the MTP head and the vision tower where the source had them)."
        ),
        "adapter": f"PEFT LoRA adapter for a Qwen3.5 {size} model (qwen35-packed).",
    }[kind]
    lines = [f"# {name}", "", about, ""]
    if reward:
        labels = len(config.get("id2label") or {}) or 2  # config.json stores id2label; 2 is transformers' default
        lines += [
            f"One score per document, read at its last token (`score.weight`, `num_labels` {labels}). A reward "
            "model is scored in transformers; qwen35-packed does not serve it through vLLM.",
            "",
        ]
    if base_model:
        lines += [f"Base model: [{base_model}](https://huggingface.co/{base_model}).", ""]
    lines += ["## Usage", ""]
    for key, code in usage_snippets(repo_id, kind, is_moe, base_model, vision, reward).items():
        lines += [f"### {_TITLES[key]}", "", f"```{_LANGUAGES[key]}", code.rstrip("\n"), "```", ""]
    coef = (config.get("text_config") or config).get("router_aux_loss_coef") if kind != "adapter" else None
    if is_moe and coef is not None:
        lines += [
            "## MoE load-balancing loss",
            "",
            f"`router_aux_loss_coef` is {coef} in config.json. "
            + (
                "A value > 0 adds a load-balancing gradient in stacks that compute it whenever router logits are "
                "returned, which is not part of an RL objective; convert with `--router-aux-loss-coef 0` for RL."
                if coef
                else "It is 0: no load-balancing loss is added."
            ),
            "",
        ]
    if report:
        lines += _report_section(report)
    content = "---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(lines).rstrip("\n") + "\n"
    return ModelCard(content)


# ------------------------------------------------------------------------------------------------------- upload


def plan_upload(
    folder,
    repo_id: str,
    *,
    private: bool = False,
    base_model: str | None = None,
    license: str | None = None,
    replace_card: bool = False,
) -> UploadPlan:
    """Decide everything `upload` will send; reads the folder, writes nothing, needs no network."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    folder = Path(folder)
    if not folder.is_dir():
        raise UploadError(f"{folder} is not a folder")
    if repo_id.count("/") != 1:
        raise UploadError(f"--repo-id must be ORG/NAME, got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise UploadError(f"--repo-id {repo_id!r}: {exc}") from exc
    kind, is_moe, vision, config = _classify(folder)
    chosen, skipped, notes = select_files(folder, kind)
    report = load_report(folder)
    source = (report or {}).get("source", {})
    if base_model is None:
        base_model = config.get("base_model_name_or_path") if kind == "adapter" else None
        base_model = base_model or source.get("base_model")
    if license is None:
        license = source.get("license") or license_from_file(folder)
    if base_model is None:
        notes.append("note: no base model known; pass --base-model ORG/NAME to link the source model")
    if license is None:
        notes.append("note: no license known (no --license, report source.license or recognised LICENSE file)")

    has_card = any(p.name == CARD_NAME for p in chosen)
    files = [
        UploadFile(p.name, p.stat().st_size, local=p) for p in chosen if not (p.name == CARD_NAME and replace_card)
    ]
    if has_card and not replace_card:
        card_text, card_source = (folder / CARD_NAME).read_text(encoding="utf-8"), f"{CARD_NAME} in FOLDER"
        notes.append(f"note: uploading the folder's own {CARD_NAME}; --replace-card uploads the generated card")
    else:
        card = build_card(
            repo_id, kind, is_moe, base_model=base_model, license=license, config=config, report=report, vision=vision
        )
        card_text, card_source = str(card), "generated"
        data = card_text.encode("utf-8")
        files.append(UploadFile(CARD_NAME, len(data), content=data))
    files.sort(key=lambda f: f.path_in_repo)
    return UploadPlan(folder, repo_id, private, kind, is_moe, files, skipped, card_text, card_source,
                      token_source(), notes, vision)  # fmt: skip


def upload(plan: UploadPlan, api) -> object:
    """Create the repository (if missing) and upload the planned files in one commit; returns the commit info."""
    from huggingface_hub import CommitOperationAdd

    api.create_repo(repo_id=plan.repo_id, repo_type="model", private=plan.private, exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local) if f.local else f.content)
        for f in plan.files
    ]
    kind = "PEFT adapter" if plan.kind == "adapter" else f"{plan.kind} model"
    return api.create_commit(
        repo_id=plan.repo_id,
        repo_type="model",
        operations=operations,
        commit_message=f"Upload {kind} with qwen35-packed hub_upload ({len(operations)} files)",
    )


UPLOAD_DESCRIPTION = (
    "Upload a model folder (qwen35-packed or official layout) or a PEFT adapter folder to the Hugging Face Hub with a "
    "generated model card. Only allow-listed top-level files go; --dry-run prints the plan and the card. The token "
    "comes from HF_TOKEN or the cached login and is never printed."
)


def add_upload_arguments(p: argparse.ArgumentParser) -> None:
    """The uploader's arguments, on hub_upload.py's parser and on `qwen35-packed upload`'s."""
    p.add_argument("folder", metavar="FOLDER")
    p.add_argument("--repo-id", required=True, metavar="ORG/NAME")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--base-model", metavar="ORG/NAME", help="the source model for the card's base_model")
    p.add_argument("--license", help="license id for the card (default: the report's source.license or LICENSE)")
    p.add_argument("--replace-card", action="store_true", help="upload the generated card over the folder's README.md")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded and the card; send nothing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hub_upload.py", description=UPLOAD_DESCRIPTION)
    add_upload_arguments(p)
    return p


def main(argv: list[str] | None = None, *, api=None) -> int:
    """Entry point of hub_upload.py. `api` replaces `huggingface_hub.HfApi()` (tests pass a recording fake)."""
    return run_upload(build_parser().parse_args(argv), api=api)


def run_upload(args: argparse.Namespace, *, api=None) -> int:
    """Plan (and unless --dry-run, make) the upload `add_upload_arguments`' arguments ask for; the exit status."""
    try:
        plan = plan_upload(
            args.folder,
            args.repo_id,
            private=args.private,
            base_model=args.base_model,
            license=args.license,
            replace_card=args.replace_card,
        )
        for line in plan.lines():
            print(line)
        if args.dry_run:
            print(f"--- model card ({plan.card_source}) ---")
            print(plan.card_text.rstrip("\n"))
            print("--- dry run: nothing uploaded ---")
            return 0
        if api is None:
            if plan.token_source.startswith("none"):
                raise UploadError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
            from huggingface_hub import HfApi

            api = HfApi()
        info = upload(plan, api)
    except UploadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # huggingface_hub's HTTP errors are OSErrors; the token is never in them
        print(f"error: the upload failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    url = getattr(info, "commit_url", None) or f"https://huggingface.co/{plan.repo_id}"
    print(f"uploaded {len(plan.files)} files: {url}")
    return 0


__all__ = [
    "REPORT_NAME",
    "REPORT_SCHEMA",
    "UploadError",
    "UploadPlan",
    "build_card",
    "load_report",
    "load_report_file",
    "main",
    "plan_upload",
    "run_upload",
    "upload",
    "usage_snippets",
]
