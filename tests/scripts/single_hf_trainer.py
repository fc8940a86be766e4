"""An unchanged HF Trainer job in one process (no memrt import, no launcher): a tiny random-init GPT-2.

    python tests/scripts/single_hf_trainer.py --steps 3 --out params.pt
    MEMRT=1 MEMRT_BUDGET=60% python tests/scripts/single_hf_trainer.py --steps 3 --out params.pt

No download: the model is built from a config. Saves the final ``state_dict`` to ``--out``.
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 100, (n, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=3, n_head=2)  # dropout 0.1
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(output_dir=f"{args.out}.trainer", per_device_train_batch_size=4, max_steps=args.steps,
                              learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                              use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=targs, train_dataset=Tokens(64)).train()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
