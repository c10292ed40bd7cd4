"""PackedGRPOTrainer's MoE routing replay without vLLM: the log-prob step replays the routing kept from the engine
(placed in GRPO's padded layout, handed to TRL's chunked forwards row by row), GRPO steps on a stand-in engine whose
routing reaches every trainer forward through the batch, the refusals, and the layout helper. The run with vLLM is
tests/integrations/test_vllm_routing_replay.py."""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

from fixtures_grpo import _long_tail_batch, _trainer, folders  # noqa: E402, F401

from qwen35_packed.integrations.grpo import PackedGRPOTrainer, RoutedModel, RoutingFeed  # noqa: E402
from qwen35_packed.integrations.vllm_routing import padded_routed_experts  # noqa: E402


def _engine_arrays(routing, mask, completion_len, num_layers):
    """What vLLM would return per row: [real prompt + completion - 1, num_hidden_layers, k] (the last token never
    runs), from routing [batch, seq, MoE layers, k] in the padded layout."""
    arrays, lengths = [], []
    prompt_width = mask.shape[1] - completion_len
    for row, m in zip(routing, mask):
        real = row[m.bool()][:-1].numpy()
        arrays.append(np.ascontiguousarray(real[:, :num_layers]))
        lengths.append((int(m[:prompt_width].sum()), int(m[prompt_width:].sum())))
    return [(p, c, a) for (p, c), a in zip(lengths, arrays)]


def test_logprob_step_replays_the_kept_engine_routing(folders, tmp_path):  # noqa: F811
    trainer = _trainer(PackedGRPOTrainer, folders, "moe", tmp_path, bf16=False)
    model = trainer.model.eval()
    ids, mask, completion_len, _ = _long_tail_batch()
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, output_router_logits=True, use_cache=False).router_logits
        own = torch.stack([x.softmax(-1).topk(k, -1).indices for x in logits], 1).view(*ids.shape, -1, k)
        plain = trainer._get_per_token_logps_and_entropies(model, ids, mask, completion_len, batch_size=2)[0]
        trainer.routing_replay = True
        results = {}
        for name, routing in (("own", own), ("shifted", (own + 1) % experts)):
            trainer._rollout_routing = None
            trainer._engine_routing = _engine_arrays(routing, mask, completion_len, model.config.num_hidden_layers)
            results[name] = trainer._get_per_token_logps_and_entropies(model, ids, mask, completion_len, batch_size=2)[
                0
            ]
            kept = trainer._rollout_routing
            assert (kept[mask == 0] == -1).all()  # pads route normally
            last = mask.cumsum(1).argmax(1)  # the last real token of each row was never run by the engine
            assert (kept[torch.arange(len(ids)), last] == -1).all()
        direct = model(ids, attention_mask=mask, routed_experts=kept, use_cache=False).logits
    scored = mask[:, -completion_len:].bool()
    assert torch.equal(results["own"], plain)
    assert not torch.equal(results["shifted"][scored], plain[scored])
    # the step's log-probs are the model's own under the replayed routing (TRL's kernel vs log_softmax: fp32 noise)
    expected = direct[:, -completion_len - 1 : -1].log_softmax(-1).gather(-1, ids[:, -completion_len:, None])[..., 0]
    torch.testing.assert_close(results["shifted"][scored], expected[scored], rtol=0, atol=1e-5)
    # rows without routing (a training step whose inputs lost theirs) are refused, not given another batch's
    trainer._rollout_routing, trainer._engine_routing = None, None
    with pytest.raises(RuntimeError, match="rows that carry no routed experts"):
        trainer._get_per_token_logps_and_entropies(model, ids, mask, completion_len)
    # a batch whose prompts are not the engine's is refused
    trainer._engine_routing = _engine_arrays(own, mask, completion_len, model.config.num_hidden_layers)
    trainer._engine_routing = trainer._engine_routing[:-1]
    with pytest.raises(RuntimeError, match="routed experts of 5 completions for a batch of 6 rows"):
        trainer._get_per_token_logps_and_entropies(model, ids, mask, completion_len)


def test_padded_layout_of_engine_routing(folders):  # noqa: F811
    import transformers

    config = transformers.AutoConfig.from_pretrained(folders["moe"], trust_remote_code=True)
    layers, k = config.num_hidden_layers, config.num_experts_per_tok
    arrays = [np.full((2 + 3 - 1, layers, k), 1), np.full((1 + 1, layers, k), 2)]  # 2+3 tokens; 1+1 (all run)
    out = padded_routed_experts(arrays, [2, 1], [3, 1], prompt_width=3, completion_width=4, config=config)
    assert out.shape == (2, 7, layers, k)
    token_has_ids = (out[..., 0, 0] != -1).tolist()
    assert token_has_ids == [
        [False, True, True, True, True, False, False],
        [False, False, True, True, False, False, False],
    ]
    with pytest.raises(ValueError, match="expected \\[4 or 5 tokens"):
        padded_routed_experts([np.zeros((7, layers, k))], [2], [3], 3, 4, config)
    with pytest.raises(ValueError, match="routed experts have 3 layers; the model has 4 decoder layers"):
        padded_routed_experts([np.zeros((4, 3, k))], [2], [3], 3, 4, config)


