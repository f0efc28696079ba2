"""The loop API: the Engine, its wrappers, where a process stands, loaders that resume, and the resume transaction."""
