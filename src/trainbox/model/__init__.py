"""The model families (one sub-package each, declared in its __init__: model/spec.py)."""
# The config's model section is assembled from the families as trainbox.config loads (config/model.py). Loaded here,
# before any family's package, it finds every family whole, whichever module a program imports first.
import trainbox.config  # noqa: F401
