"""What a target position can hold besides a token or a class: the mark of one no loss trains."""

IGNORE_INDEX = -100  # a target not trained on: torch's cross_entropy default (data=chat's prompts and padding)
