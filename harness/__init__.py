"""The developer and test harness: a tiny model, SmolLM2 from a wheel, a whole stack from Python, stub generation."""
