"""An unchanged HF Trainer job (no memrt import): a tiny BERT classifier, 2 ranks under torchrun.

    MEMRT=1 torchrun --standalone --nproc-per-node 2 tests/scripts/hf_trainer_job.py --out run

``BALANCE_JOB_DELAY="1=0.002"`` makes rank 1 sleep 2 ms per sample in forward (a slow rank without root).
Each rank writes ``<out>.rank<N>.json``: the batch size of every training forward and a fingerprint of each
of its samples (position-weighted token sums); rank 0 saves the final parameters to ``<out>.params.pt``.
"""

import argparse
import json
import os
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 100, (n, 16), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    delay = 0.0
    for item in filter(None, os.environ.get("BALANCE_JOB_DELAY", "").split(",")):
        r, _, s = item.partition("=")
        delay = float(s) if int(r) == rank else delay
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    sizes, rows = [], []

    def note(_m, a, kw, _out):
        ids = kw.get("input_ids") if kw else None
        ids = ids if ids is not None else a[0]
        if torch.is_grad_enabled():
            sizes.append(int(ids.shape[0]))
            rows.append(sorted(int(v) for v in (ids * torch.arange(1, ids.shape[1] + 1)).sum(1)))
            if delay:
                time.sleep(delay * ids.shape[0])

    model.register_forward_hook(note, with_kwargs=True)
    targs = TrainingArguments(output_dir=f"{args.out}.trainer", per_device_train_batch_size=8, max_steps=args.steps,
                              learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                              use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Pairs(400))
    trainer.train()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "sizes": sizes, "rows": rows}, f)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], f"{args.out}.params.pt")
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
