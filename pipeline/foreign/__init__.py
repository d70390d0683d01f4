"""Other tools' config files (Axolotl, TRL): their schemas and defaults, the mapping of their keys onto our options, their datasets and padded batches."""
