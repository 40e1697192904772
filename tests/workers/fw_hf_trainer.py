"""The Hugging Face Trainer as users write it, for tests/test_frameworks.py: a BERT for
sequence classification from a tiny BertConfig (2 layers, hidden 32, vocab 128; no
download), synthetic token data, everything else left at the Trainer's defaults that
matter here: ddp_find_unused_parameters unset (the Trainer then passes
find_unused_parameters=True for a PreTrainedModel without gradient checkpointing),
max_grad_norm 1.0 (clipping every step), AdamW, a linear schedule. A few steps.

--accum N: gradient_accumulation_steps=N (the Trainer runs the first N-1 micro-batches
under accelerator.no_sync(model), i.e. DDP's no_sync()).
Rank 0 saves the final model's state_dict to --out."""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from exact_common import end_process_group


class Sentences(torch.utils.data.Dataset):
    def __init__(self, n, length, vocab, classes):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=3)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=a.workdir, per_device_train_batch_size=4, gradient_accumulation_steps=a.accum,
        learning_rate=1e-3, max_steps=a.steps, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=Sentences(64, 16, config.vocab_size, 3))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)
    end_process_group()  # the Trainer leaves it to the script


if __name__ == "__main__":
    main()
