"""Writing files safely: atomic writes and fsync (`durable`), paths that stay inside their folder (`contained`), folder locks (`folder_lock`)."""
