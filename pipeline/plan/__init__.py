"""Step 3 of pack-data, planning: from the lengths of the tokenized examples to the row (bin) of
every piece; only token counts are seen, never tokens.

- `rows`:            the overlong policy (examples -> pieces of at most max_len) and the row plan
- `binpack`:         the bin packer, `assign_bins` (ffd, bfd, shuffle, sequential, minibatch, pad)
- `binpack_kernels`: its numba kernels
- `eval_split`:      held-out evaluation examples (`--eval-fraction`, `--eval-examples`)
- `mix`:             dataset mixtures (`--mix`): uses per example of each input
"""
