"""Data modules. Batches are split across data-parallel ranks so every device count sees the same global batches."""
