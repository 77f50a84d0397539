"""Who a request acts for, once authenticated (gateway/identity/auth.py): a plain value every layer
may hold without reaching the key store or the database."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Caller:
    """The authenticated user a request acts for."""
    user_id: str
    name: str
    org_id: str
    email: str
    admin: bool
    key_id: str

    @property
    def urn(self) -> str:
        return f"tml:organization_user:{self.user_id}"

    @property
    def org_urn(self) -> str:
        return f"tml:organization:{self.org_id}"
