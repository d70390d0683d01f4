"""Step 1 of pack-data, reading: the user's inputs resolved into files and streamed as Arrow tables
with exact row positions, and each file's format detected from its columns.

- `sources`:      inputs (files, folders, globs, `datasets` folders, Hub ids) resolved into files;
                  packed output refused; the fingerprints the manifest records
- `batches`:      the resolved inputs streamed as tables of rows, each row's location known
- `chunks`:       inputs cut into parts read on their own (the Ray engine's unit of work)
- `json_lines`, `json_array`, `json_records`, `json_numbers`, `tables`: the readers of each file format
- `formats`:      what a file's columns mean (text, instruction, chat, pre-tokenized)
- `remote`:       remote storage (s3://, gs://, ...): remote inputs downloaded before reading
- `hub`:          path or Hugging Face Hub id; an id's files from the local cache or downloaded
                  (datasets here; the tokenizer and the trainer's model use it too)
"""
