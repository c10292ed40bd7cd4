#!/usr/bin/env python3
"""Upload a model or PEFT adapter folder to the Hugging Face Hub with a generated model card.

    python hub_upload.py FOLDER --repo-id ORG/NAME [--private] [--base-model ORG/NAME] [--license ID] [--dry-run]

The installed command `qwen35-packed upload` takes the same arguments. The logic lives in `qwen35_packed/hub.py`
(importable, tested); this file is only the entry point.
"""

import sys

from qwen35_packed.hub import main

if __name__ == "__main__":
    sys.exit(main())
