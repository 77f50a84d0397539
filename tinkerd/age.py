"""age (filippo.io/age) encryption of exports (SDK 0.38's age_encryption_recipients), through the
`pyrage` package: recipients are "age1..." X25519 keys or SSH public keys. The gateway checks them
before a request is queued, the trainer again before it encrypts (trainer_service/checkpoints.py)."""

from __future__ import annotations

from tinkerd.errors import UserError

SUFFIX = ".age"
MAX_RECIPIENTS = 64


def recipients(texts) -> list:
    """pyrage recipients from their text; a user error naming the first that does not parse."""
    import pyrage

    texts = list(texts)
    if len(texts) > MAX_RECIPIENTS:
        raise UserError(f"age_encryption_recipients has {len(texts)} recipients; at most {MAX_RECIPIENTS}")
    parsed = []
    for i, text in enumerate(texts):
        for kind in (pyrage.x25519.Recipient, pyrage.ssh.Recipient):
            try:
                parsed.append(kind.from_str(text.strip()))
                break
            except (pyrage.RecipientError, ValueError):
                continue
        else:
            raise UserError(f"age_encryption_recipients[{i}] {text[:80]!r} is neither an age X25519 recipient "
                            f"(age1...) nor an SSH public key (ssh-ed25519 / ssh-rsa ...)")
    return parsed
