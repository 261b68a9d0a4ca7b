"""Whether this process may read a weights file, asked before safetensors opens it.

safetensors reports a file this process may not open as "No such file or directory":
a model or adapter folder mounted into a pod whose user cannot read one file (a
safetensors file saved with mode 0600, say) looked like a missing file. The loaders ask
first and name the real cause.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional


def unreadable(path: Path) -> Optional[str]:
    """Why this process cannot read the existing file ``path``, or None when it can."""
    if os.access(path, os.R_OK):
        return None
    st = path.stat()
    return (f"{path} is not readable by this process (uid {os.getuid()}, gid {os.getgid()}; the file: "
            f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}, gid {st.st_gid}): make it readable by the "
            "model server's user")
