"""The fraction of the context a run removes unless told otherwise (every press's; a sweep's grid shares it).

A press built bare removes nothing, as kvpress's do; ``BasePress.run_defaults`` gives a run this one. It lives
apart from the presses, which load mlx, so that the pipeline's settings read it without loading them.
"""

COMPRESSION_RATIO = 0.75
