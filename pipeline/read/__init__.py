"""Step 1 of pack-data, reading: the user's inputs resolved into files and streamed as Arrow tables
with exact row positions, and each file's format detected from its columns.

- `sources`:     inputs (files, folders, globs, `datasets` folders, Hub names) resolved into files;
                 packed output refused; the fingerprints the manifest records
- `json_lines`, `tables`, `json_numbers`: the readers of each file format
- `formats`:     what a file's columns mean (text, instruction, chat, pre-tokenized)
- `remote`:      inputs on remote storage (s3://, gs://, ...), downloaded before reading
"""
