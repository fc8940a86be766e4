"""A Hugging Face Trainer job: a small GPT-2 language model trained with ``transformers.Trainer``.

It does not import memrt. Random init, synthetic tokens, no download; CPU, gloo, 2 processes:

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_lm.py
    MEMRT=1 torchrun --standalone --nproc-per-node 2 examples/hf_trainer_lm.py
    MEMRT=1 MEMRT_BUDGET=70% torchrun --standalone --nproc-per-node 2 examples/hf_trainer_lm.py

Trainer wraps the model in DDP and gives each rank a ``DistributedSampler`` batch. Under ``MEMRT=1`` memrt
runs the job's process group (DDP's gradient all-reduce through memrt.comm), plans the memory of GPT-2's
blocks against the budget, balances the ranks' shares of each global batch when their speeds differ, and
writes ./memrt-report/<run id>/rank<N>.json. Rank 0 prints the last logged loss.
"""

import argparse
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RepeatingTokens(Dataset):
    """Sequences built from a short random motif repeated: a language model can learn them."""

    def __init__(self, count: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        motifs = torch.randint(0, vocab, (count, 8), generator=g)
        self.tokens = motifs.repeat(1, length // 8 + 1)[:, :length]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="per-device batch size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", default="hf-trainer-out", help="Trainer's output_dir")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=args.seq, n_embd=128, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(config)
    train_args = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                                   learning_rate=1e-3, logging_steps=max(1, args.steps // 3), report_to=[],
                                   save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=train_args, train_dataset=RepeatingTokens(512, args.seq, config.vocab_size))
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"final loss {losses[-1]:.4f} after {trainer.state.global_step} steps", flush=True)
    time.sleep(0.05)  # let gloo's worker threads free finished work before the interpreter shuts down


if __name__ == "__main__":
    main()
