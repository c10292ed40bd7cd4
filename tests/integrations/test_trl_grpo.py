"""TRL GRPO with packed Qwen3.5: the `trl grpo` CLI (dense; MoE + LoRA on GDN and experts) and the example script
at learning rates that move the weights (reward spread, every trained tensor / LoRA B moved),
PackedGRPOTrainer's log-prob step equal to TRL's padded one while projecting only the scored rows, the reference
model being ours, and the MoE aux loss off unless asked."""

import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from fixtures_grpo import EXAMPLES, GRPO_CPU_STEPS, _long_tail_batch, _trainer, folders, grpo_run_args  # noqa: F401 - a fixture

trl = pytest.importorskip("trl")
pytest.importorskip("peft")

from qwen35_packed.integrations import grpo_trainer  # noqa: E402
from qwen35_packed.integrations.grpo import PackedGRPOTrainer, check_aux_loss_coef, default_generation_cache  # noqa: E402
from qwen35_packed.integrations.lora import trl_cli_args  # noqa: E402

SMALL_RUN = [*GRPO_CPU_STEPS, "--beta", "0.04"]


def _count_lm_head_rows(monkeypatch):
    """Record how many hidden rows each call of TRL's chunked log-prob kernel projects."""
    from trl.kernels import ChunkedLogProbFunction

    rows, original = [], ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        rows.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(ChunkedLogProbFunction, "apply", counting)
    return rows


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logprob_step_equals_the_padded_path_without_padding_rows(kind, folders, tmp_path, monkeypatch):
    stock = _trainer(trl.GRPOTrainer, folders, kind, tmp_path)
    ours = _trainer(PackedGRPOTrainer, folders, kind, tmp_path)
    ours.model.load_state_dict(stock.model.state_dict())
    rows = _count_lm_head_rows(monkeypatch)
    ids, mask, completion_len, scored = _long_tail_batch()
    results = {}
    for name, trainer in (("stock", stock), ("ours", ours)):
        trainer.model.zero_grad(set_to_none=True)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, completion_len, compute_entropy=True
        )
        (logps * mask[:, -completion_len:]).sum().backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        results[name] = (logps.detach(), entropies.detach(), grads)
    assert rows == [ids.shape[0] * (ids.shape[1] - 1), scored]  # TRL on CPU: every position; ours: scored only
    assert torch.equal(results["stock"][0], results["ours"][0])
    assert torch.equal(results["stock"][1], results["ours"][1])
    assert results["ours"][0][mask[:, -completion_len:] == 0].abs().max() == 0
    assert set(results["stock"][2]) == set(results["ours"][2])
    for name, grad in results["ours"][2].items():
        torch.testing.assert_close(grad, results["stock"][2][name], rtol=1e-5, atol=1e-6)


def test_policy_and_reference_model_are_ours(folders, tmp_path):
    trainer = _trainer(PackedGRPOTrainer, folders, "moe", tmp_path)
    for model in (trainer.model, trainer.ref_model):
        assert type(model).__name__ == "Qwen3_5MoePackedForCausalLM"
        assert type(model).__module__.startswith("transformers_modules.")
    stock = _trainer(trl.GRPOTrainer, folders, "dense", tmp_path)
    assert type(stock.ref_model).__name__ == "Qwen3_5PackedForCausalLM"


def test_built_in_model_is_refused(folders, tmp_path):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        _trainer(PackedGRPOTrainer, folders, "dense", tmp_path, trust_remote_code=False)


