"""Reward functions for the GRPO tests (TRL's signature): graded for a model of random weights, one that leaves
completions unscored (None), one that reads a column of the prompts' lines."""


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def vowel_share(completions, **kwargs):
    """The share of a completion's letters that are vowels; None for one without letters."""
    scores = []
    for completion in completions:
        letters = [character for character in _text(completion).lower() if character.isalpha()]
        scores.append(sum(character in "aeiou" for character in letters) / len(letters) if letters else None)
    return scores


def names_the_person(completions, name, **kwargs):
    """1 for a completion holding the first two letters of the line's ``name``, else 0; None (unscored) where the
    name starts with a vowel."""
    return [
        None if who[0] in "AEIOU" else float(who[:2].lower() in _text(completion).lower())
        for completion, who in zip(completions, name)
    ]
