"""Run by test_hf under torchrun: transformers.Trainer with DDP (gloo, CPU) on a packed folder."""

import json
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from trainer.data.hf import PackedCollator, packed_dataset
from trainer.model.load import load_model

folder, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
seen = []


class Record(PackedCollator):
    def __call__(self, rows):
        seen.append(sorted(int(i) for r in rows for i in r["example_ids"]))
        return super().__call__(rows)


class Steps(TrainerCallback):
    steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        Steps.steps += 1


torch.set_num_threads(1)
model = load_model("tiny", vocab_size=300, seed=0)
args = TrainingArguments(
    out,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    num_train_epochs=1,
    learning_rate=1e-3,
    use_cpu=True,
    ddp_backend="gloo",
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    train_sampling_strategy="sequential",
    remove_unused_columns=False,
)
trainer = Trainer(model=model, args=args, train_dataset=packed_dataset(folder), data_collator=Record(), callbacks=[Steps()])
trainer.train()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"steps": Steps.steps, "seen": seen, "checksum": float(weights.double().sum()), "first": weights[:8].tolist()}, f)
# the group Trainer (accelerate) opened, closed before exit; then the process ends without the
# interpreter's teardown, where a rank can abort ("terminate called without an active exception").
# What the test checks is in the file written above.
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