def test_moe_aux_loss_off_unless_asked(folders, tmp_path, caplog):
    # TRL alone turns it on from the config's router_aux_loss_coef (0.001 here, as in the official configs)
    assert _trainer(trl.GRPOTrainer, folders, "moe", tmp_path).aux_loss_enabled
    quiet = _trainer(PackedGRPOTrainer, folders, "moe", tmp_path)
    assert not quiet.aux_loss_enabled and quiet.router_aux_loss_coef == 0.0
    with caplog.at_level(logging.WARNING):
        asked = _trainer(PackedGRPOTrainer, folders, "moe", tmp_path, router_aux_loss_coef=0.05)
    assert asked.aux_loss_enabled and asked.router_aux_loss_coef == 0.05
    assert [r.message for r in caplog.records if "load-balancing" in r.message] == [
        "GRPO: MoE load-balancing loss on, router_aux_loss_coef=0.05 (set by the caller)"
    ]
    # computed over the real tokens: equal to the model's own aux loss on the same padded batch (under the same
    # autocast: GRPOConfig defaults to bf16, which on CPU means bf16 autocast)
    ids, mask, completion_len, _ = _long_tail_batch()
    with torch.no_grad():
        _, _, aux = asked._get_per_token_logps_and_entropies(
            asked.model, ids, mask, completion_len, compute_aux_loss=True
        )
        with asked.accelerator.autocast():
            own = asked.model(ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    torch.testing.assert_close(aux, own)
    assert not _trainer(PackedGRPOTrainer, folders, "dense", tmp_path).aux_loss_enabled


def test_stock_trl_aux_loss_equals_the_models_own(folders, tmp_path):
    # Stock TRL computes the load-balancing loss itself, with transformers' function, the padded attention_mask and
    # the backbone's router logits: the same number as the model's real-token aux loss on the same batch.
    stock = _trainer(trl.GRPOTrainer, folders, "moe", tmp_path)
    ids, mask, completion_len, _ = _long_tail_batch()
    assert (mask == 0).any()
    with torch.no_grad(), stock.accelerator.autocast():
        _, _, aux = stock._get_per_token_logps_and_entropies(
            stock.model, ids, mask, completion_len, compute_aux_loss=True
        )
        own = stock.model(ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    torch.testing.assert_close(aux, own)


@pytest.mark.parametrize(
    "value, match", [("0.01", "must be a number"), (True, "must be a number"), (-1.0, ">= 0"), (float("nan"), ">= 0")]
)
def test_aux_loss_coefficient_errors(value, match, folders, tmp_path):
    with pytest.raises(ValueError, match=match):
        check_aux_loss_coef(value)
    with pytest.raises(ValueError, match=match):
        _trainer(PackedGRPOTrainer, folders, "moe", tmp_path, router_aux_loss_coef=value)


def test_default_generation_cache_rule():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = dict(cache_implementation=None, generation_kwargs=None, use_vllm=False)
    assert default_generation_cache(trl.GRPOConfig(output_dir="x", use_cpu=True), cuda) == "static"
    for changed in (
        dict(cache_implementation="dynamic"),
        dict(cache_implementation="static"),  # the caller's own choice: nothing to say
        dict(generation_kwargs={"cache_implementation": "dynamic"}),
        dict(use_vllm=True),
        dict(use_transformers_continuous_batching=True),
    ):
        assert default_generation_cache(types.SimpleNamespace(**{**base, **changed}), cuda) is None, changed
    assert default_generation_cache(types.SimpleNamespace(**base), cpu) is None


def _recording_generate(model):
    """Wrap `model.generate` (an instance attribute TRL's unwrapped model keeps) to record the cache each call asks."""
    asked, original = [], model.generate

    def generate(*args, **kwargs):
        config = kwargs.get("generation_config")
        asked.append(kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)))
        return original(*args, **kwargs)

    model.generate = generate
    return asked


def test_trainer_generates_with_the_default_cache(folders, tmp_path, monkeypatch, caplog):
    # CPU keeps TRL's default (the growing cache); where the rule gives a cache (CUDA), a step's generate() asks for it
    trainer = _trainer(PackedGRPOTrainer, folders, "dense", tmp_path, max_steps=1)
    assert trainer.generation_config.cache_implementation is None
    monkeypatch.setattr(grpo_trainer, "default_generation_cache", lambda args, device: "static")
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(PackedGRPOTrainer, folders, "dense", tmp_path, max_steps=1)
    assert [r.message for r in caplog.records if "cache_implementation" in r.message] == [
        "GRPO: completions from generate() with cache_implementation='static' (decode steps replayed as CUDA graphs); "
        "GRPOConfig(cache_implementation='dynamic') keeps the growing cache"
    ]
    asked = _recording_generate(trainer.model)
    trainer.train()
    assert asked and set(asked) == {"static"}


def test_activation_offloading_needs_an_accelerator(folders, tmp_path):
    with pytest.raises(ValueError, match="needs an accelerator, and the trainer's device is the CPU"):
        _trainer(PackedGRPOTrainer, folders, "dense", tmp_path, trainer_kwargs={"activation_offloading": True})


def test_activation_offloading_wraps_each_training_step(folders, tmp_path, monkeypatch):
    """The offloading context (here saved-tensor hooks that count what a step saves and hand it back unchanged, as
    TRL's would after the round trip to the host) is around every training step, and the steps' losses and the
    trained weights are those of a run without it."""

    def trained(name, **trainer_kwargs):
        trainer = _trainer(
            PackedGRPOTrainer,
            folders,
            "moe",
            tmp_path / name,
            trainer_kwargs=trainer_kwargs,
            max_steps=2,
            seed=0,
            logging_steps=1,
        )
        trainer.train()
        return trainer

    trained("warm-up")  # the process's first steps draw random numbers later runs do not (lazy initialisation)
    plain = trained("plain")
    saved = []

    def counting_context(model, device):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t)

    monkeypatch.setattr(grpo_trainer, "activation_offload_context", counting_context)
    offloaded = trained("offloaded", activation_offloading=True)
    assert offloaded.activation_offloading
    assert saved, "no tensor went through the offloading hooks"
    losses = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (plain, offloaded)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    for (name, a), b in zip(plain.model.named_parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b), name


