"""Who the caller is: the authentication middleware (auth), users and API keys (keys), the JWTs and
signed URLs (tokens) and their keys (signing_keys), the audit log (audit), per-user limits (limits)."""
