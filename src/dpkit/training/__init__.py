"""The training core: the Engine, the recipe behind `dpkit train`, resumable state and clean checkpoints."""
