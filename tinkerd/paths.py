"""On-disk names for ids that hold ':' and '/' (model ids, snapshot ids), shared by the services."""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]")


def dir_name(identifier: str) -> str:
    """`sess-1:train:0@3-ab` -> `sess-1_train_0@3-ab`: one path component, no separators."""
    return _UNSAFE.sub("_", identifier)
