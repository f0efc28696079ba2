"""Files and state directories: clean, atomic, checksummed model files and resumable states (no strategy imported)."""
