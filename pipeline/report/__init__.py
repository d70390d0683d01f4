"""After the job: figures of a packed folder or of a plan (`pack-report`), the summary of a
training run, and `pack-verify --deep`.

- `flops`:         the one count of training FLOPs (pack-train's MFU, pack-report, the benchmarks)
- `stats`:         padding and packing layout figures in plain numpy (pack-data's summary uses them too)
- `folder_report`: packing statistics of a folder, or a what-if plan of raw data
- `report_render`: the terminal table and the HTML page of a report
- `run_summary`:   `pack-report RUN_DIR`, what a pack-train run did
- `deep_check`:    `pack-verify --deep`, a seeded sample of source examples re-tokenized and compared
"""
