"""The names of what pack-train writes into its run folder (`--out`), defined here only: pack-train
writes them (trainer/run/), pack-report reads them (`pipeline.report.run_summary`) and pack-data names
a run folder given where a packed folder belongs (`pipeline.shards.manifest.read_manifest`).

    RUN/config.json          the run's options, written first (`RUN_CONFIG`)
    RUN/metrics.jsonl        a line every --log-every steps and one per evaluation (`METRICS`)
    RUN/summary.json         the whole run, written when it ends (`SUMMARY`); RUN/ranks/rank{r}.json
    RUN/loss.png             the losses against the step (`LOSS_PLOT`)
    RUN/checkpoints/step-N/  the checkpoints; checkpoints/latest names the newest (`LATEST`)
    RUN/best.json            the checkpoint of the lowest eval loss, under --save-best (`BEST`)
"""

RUN_CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
RANKS = "ranks"
CHECKPOINTS = "checkpoints"
LATEST = "latest"  # inside CHECKPOINTS
BEST = "best.json"
SUPERSEDED = "superseded"  # RUN/superseded/N/: checkpoints a roll-back set aside
MERGED = "merged"  # --merge-lora's full model
TENSORBOARD = "tensorboard"  # --report-to tensorboard
PROFILE = "profile"  # --profile-steps
RUN_LOCK = ".pack-train.lock"  # one run per run folder at a time

# the entries a run writes into its folder, and may replace or remove (`trainer.run.nesting`)
RUN_ENTRIES = (CHECKPOINTS, MERGED, TENSORBOARD, PROFILE, RANKS, RUN_CONFIG, METRICS, SUMMARY, LOSS_PLOT)
