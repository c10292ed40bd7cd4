"""SFT of a packed Qwen3.5 model folder with TRL's SFTTrainer: padded, padding-free and packed batches.

    python sft_packed.py --model OUT --dataset DATA.jsonl --mode packing --max_length 4096 --output_dir runs/sft

DATA.jsonl holds one {"text": ...} (or {"messages": [...]}) per line, as SFTTrainer reads it. `--mode`:
  padded        one document per row, right-padded (attention_mask);
  padding_free  the batch's documents concatenated into one row (position_ids, cu_seq_lens_q/k, seq_idx);
  packing       documents packed best-fit into rows of --max_length tokens, then padding-free.
All three give the same loss for the same documents (tests/integrations/test_trl_sft.py). `--lora` trains a LoRA adapter.
A CPU smoke run on a tiny folder and dataset:

    qwen35-packed tiny tiny-dense/ --data tiny-data/
    python examples/sft_packed.py --model tiny-dense --dataset tiny-data/chat/train.jsonl --max_steps 2 --use_cpu
"""

from __future__ import annotations

import argparse

LORA_TARGETS = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_a",
    "in_proj_b",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--output_dir", default="runs/sft")
    parser.add_argument("--mode", choices=["padded", "padding_free", "packing"], default="packing")
    parser.add_argument("--max_length", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--use_cpu", action="store_true")
    args = parser.parse_args(argv)

    import datasets
    import torch
    import trl

    mode = {
        "padded": {},
        "padding_free": {"padding_free": True, "max_length": None},
        "packing": {"packing": True, "max_length": args.max_length},
    }[args.mode]
    config = trl.SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=args.use_cpu,
        model_init_kwargs={"trust_remote_code": True, "dtype": torch.float32 if args.use_cpu else torch.bfloat16},
        **{"max_length": args.max_length, **mode},
    )
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    dataset = datasets.load_dataset("json", data_files=args.dataset)["train"]
    trainer = trl.SFTTrainer(model=args.model, args=config, train_dataset=dataset, peft_config=peft_config)
    trainer.train()
    print("losses:", [round(log["loss"], 4) for log in trainer.state.log_history if "loss" in log])


if __name__ == "__main__":
    main()
