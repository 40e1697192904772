"""Code that runs inside each worker before the user's script (see DESIGN.md).

Importing this package must stay cheap and must not import torch: the launcher imports
it to find the sitecustomize folder.
"""

from pathlib import Path

SITE_DIR = Path(__file__).parent / "site"
