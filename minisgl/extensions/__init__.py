"""Extension packages: each registers its plug-ins at import (see minisgl/extension_loader.py)."""