def test_routing_feed_hands_out_consecutive_rows_only_to_the_routed_model():
    ids = torch.arange(12).view(4, 3)
    routed = torch.arange(4).view(4, 1, 1, 1).expand(4, 3, 1, 1)
    feed = RoutingFeed(routed, ids)
    assert torch.equal(feed.take(ids[:2]), routed[:2]) and torch.equal(feed.take(ids[2:]), routed[2:])
    with pytest.raises(RuntimeError, match="other rows than the next ones"):
        RoutingFeed(routed, ids).take(ids[1:3])
    calls = []  # a RoutedModel's calls reach the model with their rows' routing as the routed_experts keyword
    model = RoutedModel(lambda **kwargs: calls.append(kwargs), RoutingFeed(routed, ids))
    model(input_ids=ids[:1], fused_lm_head=True)
    model(input_ids=ids[1:])
    assert [sorted(c) for c in calls] == [
        ["fused_lm_head", "input_ids", "routed_experts"],
        ["input_ids", "routed_experts"],
    ]
    assert torch.equal(calls[0]["routed_experts"], routed[:1]) and torch.equal(calls[1]["routed_experts"], routed[1:])


def _replay_trainer(folders, kind, tmp_path, **config):  # noqa: F811
    class Replaying(PackedGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, routing_replay=True, **kwargs)

    return _trainer(Replaying, folders, kind, tmp_path, **config)


def test_routing_replay_refusals(folders, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="this is a dense model"):
        _replay_trainer(folders, "dense", tmp_path)
    with pytest.raises(ValueError, match="needs vllm_mode='colocate'"):
        _replay_trainer(folders, "moe", tmp_path, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=1 only"):
        _replay_trainer(folders, "moe", tmp_path, vllm_tensor_parallel_size=2)
    if importlib.util.find_spec("vllm") is None:  # the main environment (vLLM has its own)
        with pytest.raises(ValueError, match="routing replay needs vLLM"):
            _replay_trainer(folders, "moe", tmp_path)


class _StandInEngine:
    """vLLM's `LLM` as TRL's colocate mode uses it, for routing replay: each prompt gets a completion of random
    tokens with its log-probs and the routed experts vLLM would return ([prompt + completion - 1, decoder layers,
    top_k], random distinct experts per token), kept in `routing` by the row's tokens."""

    def __init__(self, config, **kwargs):
        assert kwargs.pop("enable_return_routed_experts") is True
        self.config, self.routing = config, {}
        self.rng = torch.Generator().manual_seed(0)

    def generate(self, prompts, sampling_params, use_tqdm=False):
        text = self.config.get_text_config()
        outputs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            length = int(torch.randint(1, sampling_params.max_tokens + 1, (1,), generator=self.rng))
            completion = torch.randint(3, 90, (length,), generator=self.rng).tolist()
            shape = (len(ids) + length - 1, text.num_hidden_layers, text.num_experts)
            routed = torch.rand(shape, generator=self.rng).argsort(-1)[..., : text.num_experts_per_tok].numpy()
            self.routing[tuple(ids + completion)] = routed
            logprobs = [{t: types.SimpleNamespace(logprob=-1.0, rank=1)} for t in completion]
            done = types.SimpleNamespace(token_ids=completion, logprobs=logprobs, routed_experts=routed)
            outputs.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=[done]))
        return outputs


def test_grpo_steps_replay_the_engine_routing_in_every_forward(folders, tmp_path, monkeypatch):  # noqa: F811
    import transformers
    from trl.generation import vllm_generation

    from qwen35_packed.integrations import vllm_routing, vllm_sync

    config = transformers.AutoConfig.from_pretrained(folders["moe"], trust_remote_code=True)
    engines = []

    def start_engine(*args, **kwargs):
        engines.append(_StandInEngine(config, **kwargs))
        return engines[-1]

    # vLLM's names in TRL's generation module, present only with vLLM installed; no weights to push into the stand-in
    monkeypatch.setattr(vllm_routing, "check_vllm_returns_routed_experts", lambda: None)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_generation, "LLM", start_engine, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", types.SimpleNamespace, raising=False)
    monkeypatch.setattr(vllm_sync, "vllm_runs_on_cpu", lambda: True)
    monkeypatch.setattr(vllm_sync, "push_weights", lambda llm, named_tensors: [])
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost")):
        monkeypatch.setenv(name, value)  # TRL sets them for vLLM; restored after the test
    monkeypatch.setenv("MASTER_PORT", "29517")
    trainer = _replay_trainer(
        folders, "moe", tmp_path, max_steps=4, steps_per_generation=2, logging_steps=1, bf16=False
    )
    assert vllm_generation.LLM is start_engine  # the stand-in for TRL's engine constructor is gone after __init__
    forwards = []

    def record(module, args, kwargs):
        forwards.append((kwargs["input_ids"], kwargs["attention_mask"], kwargs.get("routed_experts")))

    for model in (trainer.model, trainer.ref_model):
        model.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()

    # two generations of 8 rows, each scored (old and reference log-probs, chunks of 4 rows) and trained on in two
    # steps of 4 shuffled rows
    assert len(forwards) == 2 * (2 + 2 + 2) and len(engines) == 1
    columns = vllm_routing.moe_layer_columns(config, config.num_hidden_layers)
    for ids, mask, routed in forwards:
        assert routed is not None and routed.shape[:2] == ids.shape
        for row_ids, row_mask, row_routed in zip(ids, mask.bool(), routed):
            engine = torch.from_numpy(engines[0].routing[tuple(row_ids[row_mask].tolist())][:, columns])
            real = row_routed[row_mask]
            assert torch.equal(real[:-1], engine) and (real[-1] == -1).all()  # the last token never ran in vLLM
            assert (row_routed[~row_mask] == -1).all()
    assert len(trainer.state.log_history) >= 4
