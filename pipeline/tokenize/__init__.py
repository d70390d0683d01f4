"""Step 2 of pack-data, tokenizing: every example of every input turned into token ids and labels,
in input order, spilled to disk while only the lengths stay in RAM.

- `tokenizer`:       loading the tokenizer, and what the manifest records of it
- `tokenize_inputs`: every input, batch by batch, in parallel, into the spill
- `render`:          the rows of a batch rendered into text segments with loss flags, by format
- `batch`:           one batch of rows -> ids, labels and lengths (BOS/EOS, loss masks)
- `segments`, `long_texts`, `encode_pool`: encoding texts (split at segment boundaries, in bounded
                     calls, in worker processes)
- `spill`:           the tokenized examples on disk, and the gather that reads them back by row
"""
