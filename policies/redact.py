"""What a policy error may show of a value that can hold a secret.

Error messages reach stderr, the admin reload answer, the log and ``/admin/workers``: a URL's
``user:password@`` and a key put where a digest belongs must never be printed.
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"//[^/@\s]*@")


def url(value: str) -> str:
    """``value`` with any ``user:password@`` shown as ``***@``."""
    return _USERINFO.sub("//***@", value, count=1)


def has_userinfo(value: str) -> bool:
    return _USERINFO.search(value) is not None
