"""One scheduling plugin per module; ``registry.py`` maps their type names to factories."""
