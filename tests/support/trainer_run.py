"""A real Hugging Face `Trainer` run, as a trainer process writes checkpoints:
`python -m tests.support.trainer_run MODEL OUTPUT_DIR [SECONDS]` fine-tunes MODEL (loaded in
float32, as Trainer keeps it) and saves `checkpoint-N/` into OUTPUT_DIR every 2 of 6 steps,
keeping the last 2 (`save_total_limit`: older ones are deleted while the run goes on); SECONDS
of training time pass after each save (a tiny model trains in milliseconds)."""

from __future__ import annotations

import sys
import time


def main(model_dir: str, output_dir: str, seconds: str = "0") -> None:
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sequences = torch.randint(3, 250, (12, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in sequences]
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        save_steps=2,
        save_total_limit=2,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        report_to="none",
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class TrainingTime(TrainerCallback):  # type: ignore[misc]
        def on_save(self, *args: object, **kwargs: object) -> None:
            time.sleep(float(seconds))

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainingTime()])  # type: ignore[arg-type]
    trainer.train()


if __name__ == "__main__":
    main(*sys.argv[1:4])