def _run(cmd, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def _grpo(launcher, folders, kind, out, *flags):
    """The log of a GRPO run in examples/ (`launcher`: the `trl grpo` command or examples/grpo.py) of folders[kind]
    on the prompt dataset, writing to `out`, with `flags`."""
    return _run([*launcher, *grpo_run_args(folders[kind], folders["data"], out), *flags], cwd=EXAMPLES)


def _trl_cli():
    cli = Path(sys.executable).with_name("trl")
    if not cli.exists():
        pytest.fail(f"the trl command is not installed beside {sys.executable} (pip install -e '.[train]')")
    return str(cli)


def _assert_rewards_spread(log, steps=2):
    """Every logged step had a group whose rewards differ (else its advantages, and the update, are zero)."""
    fractions = [float(x) for x in re.findall(r"'frac_reward_zero_std': '([^']+)'", log)]
    assert len(fractions) == steps and max(fractions) < 1, (fractions, log[-3000:])


def _tensors(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _assert_every_lora_b_moved(adapter):
    """Every LoRA B (zero at the start) moved: each adapted module took part in the updates, one by one."""
    unmoved = [k for k, v in adapter.items() if "lora_B" in k and not v.any()]
    assert not unmoved and any("lora_B" in k for k in adapter), unmoved


# 1e-4 on the whole dense model: 1e-3 makes the tiny policy deterministic after one step (no reward spread left)
def test_trl_grpo_cli_dense(folders, tmp_path):
    out = tmp_path / "run"
    log = _grpo([_trl_cli(), "grpo"], folders, "dense", out, *SMALL_RUN, "--learning_rate", "1e-4")
    assert log.count("'reward':") == 2 and "Training completed" in log
    _assert_rewards_spread(log)
    # every tensor moved, one by one
    initial, trained = _tensors(folders["dense"] / "model.safetensors"), _tensors(out / "model.safetensors")
    assert set(trained) == set(initial)
    unmoved = [k for k in sorted(initial) if torch.equal(initial[k].float(), trained[k].float())]
    assert not unmoved, unmoved


def test_trl_grpo_cli_moe_lora_on_gdn_and_experts(folders, tmp_path):
    out = tmp_path / "run"
    lora = trl_cli_args(build_config(folders["moe"]), r=4)
    assert "--lora_target_parameters" in lora and "in_proj_qkv" in lora
    # No --router_aux_loss_coef: stock TRL adds the config's load-balancing loss (0.001), and the model says so once
    log = _grpo([_trl_cli(), "grpo"], folders, "moe", out, *SMALL_RUN, "--learning_rate", "1e-3", *lora)
    assert log.count("'reward':") == 2 and "Training completed" in log
    assert log.count("'aux_loss':") == 2 and log.count("router logits returned with router_aux_loss_coef=0.001") == 1
    _assert_rewards_spread(log)
    adapter = _tensors(out / "adapter_model.safetensors")
    assert any("experts" in k for k in adapter) and any("linear_attn.in_proj_qkv" in k for k in adapter)
    _assert_every_lora_b_moved(adapter)


def test_example_script_moe_lora_with_aux_loss_asked(folders, tmp_path):
    out = tmp_path / "run"
    lora = trl_cli_args(build_config(folders["moe"]), r=4)
    flags = ["--router_aux_loss_coef", "0.01", *SMALL_RUN, "--learning_rate", "1e-3", *lora]
    log = _grpo([sys.executable, "grpo.py"], folders, "moe", out, *flags)
    assert log.count("'aux_loss':") == 2 and "router_aux_loss_coef=0.01" in log
    _assert_rewards_spread(log)
    _assert_every_lora_b_moved(_tensors(out / "adapter_model.safetensors"))


def _example_grpo():
    sys.path.insert(0, str(EXAMPLES))
    import grpo

    return grpo


@pytest.mark.parametrize("flag", ["--routing_replay", "--activation_offloading"])
def test_example_script_refuses_a_trainer_option_that_is_not_true_or_false(flag):
    with pytest.raises(ValueError, match=f"{flag} takes true or false, got 'yes'"):
        _example_grpo().main(["--model_name_or_path", "x", flag, "yes"])


def test_example_script_passes_activation_offloading_to_the_trainer(folders, tmp_path, monkeypatch):
    # on the CPU the trainer refuses it: the flag reached PackedGRPOTrainer
    monkeypatch.chdir(EXAMPLES)
    args = [*grpo_run_args(folders["dense"], folders["data"], tmp_path / "run"), *GRPO_CPU_STEPS]
    with pytest.raises(ValueError, match="needs an accelerator"):
        _example_grpo().main([*args, "--activation_offloading", "true"])


def build_config(folder):
    import transformers

    return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
