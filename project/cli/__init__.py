"""Command-line tools, each ``python -m project.cli.<name>``: prepare (a corpus into token shards), report (a sweep's
HTML report), export (a checkpoint to a Hugging Face dir), generate (text from a checkpoint)."""
