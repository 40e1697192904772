"""The Hugging Face Trainer with gradient checkpointing, as users write it, under torchrun:
a GPT-2 built from a tiny GPT2Config (no download), synthetic token data, gradient
accumulation 2, max_grad_norm 1.0, AdamW with warm-up, a few steps.

--reentrant 1 asks for `use_reentrant=True` (the kind transformers 4.x used by default and
HF's docs still show); --reentrant 0 for the non-reentrant kind (transformers 5's default).
--find-unused 0/1 sets `ddp_find_unused_parameters` (left unset with -1: the Trainer's choice).

Rank 0 saves the final model's state_dict to --out."""

import argparse
import dataclasses

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from exact_common import end_process_group


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, length, vocab):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", type=int, choices=(0, 1), default=1)
    p.add_argument("--find-unused", type=int, choices=(-1, 0, 1), default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name
    # is a deprecated alias until v6): use the name this version has.
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs = {ckpt: True, f"{ckpt}_kwargs": {"use_reentrant": bool(a.reentrant)}}
    if a.find_unused >= 0:
        kwargs["ddp_find_unused_parameters"] = bool(a.find_unused)
    if "use_cpu" in fields:
        kwargs["use_cpu"] = True
    args = TrainingArguments(
        output_dir=a.workdir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=1e-3, warmup_steps=2, max_steps=a.steps,
        optim="adamw_torch", lr_scheduler_type="linear", weight_decay=0.01,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, ddp_backend="gloo", **kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 16, config.vocab_size))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)
    end_process_group()  # the Trainer leaves it to the script


if __name__ == "__main__":
    main()
