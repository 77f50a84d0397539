"""Each session's request spans (spans), what they add up to for the console (session_metrics), and
the Perfetto trace built from them (pftrace)."""
