"""The resume transaction: a state saved, then every part checked before anything loads, undone on failure."""
