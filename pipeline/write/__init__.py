"""Step 4 of pack-data, writing: the planned rows gathered from the spill into shard files (the
format is `pipeline.shards`'), checked as they are on disk, in an output folder that appears only
when complete.

- `shard_writer`: gather, write, hash and check each shard
- `outdir`:       the output folder: checked first, written as a hidden sibling, renamed when done
- `remote_out`:   a remote `--out`: the finished folder uploaded, its manifest last
"""
