"""The pack-data job and the engines that run its steps.

- `job`:        `run_pack_data(PackConfig(...))`: read -> tokenize -> plan -> write -> manifest ->
                verify -> commit, one step per line; with the local engine every step runs in this
                process (tokenize with its worker processes)
- `pack_config`: `PackConfig`, every option of pack-data declared once (click options, checks, tables)
- `ray_engine`: the Ray engine (`--engine ray`): the same steps, read+tokenize and write spread over
                Ray tasks, the shards byte-identical to the local engine's
- `ray_reaper`: stops a local Ray that the job started, even when the job is killed outright
"""
