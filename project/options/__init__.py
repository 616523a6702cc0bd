"""What a user may set and how a bad value is refused: ``ConfigError`` (the key, the problem, the fix) and the option
ranges constructors declare (``PositiveInt``...). The bottom layer: free of heavy imports, used by every other."""
