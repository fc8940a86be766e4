"""An accelerate training script: a small Llama (transformers, random init) with gradient accumulation.

It does not import memrt. Synthetic tokens, no download; CPU, gloo, 2 processes, launched by accelerate or
torchrun:

    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py
    MEMRT=1 accelerate launch --cpu --num_processes 2 examples/accelerate_train.py
    MEMRT=1 torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py

``accelerator.prepare`` wraps the model in DDP and shards the DataLoader; ``accelerator.accumulate`` skips the
gradient all-reduce on all but the last micro-batch of each step. Under ``MEMRT=1`` memrt runs the process
group accelerate creates (DDP's all-reduces through memrt.comm), plans the memory of the Llama decoder
layers and balances the ranks' shares when their speeds differ. Rank 0 prints the loss of the last step.
"""

import argparse
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.steps * args.accumulate * args.batch * 2, args.seq),
                           generator=g)
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    steps, loss = 0, torch.tensor(0.0)
    while steps < args.steps:
        for (batch,) in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                if steps >= args.steps:
                    break
    if accelerator.is_main_process:
        print(f"final loss {loss.item():.4f} after {steps} steps", flush=True)
    accelerator.end_training()
    time.sleep(0.05)  # let gloo's worker threads free finished work before the interpreter shuts down


if __name__ == "__main__":
    main()
