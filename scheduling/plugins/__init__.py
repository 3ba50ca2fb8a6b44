"""One scheduling plugin per module; each declares the ``PLUGIN`` record ``catalog.py`` lists."""
